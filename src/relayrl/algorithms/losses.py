"""Policy-gradient losses for token sequences sampled by a possibly stale behaviour policy.

Every loss shares one signature, so the trainer picks one from ``LOSSES`` by name::

    loss, metrics = loss_fn(logp, mu_logp, advantages, mask, **scalar_kwargs)

Shapes and meaning (B sequences of T tokens):

- ``logp``        [B, T] log pi(token) under the current policy; carries the gradient.
- ``mu_logp``     [B, T] log mu(token) recorded by the behaviour policy at sampling; a constant.
- ``advantages``  [B, T] per-token advantage; a constant.
- ``mask``        [B, T] bool or 0/1 float; true on tokens that count (response, not padding).

A row is one sequence: the sequence-level losses (``tis_seq``, ``mis_seq``) and the ESS of
``ess_aipo`` take the product of a row's valid-token ratios.

Aggregation is a token-mean over every valid token in the batch: sum over masked tokens divided by
the number of masked tokens (DAPO's token-level mean). DeepSeekMath's GRPO instead averages within
each sequence first, and Dr. GRPO divides by a constant; we use the token-mean so that long and
short responses weigh each token equally. Tokens a loss truncates, masks or clips still count in
the denominator, so the denominator never depends on the policy, except in the two losses that
replicate frameworks which drop rejected tokens from it (``mis_seq_verl``, ``geo_mask``; they
divide by the batch's kept tokens instead). An all-zero mask gives a zero loss
still connected to ``logp``, so backward() works on a batch with nothing to learn from. Padding may
hold anything, nan and inf included, in any input: it reaches neither the loss nor the gradient.

The loss has the dtype of the tensor inputs (bf16 in, bf16 out; mixed dtypes promote as torch
does); the python-scalar keyword arguments never promote it to float32.

Batch statistics and ranks: a trainer that shards a batch over N ranks takes each rank's token-mean
times its share of the tokens, which sums to the whole batch's token-mean. That holds for every
loss whose per-token terms depend only on their own sequence. Four losses also depend on a
statistic of the whole batch, and take it as an optional keyword (None: computed from the tensors
given, which is right for one rank); ``BATCH_STATISTICS`` lists them for the trainer:

- ``m2po``: ``cutoff=m2po_cutoff(torch.cat(ranks' m2po_sq_log_ratios(...)), tau)``
- ``ess_aipo``: ``ess=normalized_ess(torch.cat(ranks' sequence_log_weights(...)))``
- ``mis_seq_verl``: ``kept_share=kept_token_share(torch.cat(ranks'
  token_sequence_log_weights(...)), lower, upper)``
- ``geo_mask``: ``kept_share=kept_token_share(torch.cat(ranks'
  token_sequence_mean_log_ratios(...)), lower, upper)``

``m2po_release`` is the exception by design: like its authors' code it takes its statistic per
call (per micro-batch), so ranks that split a batch do not take the whole batch's step.

Sequences must not be split across ranks (the trainer shards by whole groups).

``metrics`` holds python floats with unprefixed keys (the trainer adds ``loss/``), over the valid
tokens, with r = pi/mu:

- ``ratio_mean``: mean of r.
- ``ratio_max``: max of r.
- ``clip_frac``: fraction of valid tokens where the loss's truncation, mask or clip is active
  (defined in each loss's docstring).
- ``ess``: normalised effective sample size of the raw token ratios, (sum r)^2 / (n sum r^2), in
  (0, 1]: 1 when every r is equal, about 1/n when one token dominates (Kong 1992; Kish).
- ``log_ratio_max``: max |log r|.
- ``log_ratio_p99``: 99th percentile of |log r|, linear interpolation between order statistics
  (numpy's and torch.quantile's default).
- ``kl_mu_pi``: mean of k3 = (r - 1) - log r, the unbiased non-negative estimator of KL(mu || pi)
  from tokens sampled by mu: E_mu[r] = 1, so E_mu[k3] = E_mu[-log r] = E_mu[log mu - log pi]
  (Schulman, "Approximating KL divergence", 2020).
- ``kept_frac``: fraction of valid tokens whose term carries a gradient: a nonzero advantage, not
  masked, clipped or clamped to a constant by the loss (in exact arithmetic; a weight that
  underflows to 0 still counts). It is 0.0 exactly when the gradient is zero: every token masked,
  clipped or without signal. A trainer that sees 0.0 on every rank has nothing to learn from and
  should not step the optimizer, since Adam's momentum alone would still move the weights.

On an empty mask all are 0.0 but ``ess``, which is 1.0: nothing is degenerate, and 1.0 is the
neutral ESS scale of ``ess_aipo``. Across ranks ``ratio_mean``, ``clip_frac``, ``kl_mu_pi`` and
``kept_frac`` are token means, ``ratio_max`` and ``log_ratio_max`` maxima; ``ess`` and
``log_ratio_p99`` are neither and combine only approximately. The metrics cost one host sync
(the batch statistics of ``m2po`` and ``ess_aipo``, when computed in the loss, one more each).
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor

LossFn = Callable[..., tuple[Tensor, dict[str, float]]]

# The health metrics every loss returns, in order (some losses add their own).
METRIC_KEYS = (
    "ratio_mean",
    "ratio_max",
    "clip_frac",
    "ess",
    "log_ratio_max",
    "log_ratio_p99",
    "kl_mu_pi",
    "kept_frac",
)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` is true; 0 when the mask is empty.

    ``x`` and ``mask`` have the same shape; ``mask`` is bool or 0/1 float. Masked-out entries are
    selected away rather than multiplied by zero, so inf or nan in padding cannot leak in.
    """
    mask = mask.bool()
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def pg_loss(
    logp: Tensor, mu_logp: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """Plain policy gradient that ignores the behaviour policy: no off-policy correction at all.

    loss = -mean_t( A_t * log pi_t )

    REINFORCE (Williams 1992) applied to stale samples as if they were on-policy: the gradient is
    -A_t / n on every valid token whatever mu was. It is the uncorrected baseline the other losses
    are measured against; on-policy every loss here has its gradient.

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring; ``mu_logp`` only feeds
            the metrics.

    Returns:
        The scalar loss (token-mean over valid tokens) and metrics; ``clip_frac`` is always 0.
    """
    mask, log_ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    loss = -masked_mean(advantages * logp, mask)
    return loss, _metrics(log_ratio, torch.zeros_like(mask), mask, advantages)


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
    mask, log_ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=rho).detach()
    loss = -masked_mean(weight * advantages * logp, mask)
    return loss, _metrics(log_ratio, ratio > rho, mask, advantages)


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
    mask, log_ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    ratio = log_ratio.exp()
    loss = -masked_mean(ratio.clamp(max=rho) * advantages, mask)
    return loss, _metrics(log_ratio, ratio > rho, mask, advantages, dropped=ratio > rho)


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
    mask, log_ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    terms, clipped = _ppo_clip_terms(log_ratio, advantages, clip_eps)
    loss = -masked_mean(terms, mask)
    return loss, _metrics(log_ratio, clipped, mask, advantages, dropped=clipped)


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
    mask, log_ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    # Scalars alone would give a float32 scale, promoting a bf16 loss to float32.
    scale = torch.where(advantages >= 0, sigma, sigma * neg_ratio).to(log_ratio.dtype)
    log_weight = -0.5 * (log_ratio.detach() / scale) ** 2
    loss = -masked_mean((log_ratio + log_weight).exp() * advantages, mask)
    return loss, _metrics(log_ratio, log_weight.exp() < 0.5, mask, advantages)


