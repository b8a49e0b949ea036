"""The staleness losses (pg, tis_seq, mis_seq, m2po, ess_aipo), their batch statistics and the
health metrics every loss returns, against hand-derived numbers."""

import inspect
import itertools
import math

import pytest
import torch
from conftest import close, leaf

from relayrl.algorithms.losses import (
    BATCH_STATISTICS,
    LOSS_OPTIONS,
    LOSSES,
    aipo_loss,
    batch_health,
    ess_aipo_loss,
    m2po_cutoff,
    m2po_loss,
    m2po_sq_log_ratios,
    mis_seq_loss,
    normalized_ess,
    pg_loss,
    sequence_log_weights,
    tis_seq_loss,
)
from relayrl.config import ConfigError, TrainerConfig, load_config

NAN, INF = float("nan"), float("inf")


def three_sequences():
    """Rows of 3, 1 and 2 valid tokens; padding holds nan and inf in every input.

    mu = -1 on valid tokens; log-ratios A [0.2, -0.1, 0.3], B [-0.5], C [1.0, 0.5], so the
    sequence weights are W_A = e^0.4 = 1.49182, W_B = e^-0.5 = 0.60653, W_C = e^1.5 = 4.48169.
    Advantages are per sequence: A 1, B -2, C 0.5. Sums of log pi: A -2.6, B -1.5, C -0.5.
    """
    logp = leaf([[-0.8, -1.1, -0.7], [-1.5, NAN, -INF], [0.0, -0.5, NAN]])
    mu_logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -INF, INF], [-1.0, -1.0, NAN]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, INF, NAN], [0.5, 0.5, -INF]])
    mask = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
    return logp, mu_logp, advantages, mask


def test_sequence_weight_is_the_product_of_the_rows_valid_ratios():
    logp, mu_logp, _, mask = three_sequences()
    # log W = sum of valid log-ratios: A 0.2 - 0.1 + 0.3, B -0.5, C 1.0 + 0.5; padding ignored
    close(sequence_log_weights(logp, mu_logp, mask), [0.4, -0.5, 1.5])
    # A row with no valid token is no sequence: it is left out, not given weight 1.
    empty_row = torch.tensor([[True, True, True], [False, False, False], [True, True, False]])
    close(sequence_log_weights(logp, mu_logp, empty_row), [0.4, 1.5])


def test_tis_seq_truncates_each_sequence_weight_by_hand():
    logp, mu_logp, advantages, mask = three_sequences()

    loss, metrics = tis_seq_loss(logp, mu_logp, advantages, mask, cap=2.0)
    loss.backward()

    # weights min(W, 2) = [1.49182, 0.60653, 2 (C truncated)], n = 6 valid tokens
    # loss = -(1.49182*1*(-2.6) + 0.60653*(-2)*(-1.5) + 2*0.5*(-0.5)) / 6
    #      = -(-3.87874 + 1.81959 - 0.5) / 6 = 0.42653
    close(loss, 0.42653)
    # grad = -min(W_i, 2) * A_i / 6 on each of the row's valid tokens, 0 on padding:
    # A -1.49182/6, B -0.60653*(-2)/6, C -2*0.5/6 (C keeps learning, at weight 2)
    close(logp.grad, [[-0.24864] * 3, [0.20218, 0.0, 0.0], [-0.16667, -0.16667, 0.0]])
    # the two tokens of C, the one truncated sequence, of 6
    close(metrics["clip_frac"], 2 / 6)


