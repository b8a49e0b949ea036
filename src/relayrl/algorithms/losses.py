"""Policy-gradient losses for token sequences sampled by a possibly stale behaviour policy.

Every loss shares one signature, so the trainer picks one from ``LOSSES`` by name::

    loss, metrics = loss_fn(logp, mu_logp, advantages, mask, **scalar_kwargs)

Shapes and meaning (B sequences of T tokens):

- ``logp``        [B, T] log pi(token) under the current policy; carries the gradient.
- ``mu_logp``     [B, T] log mu(token) recorded by the behaviour policy at sampling; a constant.
- ``advantages``  [B, T] per-token advantage; a constant.
- ``mask``        [B, T] bool or 0/1 float; true on tokens that count (response, not padding).

Aggregation is a token-mean over every valid token in the batch: sum over masked tokens divided by
the number of masked tokens (DAPO's token-level mean). DeepSeekMath's GRPO instead averages within
each sequence first, and Dr. GRPO divides by a constant; we use the token-mean so that long and
short responses weigh each token equally. An all-zero mask gives a zero loss still connected to
``logp``, so backward() works on a batch with nothing to learn from. Padding may hold anything,
nan and inf included, in any input: it reaches neither the loss nor the gradient.

The loss has the dtype of the tensor inputs (bf16 in, bf16 out; mixed dtypes promote as torch
does); the python-scalar keyword arguments never promote it to float32.

``metrics`` holds python floats with unprefixed keys (the trainer adds ``loss/``):
``ratio_mean`` and ``ratio_max`` of r = pi/mu over valid tokens, and ``clip_frac``, the fraction of
valid tokens where the truncation or clip is active. All are 0.0 when the mask is empty.
"""

from collections.abc import Callable

import torch
from torch import Tensor

