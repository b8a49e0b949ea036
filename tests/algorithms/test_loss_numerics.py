"""Every loss in LOSSES: non-finite padding never reaches loss or gradient; the dtype follows the
inputs."""

import pytest
import torch

from relayrl.algorithms.losses import LOSSES

NAN, INF = float("nan"), float("inf")


def valid_tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three valid tokens: log-ratios [0.5, 0, -0.5], advantages of both signs."""
    logp = torch.tensor([[-0.5, -1.0, -1.5]])
    mu_logp = torch.tensor([[-1.0, -1.0, -1.0]])
    advantages = torch.tensor([[1.0, -2.0, 3.0]])
    return logp, mu_logp, advantages


def loss_and_grad(name: str, logp, mu_logp, advantages, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and d loss / d logp."""
    logp = logp.clone().requires_grad_()
    loss, _ = LOSSES[name](logp, mu_logp, advantages, mask)
    loss.backward()
    return loss.detach(), logp.grad


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize(
    ("pad_logp", "pad_mu", "pad_adv"),
    [
        (-1.0, -1.0, NAN),
        (-1.0, -1.0, INF),
        (-1.0, -1.0, -INF),
        (-1.0, NAN, 1.0),
        (-1.0, INF, 1.0),
        (-1.0, -INF, 1.0),
        (-1.0, NAN, NAN),
        (NAN, NAN, NAN),
        (-INF, -1.0, INF),
    ],
)
def test_non_finite_padding_gives_the_loss_and_gradient_of_the_unpadded_batch(
    name, pad_logp, pad_mu, pad_adv
):
    logp, mu_logp, advantages = valid_tokens()
    unpadded = loss_and_grad(name, logp, mu_logp, advantages, torch.ones(1, 3, dtype=torch.bool))

    def pad(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.cat([x, torch.tensor([[value]])], dim=1)

    mask = torch.tensor([[True, True, True, False]])
    loss, grad = loss_and_grad(
        name, pad(logp, pad_logp), pad(mu_logp, pad_mu), pad(advantages, pad_adv), mask
    )

    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, unpadded[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(grad[:, :3], unpadded[1], atol=1e-6, rtol=0)
    assert grad[0, 3].item() == 0.0


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 2e-2), (torch.float64, 1e-6)])
def test_loss_and_gradient_keep_the_input_dtype_and_match_float32(name, dtype, atol):
    torch.manual_seed(0)
    # log-ratios within +-1.5, so every loss's truncation, clip or damping is active somewhere
    logp = torch.randn(4, 6) - 2.0
    mu_logp = logp + torch.empty(4, 6).uniform_(-1.5, 1.5)
    advantages = torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.25
    inputs = [logp.to(dtype), mu_logp.to(dtype), advantages.to(dtype)]

    loss, grad = loss_and_grad(name, *inputs, mask)
    reference, reference_grad = loss_and_grad(name, logp, mu_logp, advantages, mask)

    assert loss.dtype == dtype and grad.dtype == dtype
    torch.testing.assert_close(loss.float(), reference, atol=atol, rtol=0)
    torch.testing.assert_close(grad.float(), reference_grad, atol=atol, rtol=0)
