import math

import pytest
import torch
from conftest import close, leaf

from relayrl.algorithms.losses import LOSSES, METRIC_KEYS, gipo_loss, ppo_clip_loss


def test_gipo_value_metrics_and_gradient_by_hand():
    # log-ratios [1, 0, -1, padding 2] -> r = [e, 1, 1/e]; advantages [1, 2, -1]
    mu_logp = torch.tensor([[-2.0, -2.0, -2.0, -2.0]])
    logp = leaf([[-1.0, -2.0, -3.0, 0.0]])
    advantages = torch.tensor([[1.0, 2.0, -1.0, 5.0]])
    mask = torch.tensor([[True, True, True, False]])

    loss, metrics = gipo_loss(logp, mu_logp, advantages, mask, sigma=1.0, neg_ratio=0.5)
    loss.backward()

    # token 0: A > 0, s = 1:   w = exp(-0.5 * 1^2) = exp(-0.5),  r*w*A = e * e^-0.5 = 1.64872
    # token 1: r = 1:          w = 1,                            r*w*A = 2
    # token 2: A < 0, s = 0.5: w = exp(-0.5 * (-1/0.5)^2) = e^-2, r*w*A = -e^-1 * e^-2 = -0.04979
    # loss = -(1.64872 + 2 - 0.04979) / 3
    close(loss, -1.19964)
    # d loss / d log pi = -r*w*A / n (d r / d log pi = r; w carries no gradient)
    close(logp.grad, [[-0.54957, -0.66667, 0.01660, 0.0]])
    close(metrics["ratio_mean"], (math.e + 1 + math.exp(-1)) / 3)
    close(metrics["ratio_max"], math.e)
    # only token 2 has w < 0.5 (e^-2 = 0.135); token 0 has w = 0.607
    close(metrics["clip_frac"], 1 / 3)


def test_gipo_weight_is_exp_minus_half_at_ratio_e_with_sigma_1():
    logp = leaf([[0.0]])
    loss, _ = gipo_loss(logp, torch.tensor([[-1.0]]), torch.tensor([[1.0]]), torch.ones(1, 1))
    loss.backward()
    close(loss, -math.e * math.exp(-0.5))
    close(logp.grad, [[-math.e * math.exp(-0.5)]])


def test_gipo_negative_advantages_use_sigma_times_neg_ratio():
    # The same log-ratio 0.5 with A = +1 and A = -1.
    logp = leaf([[0.5, 0.5]])
    mu_logp = torch.zeros(1, 2)
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)

    loss, _ = gipo_loss(logp, mu_logp, advantages, mask, sigma=2.0, neg_ratio=0.25)
    loss.backward()

    ratio = math.exp(0.5)
    w_pos = math.exp(-0.5 * (0.5 / 2.0) ** 2)  # s = sigma = 2
    w_neg = math.exp(-0.5 * (0.5 / 0.5) ** 2)  # s = sigma * neg_ratio = 0.5
    close(loss, -(ratio * w_pos - ratio * w_neg) / 2)
    close(logp.grad, [[-ratio * w_pos / 2, ratio * w_neg / 2]])

    # neg_ratio = 1 is the paper's symmetric form: the two tokens' terms cancel exactly.
    symmetric, _ = gipo_loss(logp, mu_logp, advantages, mask, sigma=2.0, neg_ratio=1.0)
    close(symmetric, 0.0)


def test_gipo_zero_advantage_uses_sigma_for_clip_frac():
    # log-ratio 1: w = e^-0.5 = 0.61 with sigma = 1, but e^-2 = 0.14 with sigma * neg_ratio = 0.5.
    logp = leaf([[1.0]])
    loss, metrics = gipo_loss(logp, torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    loss.backward()
    assert metrics["clip_frac"] == 0.0
    assert loss.item() == 0.0
    assert logp.grad.item() == 0.0


@pytest.mark.parametrize(
    ("ratio", "advantage", "scale"),
    [(10.0, 1.0, 1.0), (100.0, 1.0, 1.0), (0.1, -1.0, 0.5), (0.01, -1.0, 0.5)],
)
def test_gipo_gradient_stays_nonzero_where_ppo_clip_is_exactly_zero(ratio, advantage, scale):
    mu_logp = torch.zeros(1, 1)
    advantages = torch.tensor([[advantage]])
    mask = torch.ones(1, 1)
    gipo_logp = leaf([[math.log(ratio)]])
    ppo_logp = leaf([[math.log(ratio)]])

    gipo, gipo_metrics = gipo_loss(gipo_logp, mu_logp, advantages, mask)
    ppo, ppo_metrics = ppo_clip_loss(ppo_logp, mu_logp, advantages, mask, clip_eps=0.2)
    (gipo + ppo).backward()

    # PPO's clipped branch is a constant beyond 1 +- eps: no gradient at all.
    assert ppo_logp.grad.item() == 0.0
    assert ppo_metrics["clip_frac"] == 1.0
    # GIPO damps instead: -r * w * A with w = exp(-0.5 * (log r / s)^2), tiny but not zero
    # (r = 100: w = 2.48e-5, r * w = 2.48e-3; r = 0.01 with s = 0.5: r * w = 3.8e-21).
    weight = math.exp(-0.5 * (math.log(ratio) / scale) ** 2)
    assert gipo_logp.grad.item() != 0.0
    assert gipo_logp.grad.item() == pytest.approx(-ratio * weight * advantage, rel=1e-4)
    assert gipo_metrics["clip_frac"] == 1.0


def test_gipo_stays_finite_when_the_ratio_overflows():
    # exp(200) is inf in float32; the naive r * A * w would be inf * 0 = nan.
    logp = leaf([[200.0, 0.0]])
    loss, metrics = gipo_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
    loss.backward()
    close(loss, -0.5)  # only the on-policy token counts: -(0 + 1) / 2
    close(logp.grad, [[0.0, -0.5]])
    assert metrics["ratio_max"] == math.inf


def test_gipo_empty_mask_gives_zero_loss_with_a_gradient_path():
    logp = leaf([[0.3, -0.2]])
    loss, metrics = gipo_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0
    close(logp.grad, [[0.0, 0.0]])
    assert metrics == {key: 0.0 for key in METRIC_KEYS} | {"ess": 1.0}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"sigma": 0.0}, "sigma=0.0"), ({"neg_ratio": -1.0}, "neg_ratio=-1.0")],
)
def test_gipo_rejects_non_positive_widths(kwargs, message):
    batch = (torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match=message):
        gipo_loss(*batch, **kwargs)


def test_gipo_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="share one shape"):
        gipo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


def test_gipo_is_registered():
    assert LOSSES["gipo"] is gipo_loss
