import pytest
import torch
from conftest import close, leaf

from relayrl.algorithms.losses import (
    LOSSES,
    METRIC_KEYS,
    aipo_clamp_loss,
    aipo_loss,
    masked_mean,
    ppo_clip_loss,
)


def aipo_batch(mask_dtype: torch.dtype = torch.bool):
    """One sequence of 4 tokens, log-ratios [0.5, 0, -0.5, 2.0]; the last token is padding.

    Ratios: e^0.5 = 1.64872, e^0 = 1, e^-0.5 = 0.60653 (padding e^2 = 7.389 must not show up).
    """
    mu_logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    logp = leaf([[-0.5, -1.0, -1.5, 1.0]])
    advantages = torch.tensor([[1.0, -2.0, 3.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=mask_dtype)
    return logp, mu_logp, advantages, mask


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_aipo_value_metrics_and_gradient_by_hand(mask_dtype):
    logp, mu_logp, advantages, mask = aipo_batch(mask_dtype)

    loss, metrics = aipo_loss(logp, mu_logp, advantages, mask, rho=1.5)
    loss.backward()

    # weights w = [min(1.64872, 1.5) = 1.5, 1, 0.60653], n = 3 valid tokens
    # loss = -(1.5*1*(-0.5) + 1*(-2)*(-1.0) + 0.60653*3*(-1.5)) / 3
    #      = -(-0.75 + 2.0 - 2.72939) / 3 = 0.49313
    close(loss, 0.49313)
    # grad = -w*A/n; the first token is above rho yet keeps -rho*A/n = -1.5*1/3 = -0.5
    # [-1.5*1/3, -1*(-2)/3, -0.60653*3/3, padding 0]
    close(logp.grad, [[-0.5, 0.66667, -0.60653, 0.0]])
    # ratio_mean = (1.64872 + 1 + 0.60653) / 3; only the first token exceeds rho
    close(metrics["ratio_mean"], 1.08508)
    close(metrics["ratio_max"], 1.64872)
    close(metrics["clip_frac"], 1 / 3)


def test_aipo_clamp_value_and_gradient_by_hand():
    logp, mu_logp, advantages, mask = aipo_batch()

    loss, metrics = aipo_clamp_loss(logp, mu_logp, advantages, mask, rho=1.5)
    loss.backward()

    # loss = -(min(1.64872, 1.5)*1 + 1*(-2) + 0.60653*3) / 3 = -(1.5 - 2 + 1.81959) / 3 = -0.43986
    close(loss, -0.43986)
    # grad = -r*A/n below rho and exactly 0 above it (the min picks the constant rho):
    # [0, -1*(-2)/3, -0.60653*3/3, padding 0]
    close(logp.grad, [[0.0, 0.66667, -0.60653, 0.0]])
    assert logp.grad[0, 0].item() == 0.0
    assert metrics["clip_frac"] == pytest.approx(1 / 3)


def test_ppo_clip_value_and_gradient_by_hand():
    # log-ratios [0.5, -0.5, 0.5, 0.1, 0] -> r = [1.64872, 0.60653, 1.64872, 1.10517, padding]
    mu_logp = torch.tensor([[-2.0, -2.0, -2.0, -2.0, -2.0]])
    logp = leaf([[-1.5, -2.5, -1.5, -1.9, -2.0]])
    advantages = torch.tensor([[1.0, -1.0, -1.0, 2.0, 4.0]])
    mask = torch.tensor([[True, True, True, True, False]])

    loss, metrics = ppo_clip_loss(logp, mu_logp, advantages, mask, clip_eps=0.2)
    loss.backward()

    # token 0: r > 1.2, A > 0  -> min(1.64872, 1.2*1)     = 1.2       clipped
    # token 1: r < 0.8, A < 0  -> min(-0.60653, 0.8*(-1)) = -0.8      clipped
    # token 2: r > 1.2, A < 0  -> min(-1.64872, -1.2)     = -1.64872  unclipped
    # token 3: r in [0.8, 1.2] -> 1.10517*2               = 2.21034   unclipped
    # loss = -(1.2 - 0.8 - 1.64872 + 2.21034) / 4 = -0.24041
    close(loss, -0.24041)
    # grad = -r*A/n where unclipped, exactly 0 where clipped:
    # [0, 0, -1.64872*(-1)/4, -1.10517*2/4, padding 0]
    close(logp.grad, [[0.0, 0.0, 0.41218, -0.55259, 0.0]])
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == 0.0
    close(metrics["clip_frac"], 0.5)
    # (1.64872 + 0.60653 + 1.64872 + 1.10517) / 4
    close(metrics["ratio_mean"], 1.25229)
    close(metrics["ratio_max"], 1.64872)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_on_policy_gradient_is_vanilla_policy_gradient(name):
    torch.manual_seed(0)
    logp = (torch.randn(3, 5) - 2.0).requires_grad_()
    advantages = torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.3
    n = mask.sum()

    loss, metrics = LOSSES[name](logp, logp.detach(), advantages, mask)
    loss.backward()

    # At ratio 1 no weight is truncated and no clip is active: grad = -A * mask / n
    close(logp.grad, (-advantages * mask / n).tolist())
    on_policy = {"ratio_mean": 1.0, "ratio_max": 1.0, "clip_frac": 0.0, "ess": 1.0}
    on_policy |= {"log_ratio_max": 0.0, "log_ratio_p99": 0.0, "kl_mu_pi": 0.0}
    on_policy["kept_frac"] = 1.0  # randn advantages: every valid token carries a gradient
    assert {key: metrics[key] for key in METRIC_KEYS} == pytest.approx(on_policy)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_all_zero_mask_gives_zero_loss_that_backpropagates(name):
    logp, mu_logp, advantages, _ = aipo_batch()
    mask = torch.zeros(1, 4, dtype=torch.bool)

    loss, metrics = LOSSES[name](logp, mu_logp, advantages, mask)
    loss.backward()

    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros(1, 4))
    # Every metric is 0 but the ESS, which is 1: an empty batch is not a degenerate one.
    assert {key: metrics[key] for key in METRIC_KEYS} == {key: 0.0 for key in METRIC_KEYS} | {
        "ess": 1.0
    }


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_infinite_log_probs_on_padding_do_not_reach_loss_or_gradient(name):
    logp, mu_logp, advantages, mask = aipo_batch()
    padded_logp = logp.detach().clone()
    padded_logp[0, 3] = float("-inf")
    padded_logp.requires_grad_()
    padded_mu = mu_logp.clone()
    padded_mu[0, 3] = float("-inf")

    loss, _ = LOSSES[name](padded_logp, padded_mu, advantages, mask)
    reference, _ = LOSSES[name](logp, mu_logp, advantages, mask)
    loss.backward()

    close(loss, reference.item())
    assert padded_logp.grad[0, 3].item() == 0.0
    assert torch.isfinite(padded_logp.grad).all()


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_shape_mismatch_is_rejected(name):
    logp, mu_logp, advantages, mask = aipo_batch()
    with pytest.raises(ValueError, match=r"share one shape.*\(1, 4\), \(1, 4\), \(4,\)"):
        LOSSES[name](logp, mu_logp, advantages[0], mask)


@pytest.mark.parametrize("loss_fn", [aipo_loss, aipo_clamp_loss])
@pytest.mark.parametrize("rho", [0.0, -1.0])
def test_non_positive_rho_is_rejected(loss_fn, rho):
    with pytest.raises(ValueError, match=f"rho must be > 0, got rho={rho}"):
        loss_fn(*aipo_batch(), rho=rho)


def test_non_positive_clip_eps_is_rejected():
    with pytest.raises(ValueError, match="clip_eps must be > 0, got clip_eps=0.0"):
        ppo_clip_loss(*aipo_batch(), clip_eps=0.0)


def test_masked_mean_ignores_masked_entries_and_empty_mask():
    x = torch.tensor([1.0, 2.0, 3.0, float("inf")], requires_grad=True)

    # (1 + 3) / 2 = 2; the inf is masked out
    close(masked_mean(x, torch.tensor([1.0, 0.0, 1.0, 0.0])), 2.0)

    empty = masked_mean(x, torch.zeros(4, dtype=torch.bool))
    empty.backward()
    assert empty.item() == 0.0
    assert torch.equal(x.grad, torch.zeros(4))
