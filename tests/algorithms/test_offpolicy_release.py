"""The stale-data corrections as their authors ship them (m2po_release, mis_seq_verl, geo_mask,
VCPO's baseline), and the ``kept_frac`` every loss reports, against hand-derived numbers."""

import math

import pytest
import torch

from relayrl.algorithms.losses import LOSSES, m2po_release_loss, m2po_release_threshold

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


def harmful_batch():
    """One row of five tokens, mu = 0, so log r = logp: [0.5, -0.25, 0.125, -0.5, 0] with
    A = [1, -1, 1, 1, 1]. Harmful (A > 0 with r > 1, or A < 0 with r < 1): tokens 0, 1, 2, with
    (log r)^2 = 0.25, 0.0625, 0.015625 (exact in binary). Token 3 drifted the other way."""
    logp = leaf([[0.5, -0.25, 0.125, -0.5, 0.0]])
    advantages = torch.tensor([[1.0, -1.0, 1.0, 1.0, 1.0]])
    return logp, torch.zeros(1, 5), advantages, torch.ones(1, 5)


def test_m2po_release_threshold_caps_the_harmful_second_moment_by_hand():
    # sorted [0.015625, 0.0625, 0.25]: M2 = 0.328125 / 3 = 0.109375 > 0.04, budget sum 0.12.
    # capping at 0.015625: 3 * 0.015625 = 0.046875 < 0.12; at 0.0625: 0.015625 + 2 * 0.0625 =
    # 0.140625 >= 0.12. The largest cap under the budget is 0.015625: c = 0.125.
    values = torch.tensor([0.25, 0.0625, 0.015625])
    assert m2po_release_threshold(values, 0.04) == 0.015625
    # a looser budget 0.05 (sum 0.15) still stops at 0.0625: 0.140625 < 0.15 but 0.328125 is not
    assert m2po_release_threshold(values, 0.05) == 0.0625
    # M2 within the budget, or no harmful token: no clip
    assert m2po_release_threshold(values, 0.109375) == math.inf
    assert m2po_release_threshold(torch.tensor([]), 0.04) == math.inf
    # even the smallest cap reaches the budget (2 * 0.25 >= 2 * 0.04): c = 0
    assert m2po_release_threshold(torch.tensor([0.25, 0.25]), 0.04) == 0.0


def test_m2po_release_threshold_is_the_largest_cap_under_budget_in_any_order():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        values = torch.rand(9, generator=generator) ** 3
        budget = 0.02
        capped_means = {float(v): float(values.clamp(max=v).mean()) for v in values}
        under = [v for v, m in capped_means.items() if m < budget]
        expected = math.inf if values.mean() <= budget else max(under, default=0.0)
        assert m2po_release_threshold(values, budget) == pytest.approx(expected, rel=1e-6)
        shuffled = values[torch.randperm(9, generator=generator)]
        assert m2po_release_threshold(shuffled, budget) == m2po_release_threshold(values, budget)


def test_m2po_release_clips_harmful_tokens_and_keeps_the_rest_by_hand():
    logp, mu_logp, advantages, mask = harmful_batch()

    loss, metrics = m2po_release_loss(logp, mu_logp, advantages, mask, budget=0.04)
    loss.backward()

    # c^2 = 0.015625 (test above), c = 0.125: tokens 0 and 1 are clipped, at exp(0.125) and
    # exp(-0.125); token 2 sits exactly at c and is not. Token 3 (A > 0, r = e^-0.5) drifted the
    # other way and keeps r * A; the arXiv m2po would mask it as an outlier (log r)^2 = 0.25.
    # terms: 1.133148*1, 0.882497*(-1), e^0.125*1 = 1.133148, e^-0.5*1 = 0.606531, 1*1
    # loss = -(1.133148 - 0.882497 + 1.133148 + 0.606531 + 1) / 5 = -0.598066
    close(loss, -0.598066)
    # grad = -r * A / 5 on unclipped tokens, exactly 0 on clipped ones
    close(logp.grad, [[0.0, 0.0, -0.226630, -0.121306, -0.2]])
    assert logp.grad[0, :2].tolist() == [0.0, 0.0]
    close(metrics["clip_frac"], 2 / 5)
    close(metrics["kept_frac"], 3 / 5)
    close(metrics["m2_harmful"], 0.109375)


def test_m2po_release_clips_nothing_when_the_harmful_moment_is_within_budget():
    logp, mu_logp, advantages, mask = harmful_batch()
    # budget = M2 of the harmful tokens: the unclipped surrogate, grad -r * A / 5 everywhere
    loss, metrics = m2po_release_loss(logp, mu_logp, advantages, mask, budget=0.109375)
    loss.backward()
    ratio = torch.tensor([[0.5, -0.25, 0.125, -0.5, 0.0]]).exp()
    close(logp.grad, (-ratio * advantages / 5).tolist())
    assert metrics["clip_frac"] == 0.0


def test_m2po_release_clipped_ratio_too_large_for_exp_leaves_a_finite_gradient():
    # token 0: log r = 200 (e^200 is inf in float32), A > 0, harmful and far over any budget
    logp = leaf([[200.0, 0.0, 0.0]])
    loss, metrics = m2po_release_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3))
    loss.backward()
    # the only harmful token: c = 0, clipped at exp(0) = 1; the others are on-policy
    close(loss, -1.0)
    close(logp.grad, [[0.0, -1 / 3, -1 / 3]])
    assert metrics["clip_frac"] == pytest.approx(1 / 3)
