"""Decoupled PPO: hand-derived value and gradient, and AIPO's gradient at one minibatch."""

import math

import pytest
import torch

from relayrl.algorithms.decoupled import behaviour_weight, decoupled_loss
from relayrl.algorithms.losses import aipo_loss, ppo_clip_loss


def test_decoupled_ppo_value_gradient_and_metrics_by_hand():
    # three valid tokens and one of padding (nan and a huge ratio there must not show up)
    mu = torch.tensor([[-1.0, -1.0, -1.0, math.nan]])
    prox = torch.tensor([[-0.5, -1.0, -2.0, 0.0]])
    logp = torch.tensor([[-0.3, -1.0, -2.5, 50.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, 2.0, 9.0]])
    mask = torch.tensor([[True, True, True, False]])

    loss, metrics = decoupled_loss(
        ppo_clip_loss, logp, mu, prox, advantages, mask, cap=1.5, clip_eps=0.2
    )
    loss.backward()

    # w = min(prox / mu, 1.5): e^0.5 = 1.649 capped to 1.5, e^0 = 1, e^-1 = 0.36788
    # r = pi / prox: e^0.2 = 1.2214 (A > 0: clipped to 1.2, no gradient), 1, e^-0.5 = 0.60653
    # (A > 0 below 1 - eps: the unclipped term, 0.60653 * 2 = 1.21306)
    # loss = -(1.5 * 1.2 + 1 * (1 * -1) + 0.36788 * 1.21306) / 3 = -(0.8 + 2 e^-1.5) / 3
    expected = -(0.8 + 2 * math.exp(-1.5)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # d loss / d log pi = -w r A / 3 where the clip is not active, 0 where it is
    grad = [0.0, 1 / 3, -2 * math.exp(-1.5) / 3, 0.0]
    torch.testing.assert_close(logp.grad, torch.tensor([grad]), atol=1e-6, rtol=0)
    assert metrics["clip_frac"] == pytest.approx(1 / 3)
    assert metrics["behaviour_weight"] == pytest.approx((1.5 + 1 + math.exp(-1)) / 3)


def test_the_behaviour_weight_is_capped_and_zero_on_padding():
    # prox / mu = e^500 overflows exp() to inf: the cap, exactly
    prox = torch.tensor([[500.0, 0.0, -1.0]])
    mu = torch.tensor([[0.0, 0.0, math.inf]])
    weight = behaviour_weight(prox, mu, torch.tensor([[True, True, False]]), cap=2.0)
    assert weight.tolist() == [[2.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="cap must be > 0"):
        behaviour_weight(prox, mu, torch.ones_like(prox, dtype=torch.bool), cap=0.0)


@pytest.mark.parametrize("cap", [0.13, 0.5, 2.0, 8.0])
def test_the_behaviour_weight_is_what_the_vla_trainer_computed_inline_bit_for_bit(cap):
    # The VLA trainer weighed its tokens by (prox - mu).exp().clamp(max=cap) before it called
    # behaviour_weight: the same tensor, bit for bit, so its loss is unchanged. At cap 0.13,
    # exp(log 0.13) is a float32 ulp away from 0.13: the clamp must come after the exp.
    generator = torch.Generator().manual_seed(1)
    mu = -torch.rand(64, 7, generator=generator) * 4
    prox = mu + torch.randn(64, 7, generator=generator) * 2  # weights from ~e^-6 to e^6
    prox[0, :3] = mu[0, :3] + torch.tensor([math.log(cap), 90.0, 200.0])  # at the cap, inf
    inline = (prox - mu).exp().clamp(max=cap)
    weight = behaviour_weight(prox, mu, torch.ones_like(mu, dtype=torch.bool), cap)
    assert torch.equal(weight, inline)
    assert (weight == cap).sum() >= 3 and (weight < cap).any()


@pytest.mark.parametrize("cap", [0.5, 2.0])
def test_with_one_minibatch_the_decoupled_gradient_is_aipos_with_rho_at_the_cap(cap):
    # one minibatch per version: the proximal policy is the one being differentiated
    generator = torch.Generator().manual_seed(0)
    logp_values = -torch.rand(3, 5, generator=generator) * 3
    mu = logp_values + torch.randn(3, 5, generator=generator)  # ratios from ~e^-2 to e^2
    advantages = torch.randn(3, 5, generator=generator)
    mask = torch.rand(3, 5, generator=generator) > 0.2

    decoupled = logp_values.clone().requires_grad_(True)
    loss, _ = decoupled_loss(
        ppo_clip_loss, decoupled, mu, decoupled.detach(), advantages, mask, cap=cap, clip_eps=0.2
    )
    loss.backward()
    aipo = logp_values.clone().requires_grad_(True)
    aipo_value, _ = aipo_loss(aipo, mu, advantages, mask, rho=cap)
    aipo_value.backward()

    torch.testing.assert_close(decoupled.grad, aipo.grad, atol=1e-6, rtol=0)
    assert decoupled.grad.abs().sum() > 0  # the comparison is not between two zeros