def test_mis_seq_masks_whole_sequences_and_keeps_the_weight_of_the_rest():
    logp, mu_logp, advantages, mask = three_sequences()

    loss, metrics = mis_seq_loss(logp, mu_logp, advantages, mask, lower=0.7, upper=2.0)
    loss.backward()

    # B (W = 0.60653 < 0.7) and C (W = 4.48169 > 2) are masked out entirely; A keeps weight
    # W_A = 1.49182, not 1. The denominator still counts all 6 valid tokens.
    # loss = -(1.49182 * 1 * (-2.6)) / 6 = 0.64646
    close(loss, 0.64646)
    close(logp.grad, [[-0.24864] * 3, [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.count_nonzero(logp.grad[1:]) == 0
    # tokens of B and C: 3 of 6
    close(metrics["clip_frac"], 0.5)


def test_mis_seq_bounds_are_inclusive():
    # One token with log-ratio log 2, so W = upper = 2: the comparison log W <= log upper casts
    # math.log(2) to the tensor's float32, the same number as the log-ratio.
    logp = leaf([[math.log(2.0)]])
    loss, metrics = mis_seq_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    loss.backward()
    assert metrics["clip_frac"] == 0.0
    close(logp.grad, [[-2.0]])


def test_sequence_weights_are_formed_in_log_space():
    # Row 0: two tokens of log-ratio 60, W = e^120, which float32 cannot hold.
    assert torch.tensor(120.0).exp().isinf()
    logp = leaf([[60.0, 60.0], [0.5, 0.0]])
    mu_logp = torch.zeros(2, 2)
    advantages = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[True, True], [True, False]])

    tis, tis_metrics = tis_seq_loss(logp, mu_logp, advantages, mask, cap=2.0)
    mis, _ = mis_seq_loss(logp, mu_logp, advantages, mask)
    tis.backward()

    # tis: row 0 at weight 2, row 1 at e^0.5 = 1.64872: -(2*120 + 1.64872*0.5) / 3
    close(tis, -(2 * 120 + math.exp(0.5) * 0.5) / 3)
    close(logp.grad, [[-2 / 3, -2 / 3], [-math.exp(0.5) / 3, 0.0]])
    close(tis_metrics["clip_frac"], 2 / 3)
    # mis: row 0 masked without inf * 0 = nan; row 1 kept (W = 1.64872 in [0.5, 2])
    close(mis, -(math.exp(0.5) * 0.5) / 3)


@pytest.mark.parametrize(
    ("loss_fn", "kwargs", "message"),
    [
        (tis_seq_loss, {"cap": 0.0}, "cap must be > 0, got cap=0.0"),
        (mis_seq_loss, {"lower": 1.5}, "need 0 < lower <= 1 <= upper, got lower=1.5"),
        (mis_seq_loss, {"lower": 0.0}, "need 0 < lower <= 1 <= upper, got lower=0.0"),
        (mis_seq_loss, {"upper": 0.9}, r"got lower=0.5, upper=0.9"),
        (m2po_loss, {"tau": 0.0}, "tau must be > 0, got tau=0.0"),
        (ess_aipo_loss, {"ess": 0.0}, r"ess must be in \(0, 1\], got ess=0.0"),
        (ess_aipo_loss, {"ess": 1.5}, r"ess must be in \(0, 1\], got ess=1.5"),
    ],
)
def test_out_of_range_options_are_rejected(loss_fn, kwargs, message):
    batch = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match=message):
        loss_fn(*batch, **kwargs)


def test_m2po_cutoff_masks_from_the_largest_down_by_hand():
    # (log r)^2 = 0.5^2, 0, 0.25^2, 0.125^2 (exact in binary): M2 = 0.328125 / 4 = 0.08203 > 0.04;
    # without 0.25 the rest has M2 = 0.078125 / 3 = 0.02604 <= 0.04, so 0.25 alone is masked.
    assert m2po_cutoff(torch.tensor([0.25, 0.0, 0.0625, 0.015625]), 0.04) == 0.25
    # tau = 0.02 needs one more: without 0.25 and 0.0625, M2 = 0.015625 / 2 = 0.0078
    assert m2po_cutoff(torch.tensor([0.25, 0.0, 0.0625, 0.015625]), 0.02) == 0.0625


