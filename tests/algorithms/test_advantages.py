import pytest
import torch

from relayrl.algorithms.advantages import (
    ADVANTAGES,
    dr_grpo_advantages,
    frac_zero_signal_groups,
    grpo_advantages,
)


def close(actual, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=0.0)


def test_grpo_standardises_within_group_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])

    # mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6) = +-0.999998
    close(grpo_advantages(rewards, 4), [0.999998, -0.999998, -0.999998, 0.999998])


def test_grpo_uses_population_std():
    rewards = torch.tensor([3.0, 0.0, 0.0])

    # mean 1, deviations [2, -1, -1], population var (4 + 1 + 1) / 3 = 2, std 1.41421
    # (the unbiased std sqrt(3) would give [1.1547, -0.57735, -0.57735])
    close(grpo_advantages(rewards, 3), [1.41421, -0.70711, -0.70711])


def test_grpo_gives_exact_zero_to_groups_with_equal_rewards():
    # 0.1 + 0.1 + 0.1 rounds, so r - mean alone would leave a residue blown up by 1 / eps
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0])

    advantages = grpo_advantages(rewards, 3)

    assert torch.equal(advantages[:3], torch.zeros(3))
    # second group: mean 2/3, deviations [1/3, -2/3, 1/3], population std sqrt(2)/3 = 0.47140
    close(advantages[3:], [0.70711, -1.41421, 0.70711])


def test_dr_grpo_only_centres():
    rewards = torch.tensor([3.0, 0.0, 0.0, 1.0, 1.0, 4.0])

    # group means 1 and 2 -> [3-1, 0-1, 0-1, 1-2, 1-2, 4-2]
    expected = [2.0, -1.0, -1.0, -1.0, -1.0, 2.0]
    close(dr_grpo_advantages(rewards, 3), expected)
    close(grpo_advantages(rewards, 3, normalize_std=False), expected)


def test_advantages_dict_shares_one_signature():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])

    # groups [1, 0] (mean 0.5, std 0.5) and [2, 2] (no signal)
    close(ADVANTAGES["grpo"](rewards, 2), [0.999998, -0.999998, 0.0, 0.0])
    close(ADVANTAGES["dr_grpo"](rewards, 2), [0.5, -0.5, 0.0, 0.0])


def test_group_size_one_has_no_signal():
    rewards = torch.tensor([1.0, 0.0, 0.5])

    assert torch.equal(grpo_advantages(rewards, 1), torch.zeros(3))
    assert frac_zero_signal_groups(rewards, 1) == 1.0


def test_bad_layout_is_rejected():
    with pytest.raises(ValueError, match="N=5 entries, not a multiple of group_size=4"):
        grpo_advantages(torch.zeros(5), 4)
    with pytest.raises(ValueError, match="group_size must be >= 1, got group_size=0"):
        grpo_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match=r"rewards must be 1-D \[N\], got shape \(2, 2\)"):
        grpo_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="N=3 entries, not a multiple of group_size=2"):
        frac_zero_signal_groups(torch.zeros(3), 2)


def test_frac_zero_signal_groups():
    # groups [1, 1] [0, 1] [0, 0] [1, 0]: the first and third are all equal -> 2 / 4
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])

    fraction = frac_zero_signal_groups(rewards, 2)

    assert isinstance(fraction, float)
    assert fraction == 0.5
