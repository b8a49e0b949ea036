"""KL estimators against hand-derived values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.kl import k1, k2, k3, sequence_kl

# pi = 0.5, ref = 0.25 at the sampled token: log r = log(ref / pi) = -log 2, r = 0.5
LOG_PI, LOG_REF = math.log(0.5), math.log(0.25)
LN2 = math.log(2.0)


@pytest.mark.parametrize(
    ("estimator", "value", "grad"),
    [
        (k1, LN2, 1.0),  # -log r; d/dlog pi = 1
        (k2, 0.5 * LN2**2, LN2),  # (log r)^2 / 2; d/dlog pi = -log r
        (k3, (0.5 - 1) + LN2, 0.5),  # r - 1 - log r; d/dlog pi = 1 - r
    ],
)
def test_each_estimator_has_its_value_and_gradient(estimator, value, grad):
    logp = torch.tensor([LOG_PI], dtype=torch.float64, requires_grad=True)
    out = estimator(logp, torch.tensor([LOG_REF], dtype=torch.float64))
    out.sum().backward()
    assert out.item() == pytest.approx(value, abs=1e-12)
    assert logp.grad.item() == pytest.approx(grad, abs=1e-12)


def test_all_estimators_vanish_where_pi_equals_ref_and_k2_k3_never_go_negative():
    logp = torch.log(torch.tensor([0.1, 0.5, 0.9]))
    for estimator in (k1, k2, k3):
        assert torch.equal(estimator(logp, logp), torch.zeros(3))
    ref = torch.log(torch.tensor([0.9, 0.2, 0.1]))
    assert (k1(logp, ref) < 0).any()  # k1 is unbiased but not pointwise positive
    assert (k2(logp, ref) >= 0).all() and (k3(logp, ref) >= 0).all()


def test_k3_does_not_overflow_on_a_token_far_from_the_reference():
    assert torch.isfinite(k3(torch.tensor([-200.0]), torch.tensor([0.0]))).all()


def test_sequence_kl_sums_the_valid_tokens_of_each_row():
    logp = torch.tensor([[LOG_PI, LOG_PI, 0.0], [LOG_PI, 0.0, 0.0]])
    ref = torch.tensor([[LOG_REF, LOG_REF, 5.0], [LOG_REF, 5.0, 5.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert sequence_kl(logp, ref, mask, "k1").tolist() == pytest.approx([2 * LN2, LN2])