def test_m2po_cutoff_masks_a_tie_group_whole():
    # M2 = 0.5 / 5 = 0.1 > tau. Masking one of the two 0.25s already gives 0.25 / 4 = 0.0625 <= tau,
    # but which one would depend on order; the cutoff masks both (all values >= 0.25).
    values = torch.tensor([0.25, 0.0, 0.25, 0.0, 0.0])
    assert m2po_cutoff(values, 0.0625) == 0.25
    logp = leaf([[0.5, 0.0, -0.5, 0.0, 0.0]])
    _, metrics = m2po_loss(logp, torch.zeros(1, 5), torch.ones(1, 5), torch.ones(1, 5), tau=0.0625)
    close(metrics["clip_frac"], 2 / 5)


def test_m2po_cutoff_edge_cases():
    # M2 exactly tau meets the bound (<=): nothing is masked
    assert m2po_cutoff(torch.tensor([0.25, 0.0, 0.0, 0.0]), 0.0625) == math.inf
    # even the smallest value exceeds tau: everything is masked
    assert m2po_cutoff(torch.tensor([0.25, 0.0625]), 0.01) == 0.0625
    assert m2po_cutoff(torch.tensor([]), 0.04) == math.inf
    # any order of the same values, as ranks may gather them in
    values = [0.25, 0.0, 0.0625, 0.015625, 0.0625]
    cutoffs = {m2po_cutoff(torch.tensor(p), 0.02) for p in itertools.permutations(values)}
    assert cutoffs == {0.0625}


def test_m2po_masks_the_largest_squared_log_ratio_and_trains_r_times_a_by_hand():
    # log-ratios [[0.5, 0, -0.25], [0.125, padding, padding]]; mu = -1 on valid tokens
    logp = leaf([[-0.5, -1.0, -1.25], [-0.875, NAN, 0.0]])
    mu_logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, INF, -INF]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, NAN, 5.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])

    loss, metrics = m2po_loss(logp, mu_logp, advantages, mask, tau=0.04)
    loss.backward()

    # cutoff 0.25 (the first case of the cutoff test): token 0 is masked.
    # loss = -(r1*1 + r2*1 + r3*(-1)) / 4 with r = [1, e^-0.25, e^0.125], all 4 valid tokens
    #      = -(1 + 0.77880 - 1.13315) / 4 = -0.16141
    close(loss, -0.16141)
    # grad = -r*A/4 through the unclipped ratio on kept tokens, exactly 0 on the masked one
    close(logp.grad, [[0.0, -0.25, -0.19470], [0.28329, 0.0, 0.0]])
    assert logp.grad[0, 0].item() == 0.0
    close(metrics["clip_frac"], 1 / 4)
    assert m2po_sq_log_ratios(logp, mu_logp, mask).tolist() == [0.25, 0.0, 0.0625, 0.015625]


def test_m2po_masked_outlier_too_large_for_exp_leaves_a_finite_gradient():
    logp = leaf([[200.0, 0.0, 0.0]])  # e^200 is inf in float32
    loss, metrics = m2po_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3))
    loss.backward()
    close(loss, -2 / 3)
    close(logp.grad, [[0.0, -1 / 3, -1 / 3]])
    close(metrics["clip_frac"], 1 / 3)


def test_m2po_given_cutoff_overrides_its_own():
    logp = leaf([[0.5, 0.0, -0.25, 0.125]])
    batch = (torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4))
    _, own = m2po_loss(logp, *batch)
    _, given = m2po_loss(logp, *batch, cutoff=0.0625)  # masks 0.25 and 0.0625
    _, none = m2po_loss(logp, *batch, cutoff=math.inf)
    assert (own["clip_frac"], given["clip_frac"], none["clip_frac"]) == (0.25, 0.5, 0.0)