def tis_seq_loss(
    logp: Tensor, mu_logp: Tensor, advantages: Tensor, mask: Tensor, *, cap: float = 2.0
) -> tuple[Tensor, dict[str, float]]:
    """Sequence-level truncated importance sampling: one stop-gradient weight per sequence.

    loss = -mean_t( sg(min(W_i, C)) * A_t * log pi_t ),   W_i = prod_{t in i} pi_t / mu_t

    where i is the sequence (row) of token t and the product runs over its valid tokens. This is
    off-policy REINFORCE with the trajectory importance weight truncated at C, verl's
    ``rollout_is="sequence"`` in truncate mode with its pure-IS policy-gradient loss (Liu, Li et
    al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
    Mismatch"; verl docs/algo/rollout_corr_math.md), and the sequence TIS baseline of VCPO
    (arXiv:2602.17616). It is AIPO with the weight taken per sequence: d loss / d log pi_t =
    -min(W_i, C) * A_t / n on every valid token. Unlike a token weight, W_i corrects for the whole
    trajectory having been sampled by mu, at the price of a variance that grows with length.

    W_i is formed in log space, min(W_i, C) = exp(min(sum_t log r_t, log C)), so a long or far
    off-policy sequence cannot overflow exp() (verl bounds the log-weight at +-20 instead).

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        cap: truncation level C of the sequence weight, > 0 (verl's default 2.0; it suggests 2-10).

    Returns:
        The scalar loss (token-mean over valid tokens) and metrics; ``clip_frac`` is the fraction
        of valid tokens whose sequence has W_i > C.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got cap={cap}")
    mask, log_ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    seq_log_weight = _sequence_log_weight(log_ratio, mask)
    weight = _truncated_weight(seq_log_weight, cap).to(log_ratio.dtype)
    loss = -masked_mean(weight[:, None] * advantages * logp, mask)
    truncated = (seq_log_weight > math.log(cap))[:, None].expand_as(mask)
    return loss, _metrics(log_ratio, truncated, mask, advantages)


def tis_seq_weights(logp: Tensor, mu_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """[B] min(W_i, cap), the weight ``tis_seq_loss`` gives each sequence (row), W_i = prod of its
    valid tokens' pi / mu (1 for a row with none); no gradient, at least float32. The weight
    w_i of ``vcpo_baseline_advantages`` under VCPO's recipe."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got cap={cap}")
    _check_shapes(logp=logp, mu_logp=mu_logp, mask=mask)
    mask = mask.bool()
    return _truncated_weight(_sequence_log_weight(_log_ratio(logp, mu_logp, mask), mask), cap)


