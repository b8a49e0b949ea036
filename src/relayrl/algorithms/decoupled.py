"""Decoupled PPO: the trust region around a proximal policy, the staleness corrected apart.

PPO's old policy does two jobs: it is the policy whose samples the update corrects for, and the
centre of the trust region. With stale samples (asynchronous RL) or several optimizer steps per
version, the behaviour policy mu that sampled a token can be far from any policy the trainer
should stay near. The decoupled objective (Hilton, Cobbe & Schulman 2021, "Batch size-invariance
for policy optimization", arXiv:2110.00641; AReaL, Fu et al. 2025, arXiv:2505.24298, Eq. 5)
splits the two: the clip is around the proximal policy prox, the trainer's policy as the step
began, and a stop-gradient weight prox / mu carries the correction for mu::

    loss = -mean_t( sg(w_t) * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t) )
    r_t  = pi_t / prox_t,   w_t = min(prox_t / mu_t, cap)

``decoupled_loss`` builds it from any loss of ``LOSSES``: that loss with prox as its old policy and
each token's advantage times sg(w_t). With ``ppo_clip_loss`` it is the objective above; the
embodied trainer composes the same weight with its own loss.

With one minibatch per version prox is the policy being differentiated, so r_t = 1 and no clip
acts: d loss / d log pi_t = -min(pi_t / mu_t, cap) A_t / n, the gradient of ``aipo_loss`` with
rho = cap. The values differ (aipo's surrogate is w A log pi, this one w r A); the gradients and
so the update are the same. Only with several minibatches per version does the clip around prox
bite, after the first step moved pi.

Where we differ from AReaL: its ``behav_imp_weight_cap`` drops the tokens whose weight exceeds the
cap (their loss term becomes 0); we truncate the weight at the cap, as AIPO and IMPALA do, so such
a token still learns at weight ``cap``. The weight is exp(log prox - log mu) clamped at the cap,
so a weight past the cap is the cap exactly, one whose exp() overflows to inf included (it
carries no gradient, so no inf reaches one).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algorithms.losses import LossFn, masked_mean


def behaviour_weight(prox_logp: Tensor, mu_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """[B, T] min(prox / mu, cap) on valid tokens (``mask``), 0 on padding; no gradient.

    ``prox_logp`` and ``mu_logp`` are the proximal and behaviour policies' log-probs of the same
    tokens, [B, T]; ``cap`` > 0. Padding may hold anything, inf and nan included."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got cap={cap}")
    valid = mask.bool()
    log_weight = torch.where(valid, prox_logp.detach() - mu_logp.detach(), 0.0)
    return torch.where(valid, log_weight.exp().clamp(max=cap), 0.0)


def decoupled_loss(
    loss_fn: LossFn,
    logp: Tensor,
    mu_logp: Tensor,
    prox_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cap: float,
    **options: float,
) -> tuple[Tensor, dict[str, float]]:
    """``loss_fn`` around the proximal policy with the behaviour weight on each advantage:
    ``loss_fn(logp, prox_logp, sg(min(prox / mu, cap)) * advantages, mask, **options)``.

    Args:
        loss_fn: a loss of ``LOSSES`` (``ppo_clip_loss`` gives the decoupled PPO objective).
        logp, mu_logp, advantages, mask: [B, T], as for every loss (see ``losses``).
        prox_logp: [B, T] log-probs of the proximal policy (the trainer's as the step began).
        cap: the most the behaviour weight prox / mu may be, > 0.
        options: ``loss_fn``'s keyword arguments.

    Returns:
        The loss and ``loss_fn``'s metrics, which measure pi against prox (its ``clip_frac`` is
        the clip around prox), plus ``behaviour_weight``: the token mean of the weight.
    """
    weight = behaviour_weight(prox_logp, mu_logp, mask, cap)
    loss, metrics = loss_fn(logp, prox_logp.detach(), advantages * weight, mask, **options)
    return loss, metrics | {"behaviour_weight": float(masked_mean(weight, mask))}