def test_normalized_ess_by_hand():
    # uniform weights: (n w)^2 / (n * n w^2) = 1
    assert normalized_ess(torch.zeros(4)) == pytest.approx(1.0)
    assert normalized_ess(torch.full((3,), 7.5)) == pytest.approx(1.0)
    # weights [1, 3]: (1 + 3)^2 / (2 * (1 + 9)) = 16 / 20
    assert normalized_ess(torch.tensor([0.0, math.log(3.0)])) == pytest.approx(0.8)
    # one dominant weight of 4: 1003^2 / (4 * (10^6 + 3)) = 0.25150, about 1/n
    dominant = torch.tensor([math.log(1000.0), 0.0, 0.0, 0.0])
    assert normalized_ess(dominant) == pytest.approx(0.2515015, abs=1e-6)
    # log-weights far beyond exp()'s range give the same 0.8, not inf / inf
    huge = torch.tensor([5000.0, 5000.0 + math.log(3.0)], dtype=torch.float64)
    assert normalized_ess(huge) == pytest.approx(0.8)
    assert normalized_ess(torch.tensor([])) == 1.0


def test_ess_aipo_scales_aipo_by_the_sequence_ess_by_hand():
    # Row 0: one token with r = 3 (W = 3); row 1: two on-policy tokens (W = 1).
    # log-ratios [[log 3, padding], [0, 0]]
    logp = leaf([[-1.0, NAN], [-2.0, -0.5]])
    mu_logp = torch.tensor([[-1.0 - math.log(3.0), -INF], [-2.0, -0.5]])
    advantages = torch.tensor([[1.0, INF], [-1.0, 2.0]])
    mask = torch.tensor([[True, False], [True, True]])

    loss, metrics = ess_aipo_loss(logp, mu_logp, advantages, mask, rho=4.0)
    loss.backward()

    # ess over the sequences' W = [3, 1]: 16 / 20 = 0.8
    # AIPO: weights min(r, 4) = [3, 1, 1]: -(3*1*(-1) + 1*(-1)*(-2) + 1*2*(-0.5)) / 3 = 2/3
    close(loss, 0.8 * 2 / 3)
    # grad = -0.8 * w * A / 3
    close(logp.grad, [[-0.8, 0.0], [0.8 / 3, -1.6 / 3]])
    assert metrics["ess_scale"] == pytest.approx(0.8)
    # the token-level ESS of the ratios [3, 1, 1] differs: 5^2 / (3 * 11) = 25/33
    close(metrics["ess"], 25 / 33)
    # a given ess replaces the batch's own
    given, _ = ess_aipo_loss(logp, mu_logp, advantages, mask, ess=0.5)
    close(given, 0.5 * 2 / 3)


def test_pg_ignores_the_behaviour_policy():
    logp = leaf([[-0.5, -1.0, -1.5, NAN]])
    stale = torch.tensor([[-3.0, 0.0, -0.1, INF]])
    advantages = torch.tensor([[1.0, -2.0, 3.0, NAN]])
    mask = torch.tensor([[True, True, True, False]])

    loss, metrics = pg_loss(logp, stale, advantages, mask)
    loss.backward()

    # -(1*(-0.5) + (-2)*(-1) + 3*(-1.5)) / 3 = 1.0; the ratios (up to e^2.5) change nothing
    close(loss, 1.0)
    close(logp.grad, [[-1 / 3, 2 / 3, -1.0, 0.0]])
    assert metrics["clip_frac"] == 0.0
    close(metrics["ratio_max"], math.exp(2.5))


