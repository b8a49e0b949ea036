"""Per-token estimators of KL(pi || ref) from samples of pi (Schulman 2020, "Approximating KL
Divergence", joschu.net/blog/kl-approx.html), for the reference-policy KL term.

With log r = log ref(x) - log pi(x) at a token x sampled from pi:

- ``k1`` = -log r: unbiased, high variance, negative on some tokens;
- ``k2`` = (log r)^2 / 2: biased (exact to second order), always >= 0; its gradient in log pi is
  -log r, so in the loss it pulls pi towards ref like the true KL's gradient;
- ``k3`` = (r - 1) - log r: unbiased and always >= 0 (GRPO's choice in the loss).

Each takes log pi and log ref of the same tokens ([B, T], any shape) and returns the per-token
estimate with the same shape; gradients flow through ``logp`` (the reference is frozen).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log pi - log ref."""
    return logp - ref_logp


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """(log ref - log pi)^2 / 2."""
    return 0.5 * (ref_logp - logp).square()


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """exp(log ref - log pi) - 1 - (log ref - log pi); the log-ratio is clamped to [-20, 20] so
    one token far off the reference cannot overflow the exponential."""
    log_r = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.expm1(log_r) - log_r


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": k1, "k2": k2, "k3": k3}


def sequence_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """[B] sum over each row's valid tokens (``mask``) of the per-token estimate: the KL of a
    whole completion, the penalty a KL-in-reward run subtracts (times ``kl_coef``)."""
    per_token = KL_ESTIMATORS[estimator](logp, ref_logp)
    return torch.where(mask.bool(), per_token, 0.0).sum(dim=-1)
