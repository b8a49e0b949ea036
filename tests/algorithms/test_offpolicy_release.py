"""The stale-data corrections as their authors ship them (m2po_release, mis_seq_verl, geo_mask,
VCPO's baseline), and the ``kept_frac`` every loss reports, against hand-derived numbers."""

import math

import pytest
import torch

from relayrl.algorithms.losses import LOSSES

TOL = {"atol": 1e-5, "rtol": 0.0}
NAN, INF = float("nan"), float("inf")


def close(actual, expected) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), torch.tensor(expected), **TOL
    )


def leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


# Each case: a loss and a batch in which no token carries a gradient (log-ratios given, mu = 0).
NOTHING_TO_LEARN = [
    # the one sequence has W = e^1 = 2.72 > upper 2: rejected whole
    ("mis_seq", [[0.5, 0.5]], [[1.0, 1.0]], {}),
    # (log r)^2 = 0.25 and 0.09 both exceed tau 0.04: even the smaller alone is masked
    ("m2po", [[0.5, -0.3]], [[1.0, -1.0]], {}),
    # r = e^0.5 = 1.65 > 1.2 with A > 0, r = e^-0.5 = 0.61 < 0.8 with A < 0: both clipped
    ("ppo_clip", [[0.5, -0.5]], [[1.0, -1.0]], {}),
    # r = e^2 = 7.39 > rho 4 on both: clamped to the constant rho
    ("aipo_clamp", [[2.0, 2.0]], [[1.0, -1.0]], {}),
    # no clip or mask, but every advantage is 0: no signal
    ("aipo", [[0.5, -0.3]], [[0.0, 0.0]], {}),
]


@pytest.mark.parametrize(("name", "log_ratios", "advantages", "kwargs"), NOTHING_TO_LEARN)
def test_a_batch_with_nothing_to_learn_has_zero_gradient_and_kept_frac_zero(
    name, log_ratios, advantages, kwargs
):
    logp = leaf(log_ratios)
    loss, metrics = LOSSES[name](
        logp, torch.zeros(1, 2), torch.tensor(advantages), torch.ones(1, 2), **kwargs
    )
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))
    assert metrics["kept_frac"] == 0.0


def test_kept_frac_counts_the_tokens_that_carry_a_gradient_by_hand():
    # aipo_clamp at rho 4: r = [e^2 = 7.39 (clamped, constant), 1, e^0.5 = 1.65, 1]; the last
    # token has A = 0. Of 4 valid tokens, tokens 1 and 2 carry a gradient: kept_frac = 2/4.
    logp = leaf([[2.0, 0.0, 0.5, 0.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, 0.0]])
    loss, metrics = LOSSES["aipo_clamp"](logp, torch.zeros(1, 4), advantages, torch.ones(1, 4))
    loss.backward()
    assert metrics["kept_frac"] == 0.5
    # d loss / d log pi = -r * A / 4 below rho, 0 above it and where A = 0
    close(logp.grad, [[0.0, -0.25, math.exp(0.5) / 4, 0.0]])