def test_health_metrics_by_hand():
    # log-ratios [0.5, 0, -1, 0.25]; the padding's 5.0 would top every max if it leaked
    logp = leaf([[0.5, 0.0, -1.0, 0.25, 5.0]])
    mask = torch.tensor([[True, True, True, True, False]])

    _, metrics = pg_loss(logp, torch.zeros(1, 5), torch.ones(1, 5), mask)

    # r = [1.64872, 1, 0.36788, 1.28403]
    close(metrics["ratio_mean"], 1.07516)  # 4.30062 / 4
    close(metrics["ratio_max"], 1.64872)
    # (sum r)^2 / (n sum r^2) = 4.30062^2 / (4 * 5.50234)
    close(metrics["ess"], 0.84034)
    close(metrics["log_ratio_max"], 1.0)
    # |log r| sorted [0, 0.25, 0.5, 1]; rank 0.99 * 3 = 2.97: 0.5 + 0.97 * (1 - 0.5)
    close(metrics["log_ratio_p99"], 0.985)
    # mean of r - 1 - log r: (0.14872 + 0 + 0.36788 + 0.03403) / 4
    close(metrics["kl_mu_pi"], 0.13766)


def test_log_ratio_p99_matches_torch_quantile_and_ess_the_naive_formula():
    torch.manual_seed(0)
    for _ in range(5):
        log_ratio = torch.randn(7, 11)
        mask = torch.rand(7, 11) > 0.4
        _, metrics = pg_loss(log_ratio, torch.zeros(7, 11), torch.ones(7, 11), mask)
        valid = log_ratio[mask]
        ratio = valid.exp()
        close(metrics["log_ratio_p99"], torch.quantile(valid.abs(), 0.99).item())
        close(metrics["ess"], (ratio.sum() ** 2 / (len(valid) * (ratio**2).sum())).item())


def test_kl_mu_pi_estimates_kl_of_mu_from_pi_on_tokens_sampled_by_mu():
    mu = torch.tensor([0.7, 0.2, 0.1])
    pi = torch.tensor([0.2, 0.3, 0.5])
    tokens = torch.multinomial(
        mu, 200_000, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    logp, mu_logp = pi.log()[tokens][None], mu.log()[tokens][None]

    _, metrics = pg_loss(logp, mu_logp, torch.ones_like(logp), torch.ones_like(logp))

    kl_mu_pi = float((mu * (mu / pi).log()).sum())  # 0.63490
    kl_pi_mu = float((pi * (pi / mu).log()).sum())  # 0.67581, the other direction
    # standard error of the mean of k3 here is about 0.0014
    assert metrics["kl_mu_pi"] == pytest.approx(kl_mu_pi, abs=0.01)
    assert abs(metrics["kl_mu_pi"] - kl_pi_mu) > 0.03


def random_batch(seed: int, rows: int = 6, width: int = 5):
    """Rows of random lengths, log-ratios within +-0.6, non-finite padding."""
    generator = torch.Generator().manual_seed(seed)
    logp = torch.randn(rows, width, generator=generator) - 2.0
    mu_logp = logp - torch.empty(rows, width).uniform_(-0.6, 0.6, generator=generator)
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, width).clone()
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    logp[~mask], mu_logp[~mask], advantages[~mask] = NAN, -INF, INF
    return logp, mu_logp, advantages, mask


def global_statistics(name: str, shards) -> dict[str, float]:
    """What a trainer gathers from its ranks and passes to each: the batch statistics."""
    if name not in BATCH_STATISTICS:
        return {}
    keyword, contribute, reduce = BATCH_STATISTICS[name]
    values = torch.cat([contribute(lp, mu, m) for lp, mu, _, m in shards])
    parameters = inspect.signature(LOSSES[name]).parameters.values()
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
    return {keyword: reduce(values, defaults)}


def whole_and_split(name: str, seed: int, statistics: bool):
    """Loss and gradient of a batch, and of its two halves weighted by their token shares."""
    logp, mu_logp, advantages, mask = random_batch(seed)
    whole_logp = logp.clone().requires_grad_()
    whole, _ = LOSSES[name](whole_logp, mu_logp, advantages, mask)
    whole.backward()

    split_logp = logp.clone().requires_grad_()
    shards = [
        (split_logp[rows], mu_logp[rows], advantages[rows], mask[rows])
        for rows in (slice(0, 3), slice(3, 6))
    ]
    kwargs = global_statistics(name, shards) if statistics else {}
    split = sum(
        LOSSES[name](*shard, **kwargs)[0] * (shard[3].sum() / mask.sum()) for shard in shards
    )
    split.backward()
    return whole.detach(), whole_logp.grad, split.detach(), split_logp.grad