def mis_seq_loss(
    logp: Tensor,
    mu_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    lower: float = 0.5,
    upper: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Sequence-level masked importance sampling: drop whole sequences whose weight is an outlier.

    loss = -mean_t( sg(W_i * 1[lower <= W_i <= upper]) * A_t * log pi_t ),
    W_i  = prod_{t in i} pi_t / mu_t

    A sequence whose weight falls outside [lower, upper] is masked out entirely (zero loss and
    gradient on all its tokens); the others keep their importance weight W_i, bounded by ``upper``.
    This is masked IS (MIS) at sequence level as verl's ``rollout_is="sequence"`` in mask mode
    defines it (rejected sequences are masked, accepted ones keep the IS ratio) and as slime's
    "masking + importance sampling" and Liu, Li et al. 2025 ("When Speed Kills Stability",
    rho * 1[rho <= C]) use it: the weight, not 1, since weight 1 would drop the correction exactly
    on the sequences trusted enough to keep. Where truncation (``tis_seq_loss``) still learns from
    an outlier with weight C, MIS refuses to learn from it at all.

    Where we differ: verl also removes rejected tokens from the token-mean's denominator
    (``mis_seq_verl_loss`` does too); we keep them, like most losses here, so the denominator
    does not depend on the policy, a batch with many rejections makes a smaller step rather than
    a larger one, and ranks need no shared count.
    The bounds are compared in log space (log lower <= sum_t log r_t <= log upper, in float32, the
    precision ``kept_token_share`` compares gathered weights in), so no weight overflows; both
    ends are inclusive. ``lower <= 1 <= upper`` keeps every on-policy sequence.

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        lower: smallest accepted sequence weight, in (0, 1] (verl's default is 1 / upper).
        upper: largest accepted sequence weight, >= 1 (verl's default 2.0).

    Returns:
        The scalar loss (token-mean over valid tokens) and metrics; ``clip_frac`` is the fraction
        of valid tokens in masked-out sequences.
    """
    if not 0 < lower <= 1 <= upper:
        raise ValueError(f"need 0 < lower <= 1 <= upper, got lower={lower}, upper={upper}")
    mask, log_ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    seq_log_weight = _sequence_log_weight(log_ratio, mask)
    kept = _within(seq_log_weight, lower, upper)
    # exp(-inf) = 0 on rejected sequences, whose weight may be too large for exp().
    weight = torch.where(kept, seq_log_weight, -math.inf).exp().to(log_ratio.dtype)
    loss = -masked_mean(weight[:, None] * advantages * logp, mask)
    rejected = ~kept[:, None].expand_as(mask)
    return loss, _metrics(log_ratio, rejected, mask, advantages, dropped=rejected)


def mis_seq_verl_loss(
    logp: Tensor,
    mu_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    lower: float = 0.5,
    upper: float = 2.0,
    kept_share: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``mis_seq`` as verl aggregates it: rejected sequences leave the token-mean's denominator.

    loss = -sum_{t in kept i} sg(W_i) * A_t * log pi_t / (valid tokens of the kept sequences)
         = mis_seq_loss / kept_share,   kept_share = kept valid tokens / valid tokens

    verl's rejection sampling (``compute_rollout_rejection_mask``, rollout_rs="sequence")
    multiplies the response mask by the acceptance mask, and the loss's token-mean then runs over
    the modified mask: a batch that rejects half its tokens makes each kept token count twice as
    much as ``mis_seq`` does. The update is ``mis_seq``'s otherwise (kept sequences weighted by
    W_i, rejected ones zero), so d loss / d log pi_t = -W_i * A_t / n_kept on kept sequences.
    Where every sequence is rejected the loss is 0.0 with a zero gradient, not 0 / 0.

    kept_share is a statistic of the whole batch: ranks that each hold part of it pass
    ``kept_token_share`` of every rank's ``token_sequence_log_weights`` (``BATCH_STATISTICS``),
    so each rank's loss, weighted by its token share as for every loss, sums to the batch's.

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        lower: smallest accepted sequence weight, in (0, 1].
        upper: largest accepted sequence weight, >= 1.
        kept_share: the batch's share of valid tokens in accepted sequences, in [0, 1]; None
            computes it from this batch.

    Returns:
        The scalar loss and ``mis_seq``'s metrics plus ``kept_share``, the share it divided by.
    """
    loss, metrics = mis_seq_loss(logp, mu_logp, advantages, mask, lower=lower, upper=upper)
    if kept_share is None:
        kept_share = kept_token_share(token_sequence_log_weights(logp, mu_logp, mask), lower, upper)
    return _over_kept(loss, kept_share), metrics | {"kept_share": kept_share}


def geo_mask_loss(
    logp: Tensor,
    mu_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    lower: float = 0.99,
    upper: float = 1.01,
    clip_eps: float = 0.2,
    kept_share: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clip on the sequences whose geometric-mean ratio is near 1; the others masked whole.

    loss = -sum_{t in kept i} min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t) / (kept valid tokens)
    kept i: lower <= G_i <= upper,   G_i = exp(mean_{t in i} log r_t), the geometric mean of r

    SkyRL's geometric sequence mask (``compute_sequence_mask``, sequence_mask_metric="geometric"),
    which its off-policy-correction guide recommends for train/inference mismatch with
    geo_mask_low = 0.99 and geo_mask_high = 1.01, on top of its default PPO loss; like verl's
    rollout_rs="geometric". Unlike the product W_i of ``mis_seq``, G_i does not grow with the
    length, so one bound suits short and long answers. The masked sequences leave the loss mask,
    so SkyRL's token-mean runs over the kept tokens (``kept_share`` as in
    ``mis_seq_verl_loss``, gathered over ranks the same way from
    ``token_sequence_mean_log_ratios``). On kept sequences d loss / d log pi_t = -r_t A_t / n_kept
    where the clip is inactive, 0 where it is active or the sequence is masked.

    Where we differ: SkyRL measures G between the trainer's recomputed old policy and the
    sampler, and clips pi against that old policy; with no recomputed old policy here, both
    use mu, so the mask also rejects staleness, not only mismatch. Masked sequences' log-ratios
    are zeroed before exp(), so a ratio too large for exp() cannot make a nan gradient.

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        lower: smallest accepted geometric-mean ratio, in (0, 1] (SkyRL's 0.99).
        upper: largest accepted geometric-mean ratio, >= 1 (SkyRL's 1.01).
        clip_eps: PPO's clip half-width, > 0.
        kept_share: the batch's share of valid tokens in accepted sequences, in [0, 1]; None
            computes it from this batch.

    Returns:
        The scalar loss and metrics plus ``kept_share``; ``clip_frac`` is the fraction of valid
        tokens masked or clipped.
    """
    if not 0 < lower <= 1 <= upper:
        raise ValueError(f"need 0 < lower <= 1 <= upper, got lower={lower}, upper={upper}")
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0, got clip_eps={clip_eps}")
    mask, log_ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    kept = mask & _within(_sequence_mean_log_ratio(log_ratio, mask), lower, upper)[:, None]
    terms, clipped = _ppo_clip_terms(torch.where(kept, log_ratio, 0.0), advantages, clip_eps)
    loss = -masked_mean(torch.where(kept, terms, 0.0), mask)
    if kept_share is None:
        kept_share = kept_token_share(
            token_sequence_mean_log_ratios(logp, mu_logp, mask), lower, upper
        )
    dropped = ~kept | clipped
    metrics = _metrics(log_ratio, dropped, mask, advantages, dropped=dropped)
    return _over_kept(loss, kept_share), metrics | {"kept_share": kept_share}


def token_sequence_log_weights(logp: Tensor, mu_logp: Tensor, mask: Tensor) -> Tensor:
    """log W_i of each valid token's sequence, W_i = prod_{t in i} pi_t / mu_t: [B, T] in, [n]
    out (row-major over the valid tokens). What a rank contributes to ``kept_token_share`` of
    ``mis_seq_verl``."""
    _check_shapes(logp=logp, mu_logp=mu_logp, mask=mask)
    mask = mask.bool()
    seq = _sequence_log_weight(_log_ratio(logp, mu_logp, mask), mask)
    return seq[:, None].expand_as(mask)[mask]


def token_sequence_mean_log_ratios(logp: Tensor, mu_logp: Tensor, mask: Tensor) -> Tensor:
    """log G_i of each valid token's sequence, G_i the geometric mean of its ratios pi / mu:
    [B, T] in, [n] out. What a rank contributes to ``kept_token_share`` of ``geo_mask``."""
    _check_shapes(logp=logp, mu_logp=mu_logp, mask=mask)
    mask = mask.bool()
    seq = _sequence_mean_log_ratio(_log_ratio(logp, mu_logp, mask), mask)
    return seq[:, None].expand_as(mask)[mask]


def kept_token_share(log_values: Tensor, lower: float, upper: float) -> float:
    """The share of tokens whose sequence is accepted: the fraction of ``log_values`` (one per
    valid token, e.g. every rank's ``token_sequence_log_weights``, any order) within
    [log lower, log upper], compared in float32 as the losses compare them; 1.0 when empty."""
    log_values = log_values.detach().flatten()
    if log_values.numel() == 0:
        return 1.0
    return float(_within(log_values, lower, upper).double().mean())


def m2po_loss(
    logp: Tensor,
    mu_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    tau: float = 0.04,
    cutoff: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """M2PO: the unclipped importance-weighted surrogate, without the second-moment outliers.

    loss = -mean_t( M_t * r_t * A_t ),   r_t = pi_t / mu_t,   M_t = 1[(log r_t)^2 < cutoff]
    cutoff = m2po_cutoff({(log r_t)^2 : t valid}, tau)

    From M2PO (Zheng, Zhao & Chen 2025, "Prosperity before Collapse: How Far Can Off-Policy RL
    Reach with Stale Data on LLMs?", arXiv:2510.01161), as its arXiv version, its blog and AReaL's
    port (docs/algorithms/m2po.md) state it: the batch's second moment M2 = mean over valid tokens
    of (log r)^2 bounds the trust region; tokens are masked from the largest (log r)^2 down until
    the M2 of the remaining valid tokens is <= tau (the paper uses tau = 0.04 everywhere and calls
    it insensitive); the kept tokens train on r * A with the gradient through r and no clip, so
    d loss / d log pi_t = -r_t * A_t / n on kept tokens and 0 on masked ones. The mean runs over
    all valid tokens, masked ones included (the objective's 1 / sum_i |o_i|), so n is the valid
    token count and the masked fraction is reported as ``clip_frac``.

    Where we differ: ties in (log r)^2 at the cut are masked together (see ``m2po_cutoff``), so the
    mask is a threshold that ranks can reproduce from gathered values; when even the smallest
    value exceeds tau every token is masked (AReaL keeps the smallest one). The authors' released
    code and the ICLR version (as Trinity-RFT reads it) restrict M2 and the masking to tokens where
    a PPO clip would act (A > 0 with r > 1, or A < 0 with r < 1); we follow the arXiv form over all
    valid tokens. Masked tokens' log-ratios are zeroed before exp(), so an outlier too large for
    float32 cannot put inf * 0 = nan into the gradient.

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        tau: bound on the M2 of the kept tokens, > 0.
        cutoff: mask the valid tokens with (log r)^2 >= cutoff; None computes it from this batch
            with ``m2po_cutoff``. Ranks that each hold part of a batch pass the cutoff of the
            whole batch (see the module docstring); inf masks nothing.

    Returns:
        The scalar loss (token-mean over valid tokens) and metrics; ``clip_frac`` is the fraction
        of valid tokens masked.
    """
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got tau={tau}")
    mask, log_ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    squared = log_ratio.detach().square()
    if cutoff is None:
        cutoff = m2po_cutoff(squared[mask], tau)
    masked_out = mask & (squared >= cutoff)
    kept = mask & ~masked_out
    ratio = torch.where(kept, log_ratio, 0.0).exp()
    loss = -masked_mean(torch.where(kept, ratio * advantages, 0.0), mask)
    return loss, _metrics(log_ratio, masked_out, mask, advantages, dropped=masked_out)


def m2po_cutoff(sq_log_ratios: Tensor, tau: float) -> float:
    """M2PO's masking threshold: the smallest (log r)^2 that must be masked, inf if none.

    ``sq_log_ratios`` holds (log r)^2 of every valid token of the batch (any shape, any order);
    the mask is ``sq_log_ratios >= cutoff``. Sorting the values down, v_1 >= ... >= v_n, the cut
    masks the k largest for the smallest k with mean(v_{k+1}, ..., v_n) <= tau, and returns v_k
    (inf when k = 0); the mean of no tokens counts as <= tau, so k = n masks everything.

    Ties: values equal to v_k past position k are masked too, since the mask is a threshold. That
    keeps the bound (removing values >= the mean of the rest never raises it) and makes the mask
    independent of the order of equal values, which ranks holding different shards could not
    reproduce. The sums run in float64 over the sorted values, so the result does not depend on
    the order the values arrive in either.

    Args:
        sq_log_ratios: squared log-ratios of all valid tokens, e.g. the concatenation of every
            rank's ``m2po_sq_log_ratios``.
        tau: bound on the M2 of the kept tokens, > 0.

    Returns:
        The cutoff as a python float, exactly one of the input values (or inf).
    """
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got tau={tau}")
    values = sq_log_ratios.detach().flatten().double().sort(descending=True).values
    n = values.numel()
    # kept_mean[k]: mean of the values left after masking the k largest, k = 0 .. n - 1.
    kept_mean = values.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=values.dtype)
    meets_bound = (kept_mean <= tau).nonzero()
    k = int(meets_bound[0]) if len(meets_bound) else n
    return math.inf if k == 0 else float(values[k - 1])


def m2po_sq_log_ratios(logp: Tensor, mu_logp: Tensor, mask: Tensor) -> Tensor:
    """(log pi - log mu)^2 of the valid tokens, flattened, as ``m2po_loss`` computes them: the
    values a rank contributes to ``m2po_cutoff`` of a sharded batch. [B, T] in, [n] out."""
    _check_shapes(logp=logp, mu_logp=mu_logp, mask=mask)
    mask = mask.bool()
    return _log_ratio(logp, mu_logp, mask).detach().square()[mask]


def m2po_release_loss(
    logp: Tensor,
    mu_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    budget: float = 0.04,
) -> tuple[Tensor, dict[str, float]]:
    """M2PO as its authors' code runs it: PPO's clip, with a width set per micro-batch so that
    the second moment of the harmful tokens' log-ratios, capped at the clip, is under a budget.

    loss = -mean_t( min(r_t A_t, clip(r_t, exp(-c), exp(c)) A_t) ),   r_t = pi_t / mu_t
    c^2  = m2po_release_threshold({(log r_t)^2 : t valid and harmful}, budget)
    harmful: A_t > 0 with r_t > 1, or A_t < 0 with r_t < 1 (where a PPO clip can act)

    From the release of M2PO (Zheng, Zhao & Chen 2025, arXiv:2510.01161;
    github.com/Infini-AI-Lab/M2PO, ``compute_m2po_policy_loss`` in
    verl/trainer/ppo/core_algos.py, run with ``M2_budget=0.04``). Where the arXiv form
    (``m2po_loss``) masks tokens of any direction from the largest (log r)^2 down, the release
    measures M2 only over the harmful tokens, caps their |log r| at the largest c whose capped M2
    stays under the budget, and turns c into a PPO clip [exp(-c), exp(c)] on r. The clip is
    one-sided as in PPO: a harmful token beyond it (A > 0 with log r > c, A < 0 with
    log r < -c) gives the constant exp(+-c) * A and no gradient; a token that drifted the other
    way (A > 0 with r < 1, A < 0 with r > 1) keeps the gradient -r_t * A_t / n however far it
    went, as does every token inside the clip. With the harmful tokens' M2 already <= budget, or
    no harmful token, nothing is clipped.

    The statistic is per call, as the authors take it per micro-batch on each data-parallel rank
    (in ``dp_actor.update_policy``), never gathered: ranks that hold parts of a batch each clip
    with their own c, so this loss is not in ``BATCH_STATISTICS``.

    Where we differ: the release signs a whole sequence by its first token's advantage, we sign
    each token by its own (the same for a sequence-level advantage); its small epsilons (1e-12
    on r, A and the budget) are left out; its optional floors on the clip width (the function's
    0.3 / 0.5 defaults) are not offered, since its training path passes them unset. The clip
    compares (log r)^2 with c^2, the values the threshold is chosen from, so a token at the
    threshold is inside the clip on every dtype. The mean runs over all valid tokens (verl's
    token-mean), clipped ones included. Clipped tokens' log-ratios are zeroed before exp(), so a
    ratio too large for exp() cannot put inf * 0 = nan into the gradient.

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        budget: the M2 of the harmful tokens after capping must be under it, > 0 (the
            authors' ``M2_budget``, 0.04 in their scripts, the arXiv tau).

    Returns:
        The scalar loss (token-mean over valid tokens) and metrics; ``clip_frac`` is the fraction
        of valid tokens clipped; ``m2_harmful`` is the M2 of the harmful tokens before capping
        (0.0 when there are none).
    """
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got budget={budget}")
    mask, log_ratio, advantages = _prepare(logp, mu_logp, advantages, mask)
    squared = log_ratio.detach().square()
    harmful = mask & (((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)))
    threshold = m2po_release_threshold(squared[harmful], budget)
    clipped = harmful & (squared > threshold)
    ratio = torch.where(clipped, 0.0, log_ratio).exp()
    # A clipped token sits at exp(c) or exp(-c), the side its log-ratio went to.
    c = torch.full_like(log_ratio, math.sqrt(threshold) if math.isfinite(threshold) else 0.0)
    bound = torch.where(log_ratio > 0, c, -c).detach().exp()
    terms = torch.where(clipped, bound * advantages, ratio * advantages)
    loss = -masked_mean(terms, mask)
    metrics = _metrics(log_ratio, clipped, mask, advantages, dropped=clipped)
    m2_harmful = float(squared[harmful].double().mean()) if harmful.any() else 0.0
    return loss, metrics | {"m2_harmful": m2_harmful}


def m2po_release_threshold(sq_log_ratios: Tensor, budget: float) -> float:
    """The released M2PO's squared clip c^2 on |log r|: inf when nothing needs capping.

    ``sq_log_ratios`` holds (log r)^2 of the harmful tokens (any shape, any order). When their
    mean is <= budget, or there are none, the result is inf. Otherwise it is the largest of the
    values v_j whose cap keeps the capped mean under the budget, mean_i(min(v_i, v_j)) < budget,
    or 0.0 when
    none does: the authors' ``_solve_tau_from_sorted_delta2``, which walks the sorted values up to
    the first whose cap reaches the budget and returns the one before it. The sums run in float64
    over the sorted values, so the order the values arrive in does not matter.

    Args:
        sq_log_ratios: squared log-ratios of the harmful tokens of one micro-batch.
        budget: the M2 budget, > 0.

    Returns:
        c^2 as a python float: one of the input values, 0.0, or inf.
    """
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got budget={budget}")
    values = sq_log_ratios.detach().flatten().double().sort().values
    n = values.numel()
    if n == 0 or float(values.mean()) <= budget:
        return math.inf
    # capped_sum[j] = sum_i min(v_i, v_j) = (sum of the values below v_j) + v_j * (n - j).
    below = torch.cat([values.new_zeros(1), values.cumsum(0)[:-1]])
    capped_sum = below + values * torch.arange(n, 0, -1, dtype=values.dtype)
    under = (capped_sum < budget * n).nonzero()
    return float(values[under[-1]]) if len(under) else 0.0


def ess_aipo_loss(
    logp: Tensor,
    mu_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    rho: float = 4.0,
    ess: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """AIPO scaled by the batch's normalised effective sample size of sequence weights (VCPO).

    loss = sg(ess) * aipo_loss,   ess = (sum_i W_i)^2 / (S * sum_i W_i^2),
    W_i  = prod_{t in i} pi_t / mu_t over the S sequences with a valid token

    From VCPO (Huang, Zhang, Hu, Yang & Han 2026, "Stable Asynchrony: Variance-Controlled
    Off-Policy RL for LLMs", arXiv:2602.17616; github.com/mit-han-lab/vcpo): stale rollouts give
    heavy-tailed importance weights, a few trajectories dominate the update, and the ESS of the
    minibatch's trajectory weights predicts the collapse; VCPO damps the step when it drops. Like
    VCPO the ESS is over sequences, with raw (untruncated) weights: the reward and advantage are
    per sequence, so the sequence is the sample whose weight can dominate, and the token-level ESS
    is already every loss's ``ess`` metric. The update itself is ``aipo_loss``'s (token weights
    min(r_t, rho)), so d loss / d log pi_t = -ess * min(r_t, rho) * A_t / n.

    Where we differ: VCPO scales the learning rate, by sqrt(min(1, ess / base)) for AdamW (linear
    for SGD, base 1 by default), and adds an optimal baseline; a loss cannot set the learning rate,
    so we scale the loss by ess (base 1). Under SGD that is VCPO's linear rule. Under Adam a
    constant loss scale cancels in m / sqrt(v): the scale only damps a batch whose ESS is low
    relative to the recent ones the moments remember, and gradient clipping sees the scaled norm.
    For VCPO's own rule the trainer can scale the learning rate by sqrt(``normalized_ess``).

    Args:
        logp, mu_logp, advantages, mask: [B, T], see the module docstring.
        rho: AIPO's truncation level of the token weight, > 0.
        ess: the normalised ESS in (0, 1]; None computes it from this batch. Ranks that each hold
            part of a batch pass ``normalized_ess`` of every rank's ``sequence_log_weights``.

    Returns:
        The scalar loss and AIPO's metrics plus ``ess_scale``, the ess the loss was scaled by.
    """
    loss, metrics = aipo_loss(logp, mu_logp, advantages, mask, rho=rho)
    if ess is None:
        ess = normalized_ess(sequence_log_weights(logp, mu_logp, mask))
    if not 0 < ess <= 1:
        raise ValueError(f"ess must be in (0, 1], got ess={ess}")
    return loss * ess, metrics | {"ess_scale": ess}


def sequence_log_weights(logp: Tensor, mu_logp: Tensor, mask: Tensor) -> Tensor:
    """log W_i = sum of the valid tokens' log pi - log mu, for each sequence (row) with a valid
    token: [B, T] in, [S] out, at least float32. What a rank contributes to ``normalized_ess`` of a
    sharded batch."""
    _check_shapes(logp=logp, mu_logp=mu_logp, mask=mask)
    mask = mask.bool()
    return _sequence_log_weight(_log_ratio(logp, mu_logp, mask), mask)[mask.any(dim=-1)]


def normalized_ess(log_weights: Tensor) -> float:
    """Normalised effective sample size (sum w)^2 / (n sum w^2) in (0, 1] of the weights
    w = exp(log_weights) (any shape); 1.0 when there are none.

    Computed as exp(2 logsumexp(log w) - logsumexp(2 log w)) / n in float64, so weights far too
    large for exp() (a long sequence's product of ratios) give the exact value rather than inf/inf.
    """
    log_weights = log_weights.detach().double()
    return float(_ess(log_weights, torch.ones_like(log_weights, dtype=torch.bool)))


def vcpo_baseline_advantages(
    rewards: Tensor, weights: Tensor, grad_sq_norms: Tensor, group_size: int
) -> Tensor:
    """VCPO's off-policy optimal baseline: each group's rewards minus the baseline that minimises
    the variance of the importance-weighted policy gradient.

    A_i = R_i - b_g,   b_g = sum_{i in g} w_i^2 s_i R_i / sum_{i in g} w_i^2 s_i

    From VCPO (Huang et al. 2026, "Stable Asynchrony", arXiv:2602.17616; its OPOB): the estimator
    sum_i w_i (R_i - b) grad log pi(y_i) has the least variance at this b when the sequences'
    score vectors are orthogonal with squared norms s_i = ||grad log pi(y_i)||^2 (the on-policy
    form, w = 1, is OPO's, Hao et al. 2025, arXiv:2505.23585). VCPO measures s_i from each
    sequence's gradient; OPO's cheap proxy is the sequence length. With w and s equal within a
    group, b_g is the group's mean reward (Dr. GRPO's baseline). A group whose w^2 s are all 0
    falls back to its mean. A group whose rewards are all equal gets advantage exactly 0 (no
    signal, as in ``grpo_advantages``), not a rounding residue of the weighted mean.

    The baseline is affine-equivariant (b(aR + c) = a b(R) + c), so passing GRPO's normalised
    advantages (R - mean) / std as ``rewards`` gives (R - b_g) / std: the baseline swapped into
    GRPO's advantage. Groups are whole on every rank (the trainer shards by groups), so the
    baseline needs no gather.

    Where we differ: VCPO computes per-sequence gradient norms inside its Megatron actor; here
    ``grad_sq_norms`` is an input, and the trainer passes OPO's length proxy. VCPO's recipe is
    this baseline (``trainer.advantage=vcpo_baseline``, w = ``tis_seq_weights``) with sequence
    TIS at cap 8 (``trainer.loss=tis_seq``, ``trainer.seq_is_cap=8``) and the ESS-scaled
    learning rate (``trainer.ess_lr``).

    Args:
        rewards: [B] one reward (or advantage) per sequence, groups of ``group_size`` in a row.
        weights: [B] the importance weight the estimator applies to each sequence, e.g.
            min(W_i, C) of ``tis_seq_loss`` (exp of ``sequence_log_weights``, truncated).
        grad_sq_norms: [B] ||grad log pi(y_i)||^2 or a proxy of it (the length), >= 0.
        group_size: sequences per group, >= 1; B must be a multiple of it.

    Returns:
        [B] the advantages R_i - b_g, in the dtype of ``rewards``.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_size must be >= 1 and divide the {rewards.numel()} rewards, got {group_size}"
        )
    _check_shapes(rewards=rewards, weights=weights, grad_sq_norms=grad_sq_norms)
    wide = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.detach().to(wide).reshape(-1, group_size)
    c = (weights.detach().to(wide) ** 2 * grad_sq_norms.detach().to(wide)).reshape(-1, group_size)
    total = c.sum(dim=1, keepdim=True)
    optimal = (c * r).sum(dim=1, keepdim=True) / total.clamp(min=torch.finfo(wide).tiny)
    baseline = torch.where(total > 0, optimal, r.mean(dim=1, keepdim=True))
    advantages = (r - baseline).masked_fill((r == r[:, :1]).all(dim=1, keepdim=True), 0.0)
    return advantages.reshape(rewards.shape).to(rewards.dtype)


LOSSES: dict[str, LossFn] = {
    "pg": pg_loss,
    "aipo": aipo_loss,
    "aipo_clamp": aipo_clamp_loss,
    "ppo_clip": ppo_clip_loss,
    "gipo": gipo_loss,
    "tis_seq": tis_seq_loss,
    "mis_seq": mis_seq_loss,
    "mis_seq_verl": mis_seq_verl_loss,
    "geo_mask": geo_mask_loss,
    "m2po": m2po_loss,
    "m2po_release": m2po_release_loss,
    "ess_aipo": ess_aipo_loss,
}

# Each loss's keyword arguments, and the ``trainer`` config field that sets each one. The batch
# statistics (``m2po``'s cutoff, ``ess_aipo``'s ess) are not config: the trainer computes them.
LOSS_OPTIONS: dict[str, dict[str, str]] = {
    "pg": {},
    "aipo": {"rho": "aipo_rho"},
    "aipo_clamp": {"rho": "aipo_rho"},
    "ppo_clip": {"clip_eps": "ppo_clip_eps"},
    "gipo": {"sigma": "gipo_sigma", "neg_ratio": "gipo_neg_ratio"},
    "tis_seq": {"cap": "seq_is_cap"},
    "mis_seq": {"lower": "seq_mis_lower", "upper": "seq_mis_upper"},
    "mis_seq_verl": {"lower": "seq_mis_lower", "upper": "seq_mis_upper"},
    "geo_mask": {"lower": "geo_mask_low", "upper": "geo_mask_high", "clip_eps": "ppo_clip_eps"},
    "m2po": {"tau": "m2po_tau"},
    "m2po_release": {"budget": "m2po_release_budget"},
    "ess_aipo": {"rho": "aipo_rho"},
}


def batch_health(log_ratios: Tensor) -> dict[str, float]:
    """``ess`` and ``log_ratio_p99`` (see the module docstring) of the valid tokens' log pi / mu
    given flat, e.g. every rank's concatenated: the two metrics a rank cannot combine from its
    own. 1.0 and 0.0 when there are none."""
    log_ratios = log_ratios.detach().flatten()
    if log_ratios.numel() == 0:
        return {"ess": 1.0, "log_ratio_p99": 0.0}
    valid = torch.ones_like(log_ratios, dtype=torch.bool)
    stats = torch.stack([_ess(log_ratios, valid), _masked_quantile(log_ratios.abs(), valid, 0.99)])
    return dict(zip(("ess", "log_ratio_p99"), stats.tolist(), strict=True))


# The losses that depend on a statistic of the whole batch: the keyword that takes it, what one
# rank contributes (``logp, mu_logp, mask -> values``) and how the values of every rank become the
# statistic (``values, loss keyword arguments -> statistic``). A trainer with ranks gathers the
# contributions, reduces them alike on every rank, and passes the result.
BATCH_STATISTICS: dict[str, tuple[str, Callable[..., Tensor], Callable[..., float]]] = {
    "m2po": ("cutoff", m2po_sq_log_ratios, lambda values, kw: m2po_cutoff(values, kw["tau"])),
    "ess_aipo": ("ess", sequence_log_weights, lambda values, kw: normalized_ess(values)),
    "mis_seq_verl": (
        "kept_share",
        token_sequence_log_weights,
        lambda values, kw: kept_token_share(values, kw["lower"], kw["upper"]),
    ),
    "geo_mask": (
        "kept_share",
        token_sequence_mean_log_ratios,
        lambda values, kw: kept_token_share(values, kw["lower"], kw["upper"]),
    ),
}


def _check_shapes(**tensors: Tensor) -> None:
    if len({t.shape for t in tensors.values()}) != 1:
        *first, last = tensors
        raise ValueError(
            f"{', '.join(first)} and {last} must share one shape [B, T], got "
            + ", ".join(str(tuple(t.shape)) for t in tensors.values())
        )


def _log_ratio(logp: Tensor, mu_logp: Tensor, mask: Tensor) -> Tensor:
    """log pi - log mu on valid tokens, 0 on padding; the gradient flows through ``logp``."""
    # Padding may hold arbitrary log-probs; zeroing the log-ratio there keeps exp() finite, so no
    # inf * 0 = nan can reach the gradient.
    return torch.where(mask, logp - mu_logp.detach(), 0.0)


def _prepare(
    logp: Tensor, mu_logp: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Check shapes; return the bool mask, the log-ratio log pi - log mu (0 on padding) and
    constant advantages (0 on padding)."""
    _check_shapes(logp=logp, mu_logp=mu_logp, advantages=advantages, mask=mask)
    mask = mask.bool()
    # Likewise for advantages: aipo multiplies logp by the advantage outside any select, so a nan
    # advantage on padding would give d loss / d logp = nan * 0 = nan there.
    advantages = torch.where(mask, advantages.detach(), 0.0)
    return mask, _log_ratio(logp, mu_logp, mask), advantages


def _sequence_log_weight(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """[B] sum of each row's valid log-ratios, detached, summed in at least float32 (a bf16 sum
    of many tokens would round the weight by percents)."""
    wide = torch.promote_types(log_ratio.dtype, torch.float32)
    return torch.where(mask, log_ratio.detach().to(wide), 0.0).sum(dim=-1)


def _ppo_clip_terms(
    log_ratio: Tensor, advantages: Tensor, clip_eps: float
) -> tuple[Tensor, Tensor]:
    """PPO's per-token surrogate min(r A, clip(r, 1 - eps, 1 + eps) A), r = exp(log_ratio), and
    where its clip is active (the clipped term is selected: a constant, no gradient)."""
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    return torch.minimum(unclipped, clipped), clipped < unclipped


def _truncated_weight(seq_log_weight: Tensor, cap: float) -> Tensor:
    """min(W, cap) from log W, formed as exp(min(log W, log cap)) so that no weight overflows."""
    return seq_log_weight.clamp(max=math.log(cap)).exp()


def _sequence_mean_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """[B] mean of each row's valid log-ratios (0 for a row with none), detached, in at least
    float32: the log of the row's geometric-mean ratio."""
    count = mask.sum(dim=-1).clamp(min=1)
    return _sequence_log_weight(log_ratio, mask) / count


def _within(log_values: Tensor, lower: float, upper: float) -> Tensor:
    """log lower <= log_values <= log upper, compared in float32, so that a rank's own values
    and the float64 copies gathered from every rank are judged alike."""
    log_values = log_values.float()
    return (log_values >= math.log(lower)) & (log_values <= math.log(upper))


def _over_kept(loss: Tensor, kept_share: float) -> Tensor:
    """A token-mean over the valid tokens turned into one over the kept tokens; a loss with no
    kept token (0.0, no gradient) stays as it is."""
    if not 0 <= kept_share <= 1:
        raise ValueError(f"kept_share must be in [0, 1], got kept_share={kept_share}")
    return loss / kept_share if kept_share > 0 else loss


def _ess(log_weights: Tensor, mask: Tensor) -> Tensor:
    """Normalised ESS of exp(log_weights) over ``mask`` as a 0-d tensor; 1 on an empty mask."""
    log_weights = torch.where(mask, log_weights, -math.inf).flatten()
    count = mask.sum()
    log_ess = 2 * torch.logsumexp(log_weights, 0) - torch.logsumexp(2 * log_weights, 0)
    # Rounding can put a uniform batch a hair above 1.
    ess = (log_ess.exp() / count.clamp(min=1)).clamp(max=1)
    return torch.where(count > 0, ess, 1.0)


def _masked_quantile(x: Tensor, mask: Tensor, q: float) -> Tensor:
    """q-quantile of ``x`` over ``mask``, interpolating linearly between order statistics like
    torch.quantile; 0 on an empty mask. Indexes with tensors, so it needs no host sync."""
    ordered = torch.where(mask, x, math.inf).flatten().sort().values  # valid values come first
    count = mask.sum()
    position = (count - 1).clamp(min=0).double() * q
    below, above = ordered[position.floor().long()], ordered[position.ceil().long()]
    fraction = (position - position.floor()).to(x.dtype)
    # Equal neighbours (inf ones included) need no interpolation, and inf - inf would be nan.
    value = torch.where(above > below, below + fraction * (above - below), below)
    return torch.where(count > 0, value, 0.0)


def _metrics(
    log_ratio: Tensor,
    clip_active: Tensor,
    mask: Tensor,
    advantages: Tensor,
    dropped: Tensor | None = None,
) -> dict[str, float]:
    """The health metrics of the module docstring, in at least float32, with one host sync;
    ``dropped`` marks the tokens whose term the loss made a constant or zero (none if None)."""
    learning = advantages != 0 if dropped is None else (advantages != 0) & ~dropped
    log_ratio = log_ratio.detach().to(torch.promote_types(log_ratio.dtype, torch.float32))
    ratio = log_ratio.exp()
    magnitude = log_ratio.abs()
    # Ratios and magnitudes are >= 0, so filling padding with 0 leaves the maxima unchanged.
    stats = torch.stack(
        [
            masked_mean(ratio, mask),
            torch.where(mask, ratio, 0.0).max(),
            masked_mean(clip_active.to(ratio.dtype), mask),
            _ess(log_ratio, mask),
            torch.where(mask, magnitude, 0.0).max(),
            _masked_quantile(magnitude, mask, 0.99),
            # expm1 keeps k3 ~ (log r)^2 / 2 accurate near r = 1, where r - 1 - log r cancels.
            masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            masked_mean(learning.to(ratio.dtype), mask),
        ]
    ).tolist()
    return dict(zip(METRIC_KEYS, stats, strict=True))