LossFn = Callable[..., tuple[Tensor, dict[str, float]]]


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` is true; 0 when the mask is empty.

    ``x`` and ``mask`` have the same shape; ``mask`` is bool or 0/1 float. Masked-out entries are
    selected away rather than multiplied by zero, so inf or nan in padding cannot leak in.
    """
    mask = mask.bool()
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def aipo_loss(
    logp: Tensor, mu_logp: Tensor, advantages: Tensor, mask: Tensor, *, rho: float = 4.0
) -> tuple[Tensor, dict[str, float]]:
    """AIPO: policy gradient with a truncated, stop-gradient importance weight.

    loss = -mean_t( sg(min(r_t, rho)) * A_t * log pi_t ),   r_t = exp(log pi_t - log mu_t)

    From LlamaRL (Meta, arXiv:2505.24034), which uses rho in [2, 10]; the weight is IMPALA's
    truncated importance sampling (Espeholt et al., arXiv:1802.01561). Because the weight carries no
    gradient, d loss / d log pi_t = -min(r_t, rho) * A_t / n on every valid token, including tokens
    with r_t > rho: their weight is capped at rho but they still learn. Compare ``aipo_clamp_loss``,
    which drops those tokens. On-policy (mu = pi) this is the vanilla policy gradient.

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        rho: truncation level of the importance weight, > 0.

    Returns:
        The scalar loss (token-mean over valid tokens) and metrics; ``clip_frac`` counts r > rho.
    """
    if rho <= 0:
        raise ValueError(f"rho must be > 0, got rho={rho}")
    mask, ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    weight = ratio.clamp(max=rho).detach()
    loss = -masked_mean(weight * advantages * logp, mask)
    return loss, _metrics(ratio, ratio > rho, mask)


def aipo_clamp_loss(
    logp: Tensor, mu_logp: Tensor, advantages: Tensor, mask: Tensor, *, rho: float = 4.0
) -> tuple[Tensor, dict[str, float]]:
    """Clamped-ratio AIPO: the importance ratio itself is the surrogate and carries the gradient.

    loss = -mean_t( min(r_t, rho) * A_t ),   r_t = exp(log pi_t - log mu_t)

    Where ``aipo_loss`` follows the score-function gradient w * A * grad log pi with a bounded,
    stop-gradient weight on every token, this variant differentiates the ratio: the gradient is
    r_t * A_t * grad log pi_t below rho and exactly zero above it, where the min selects the
    constant rho. Tokens above rho are dropped from the update entirely, like a one-sided PPO clip
    that ignores the sign of the advantage.

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        rho: clamp level of the ratio, > 0.

    Returns:
        The scalar loss (token-mean over valid tokens) and metrics; ``clip_frac`` counts r > rho.
    """
    if rho <= 0:
        raise ValueError(f"rho must be > 0, got rho={rho}")
    mask, ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    loss = -masked_mean(ratio.clamp(max=rho) * advantages, mask)
    return loss, _metrics(ratio, ratio > rho, mask)


def ppo_clip_loss(
    logp: Tensor, mu_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_eps: float = 0.2
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate, with the behaviour policy mu as the old policy.

    loss = -mean_t( min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps) * A_t) ),   r_t = pi_t / mu_t

    From Schulman et al. 2017 (arXiv:1707.06347). The gradient is zero where the clip is active
    (r > 1 + eps with A > 0, or r < 1 - eps with A < 0) and r_t * A_t * grad log pi_t elsewhere.
    We differ from PPO in using the sampler's log-probs as the old policy instead of recomputing
    them with the trainer, so the clip also absorbs sampler/trainer numerical mismatch.

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        clip_eps: half-width of the trust region around ratio 1, > 0.

    Returns:
        The scalar loss (token-mean over valid tokens) and metrics; ``clip_frac`` counts tokens
        where the clipped term is selected and zeroes the gradient.
    """
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0, got clip_eps={clip_eps}")
    mask, ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    loss = -masked_mean(torch.minimum(unclipped, clipped), mask)
    return loss, _metrics(ratio, clipped < unclipped, mask)


def gipo_loss(
    logp: Tensor,
    mu_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    sigma: float = 1.0,
    neg_ratio: float = 0.5,
) -> tuple[Tensor, dict[str, float]]:
    """GIPO: the importance-weighted surrogate damped by a Gaussian trust weight on the log-ratio.

    loss = -mean_t( r_t * A_t * w_t ),   r_t = pi_t / mu_t
    w_t  = exp(-0.5 * (log sg(r_t) / s_t)^2),   s_t = sigma if A_t >= 0 else sigma * neg_ratio

    From GIPO (Lu et al., arXiv:2603.03955), the policy loss of AcceRL (arXiv:2603.18464). The
    weight is a stop-gradient, so d loss / d log pi_t = -r_t * w_t * A_t / n: PPO's hard clip is
    replaced by a smooth damping that shrinks the gradient of far off-policy tokens but never zeroes
    it (``ppo_clip_loss`` gives exactly 0 beyond 1 +- eps). The paper uses one sigma for both signs;
    the authors' released training scripts add a separate scale for negative advantages, with
    defaults sigma = 1.0 and neg_ratio = 0.5, which we adopt: a narrower weight for A < 0 because
    pushing down a token whose ratio has already moved far is what destabilises training (the case
    dual-clip PPO bounds). neg_ratio = 1.0 recovers the paper's symmetric form. A == 0 uses sigma;
    the choice only affects ``clip_frac``, as the token's loss and gradient are zero either way.

    We compute r_t * w_t as exp(log r_t - 0.5 * (log sg(r_t) / s_t)^2): the same value and gradient,
    but bounded by exp(s_t^2 / 2), so a log-ratio too large for exp() in float32 gives a zero term
    instead of inf * 0 = nan.

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        sigma: width of the Gaussian on log r for non-negative advantages, > 0.
        neg_ratio: width for negative advantages relative to sigma, > 0.

    Returns:
        The scalar loss (token-mean over valid tokens) and metrics; GIPO never clips, so
        ``clip_frac`` counts tokens damped to w < 0.5, i.e. |log r| > s * sqrt(2 ln 2) ~ 1.18 s.
    """
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got sigma={sigma}")
    if neg_ratio <= 0:
        raise ValueError(f"neg_ratio must be > 0, got neg_ratio={neg_ratio}")
    mask, ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    log_ratio = torch.where(mask, logp - mu_logp.detach(), 0.0)
    # Scalars alone would give a float32 scale, promoting a bf16 loss to float32.
    scale = torch.where(advantages >= 0, sigma, sigma * neg_ratio).to(log_ratio.dtype)
    log_weight = -0.5 * (log_ratio.detach() / scale) ** 2
    loss = -masked_mean((log_ratio + log_weight).exp() * advantages, mask)
    return loss, _metrics(ratio, log_weight.exp() < 0.5, mask)


LOSSES: dict[str, LossFn] = {
    "aipo": aipo_loss,
    "aipo_clamp": aipo_clamp_loss,
    "ppo_clip": ppo_clip_loss,
    "gipo": gipo_loss,
}

# Each loss's keyword arguments, and the ``trainer`` config field that sets each one.
LOSS_OPTIONS: dict[str, dict[str, str]] = {
    "aipo": {"rho": "aipo_rho"},
    "aipo_clamp": {"rho": "aipo_rho"},
    "ppo_clip": {"clip_eps": "ppo_clip_eps"},
    "gipo": {"sigma": "gipo_sigma", "neg_ratio": "gipo_neg_ratio"},
}


def _prepare(
    logp: Tensor, mu_logp: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Check shapes; return the bool mask, ratio pi/mu (1 on padding) and constant advantages
    (0 on padding)."""
    shapes = {t.shape for t in (logp, mu_logp, advantages, mask)}
    if len(shapes) != 1:
        raise ValueError(
            "logp, mu_logp, advantages and mask must share one shape [B, T], got "
            f"{tuple(logp.shape)}, {tuple(mu_logp.shape)}, {tuple(advantages.shape)}, "
            f"{tuple(mask.shape)}"
        )
    mask = mask.bool()
    # Padding may hold arbitrary log-probs; zeroing the log-ratio there keeps exp() finite, so no
    # inf * 0 = nan can reach the gradient.
    log_ratio = torch.where(mask, logp - mu_logp.detach(), 0.0)
    # Likewise for advantages: aipo multiplies logp by the advantage outside any select, so a nan
    # advantage on padding would give d loss / d logp = nan * 0 = nan there.
    advantages = torch.where(mask, advantages.detach(), 0.0)
    return mask, log_ratio.exp(), advantages


def _metrics(ratio: Tensor, clip_active: Tensor, mask: Tensor) -> dict[str, float]:
    ratio = ratio.detach()
    # Ratios are positive, so filling padding with 0 leaves the max over valid tokens unchanged.
    ratio_max = torch.where(mask, ratio, 0.0).max()
    stats = torch.stack(
        [masked_mean(ratio, mask), ratio_max, masked_mean(clip_active.to(ratio.dtype), mask)]
    ).tolist()
    return dict(zip(("ratio_mean", "ratio_max", "clip_frac"), stats, strict=True))