# m2po_release takes its statistic per micro-batch by design (see its test of ranks).
@pytest.mark.parametrize("name", sorted(set(LOSSES) - {"m2po_release"}))
def test_two_shards_with_the_global_statistics_take_the_whole_batchs_step(name):
    whole, whole_grad, split, split_grad = whole_and_split(name, seed=3, statistics=True)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(split_grad, whole_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["m2po", "ess_aipo"])
def test_shards_with_their_own_statistics_do_not(name):
    # Shows the test above can fail: each half's own cutoff or ESS differs from the batch's.
    whole, _, split, _ = whole_and_split(name, seed=3, statistics=False)
    assert abs(float(split - whole)) > 1e-3


@pytest.mark.parametrize("name", ["pg", "tis_seq", "mis_seq", "m2po", "ess_aipo"])
def test_bf16_in_gives_bf16_out_matching_float32(name):
    # Log-ratios exact in bf16 ([[0.5, 0, -0.25], [0.125, -0.5, pad]]), so bf16 and float32 take
    # the same truncation, masking and cutoff decisions; only exp() and the sums round.
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-1.5, -0.75, 0.0]])
    mu_logp = torch.tensor([[-1.5, -0.5, -1.75], [-1.625, -0.25, 0.0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        x = logp.to(dtype).requires_grad_()
        loss, metrics = LOSSES[name](x, mu_logp.to(dtype), advantages.to(dtype), mask)
        loss.backward()
        assert loss.dtype == dtype and x.grad.dtype == dtype
        results[dtype] = (loss.float(), x.grad.float(), metrics["clip_frac"])
    (loss, grad, clip_frac), (reference, reference_grad, reference_clip) = results.values()
    torch.testing.assert_close(loss, reference, atol=1e-2, rtol=0)
    torch.testing.assert_close(grad, reference_grad, atol=1e-2, rtol=0)
    assert clip_frac == reference_clip


def test_every_loss_option_is_a_trainer_field_with_the_same_default():
    assert LOSS_OPTIONS.keys() == LOSSES.keys()
    for name, options in LOSS_OPTIONS.items():
        parameters = inspect.signature(LOSSES[name]).parameters
        for keyword, field in options.items():
            assert TrainerConfig.model_fields[field].default == parameters[keyword].default


@pytest.mark.parametrize(
    "override",
    [
        "trainer.seq_is_cap=0",
        "trainer.seq_mis_lower=1.5",
        "trainer.seq_mis_upper=0.5",
        "trainer.m2po_tau=0",
    ],
)
def test_config_rejects_out_of_range_staleness_options(override):
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{field} = "):
        load_config(None, [override])


def test_batch_health_of_the_valid_log_ratios_is_the_losses_own_ess_and_p99():
    logp, mu_logp, advantages, mask = three_sequences()
    _, metrics = aipo_loss(logp, mu_logp, advantages, mask)
    # the valid tokens' log-ratios, from the docstring of three_sequences
    health = batch_health(torch.tensor([0.2, -0.1, 0.3, -0.5, 1.0, 0.5]))
    assert health["ess"] == pytest.approx(metrics["ess"], rel=1e-6)
    assert health["log_ratio_p99"] == pytest.approx(metrics["log_ratio_p99"], rel=1e-6)
    # |log r| sorted: 0.1 0.2 0.3 0.5 0.5 1.0; p99 at position 4.95: 0.5 + 0.95 * 0.5
    assert health["log_ratio_p99"] == pytest.approx(0.975, rel=1e-6)
    assert batch_health(torch.tensor([])) == {"ess": 1.0, "log_ratio_p99": 0.0}
