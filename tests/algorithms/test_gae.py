import math

import pytest
import torch

from relayrl.algorithms.advantages import gae

NAN = math.nan


def close(actual, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=0.0)


def naive_gae(
    rewards: list[float], values: list[float], terminated: bool, gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """One segment of L steps, values of length L + 1; the textbook backward loop."""
    length = len(rewards)
    advantages = [0.0] * length
    running = 0.0
    for t in reversed(range(length)):
        last = t == length - 1
        next_value = 0.0 if last and terminated else values[t + 1]
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values, strict=False)]


def three_step_batch():
    """Rows: the same 3 steps cut (bootstrap 4.0) and terminated; a 2-step row with nan padding."""
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 0.0, 2.0], [1.0, 0.0, NAN]])
    values = torch.tensor([[0.5, 1.0, 1.5, 4.0], [0.5, 1.0, 1.5, 4.0], [0.5, 1.0, 3.0, NAN]])
    terminated = torch.tensor([False, True, False])
    mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    return rewards, values, terminated, mask


def test_gae_three_steps_by_hand_with_and_without_bootstrap():
    advantages, returns = gae(*three_step_batch(), gamma=0.9, lam=0.8)

    # deltas, cut row: [1 + 0.9*1.0 - 0.5, 0 + 0.9*1.5 - 1.0, 2 + 0.9*4.0 - 1.5] = [1.4, 0.35, 4.1]
    #   A2 = 4.1, A1 = 0.35 + 0.72*4.1 = 3.302, A0 = 1.4 + 0.72*3.302 = 3.77744
    # terminated row: the last delta is 2 - 1.5 = 0.5 (no bootstrap)
    #   A2 = 0.5, A1 = 0.35 + 0.72*0.5 = 0.71, A0 = 1.4 + 0.72*0.71 = 1.9112
    # 2-step row, bootstrap 3.0: deltas [1.4, 0 + 0.9*3.0 - 1.0 = 1.7]
    #   A1 = 1.7, A0 = 1.4 + 0.72*1.7 = 2.624; padding stays 0 despite the nan there
    close(advantages, [[3.77744, 3.302, 4.1], [1.9112, 0.71, 0.5], [2.624, 1.7, 0.0]])
    # returns = A + V; a terminal step's return is just its reward (2.0)
    close(returns, [[4.27744, 4.302, 5.6], [2.4112, 1.71, 2.0], [3.124, 2.7, 0.0]])


def test_gae_lambda_zero_is_one_step_td():
    advantages, _ = gae(*three_step_batch(), gamma=0.9, lam=0.0)
    close(advantages, [[1.4, 0.35, 4.1], [1.4, 0.35, 0.5], [1.4, 1.7, 0.0]])


def test_gae_lambda_one_is_discounted_return_minus_value():
    advantages, returns = gae(*three_step_batch(), gamma=0.9, lam=1.0)
    # cut row:        G0 = 1 + 0.9*0 + 0.81*2 + 0.729*4.0 = 5.536, G1 = 0.9*2 + 0.81*4 = 5.04,
    #                 G2 = 2 + 0.9*4 = 5.6
    # terminated row: G0 = 1 + 0.81*2 = 2.62, G1 = 1.8, G2 = 2
    # 2-step row:     G0 = 1 + 0 + 0.81*3.0 = 3.43, G1 = 0.9*3.0 = 2.7
    close(returns, [[5.536, 5.04, 5.6], [2.62, 1.8, 2.0], [3.43, 2.7, 0.0]])
    close(advantages, [[5.036, 4.04, 4.1], [2.12, 0.8, 0.5], [2.93, 1.7, 0.0]])


def test_gae_gamma_zero_is_reward_minus_value():
    advantages, returns = gae(*three_step_batch(), gamma=0.0, lam=0.95)
    close(advantages, [[0.5, -1.0, 0.5], [0.5, -1.0, 0.5], [0.5, -1.0, 0.0]])
    close(returns, [[1.0, 0.0, 2.0], [1.0, 0.0, 2.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_a_naive_per_row_loop(seed):
    generator = torch.Generator().manual_seed(seed)
    batch, steps = 16, 12
    gamma = 0.5 + 0.5 * torch.rand((), generator=generator).item()
    lam = torch.rand((), generator=generator).item()
    lengths = torch.randint(0, steps + 1, (batch,), generator=generator)
    lengths[:2] = torch.tensor([0, steps])  # an empty row and a full one
    terminated = torch.rand(batch, generator=generator) < 0.5
    rewards = torch.randn(batch, steps, generator=generator, dtype=torch.float64)
    values = torch.randn(batch, steps + 1, generator=generator, dtype=torch.float64)
    mask = torch.arange(steps) < lengths.unsqueeze(1)
    # Garbage past each row's valid part (and its bootstrap value) must not matter.
    rewards[~mask] = NAN
    values[torch.arange(steps + 1) > lengths.unsqueeze(1)] = NAN

    advantages, returns = gae(rewards, values, terminated, mask, gamma=gamma, lam=lam)

    expected_adv = torch.zeros(batch, steps, dtype=torch.float64)
    expected_ret = torch.zeros(batch, steps, dtype=torch.float64)
    for i, length in enumerate(lengths.tolist()):
        adv, ret = naive_gae(
            rewards[i, :length].tolist(),
            values[i, : length + 1].tolist(),
            bool(terminated[i]),
            gamma,
            lam,
        )
        expected_adv[i, :length] = torch.tensor(adv, dtype=torch.float64)
        expected_ret[i, :length] = torch.tensor(ret, dtype=torch.float64)
    torch.testing.assert_close(advantages, expected_adv)
    torch.testing.assert_close(returns, expected_ret)
    assert advantages.dtype == torch.float64


def test_gae_ignores_the_bootstrap_value_of_a_terminated_row():
    rewards, values, terminated, mask = three_step_batch()
    values[1, 3] = NAN
    advantages, _ = gae(rewards, values, terminated, mask, gamma=0.9, lam=0.8)
    close(advantages[1], [1.9112, 0.71, 0.5])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gamma": 1.5}, "gamma=1.5"),
        ({"lam": -0.1}, "lam=-0.1"),
        ({"mask": torch.tensor([[True, False, True]] * 3)}, "prefix"),
        ({"values": torch.zeros(3, 3)}, r"values must be \[B, T \+ 1\]"),
        ({"terminated": torch.zeros(3, 1, dtype=torch.bool)}, r"terminated must be \[B\]"),
        ({"mask": torch.ones(3, 4, dtype=torch.bool)}, r"share one shape \[B, T\]"),
    ],
)
def test_gae_rejects_bad_input(change, message):
    rewards, values, terminated, mask = three_step_batch()
    args = {"rewards": rewards, "values": values, "terminated": terminated, "mask": mask}
    kwargs = {"gamma": 0.9, "lam": 0.8}
    for key, value in change.items():
        (kwargs if key in kwargs else args)[key] = value
    with pytest.raises(ValueError, match=message):
        gae(**args, **kwargs)
