"""The stale-data corrections as their authors ship them (m2po_release, mis_seq_verl, geo_mask,
VCPO's baseline), and the ``kept_frac`` every loss reports, against hand-derived numbers."""

import inspect
import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import close, leaf, on_ranks

from relayrl import parallel
from relayrl.algorithms.losses import (
    BATCH_STATISTICS,
    LOSSES,
    geo_mask_loss,
    kept_token_share,
    m2po_release_loss,
    m2po_release_threshold,
    mis_seq_verl_loss,
    tis_seq_loss,
    tis_seq_weights,
    token_sequence_log_weights,
    token_sequence_mean_log_ratios,
    vcpo_baseline_advantages,
)
from relayrl.config import ConfigError, load_config

NAN, INF = float("nan"), float("inf")


# Each case: a loss and a batch in which no token carries a gradient (log-ratios given, mu = 0).
NOTHING_TO_LEARN = [
    # the one sequence has W = e^1 = 2.72 > upper 2: rejected whole
    ("mis_seq", [[0.5, 0.5]], [[1.0, 1.0]], {}),
    # (log r)^2 = 0.25 and 0.09 both exceed tau 0.04: even the smaller alone is masked
    ("m2po", [[0.5, -0.3]], [[1.0, -1.0]], {}),
    # r = e^0.5 = 1.65 > 1.2 with A > 0, r = e^-0.5 = 0.61 < 0.8 with A < 0: both clipped
    ("ppo_clip", [[0.5, -0.5]], [[1.0, -1.0]], {}),
    # r = e^2 = 7.39 > rho 4 on both: clamped to the constant rho
    ("aipo_clamp", [[2.0, 2.0]], [[1.0, -1.0]], {}),
    # no clip or mask, but every advantage is 0: no signal
    ("aipo", [[0.5, -0.3]], [[0.0, 0.0]], {}),
]


@pytest.mark.parametrize(("name", "log_ratios", "advantages", "kwargs"), NOTHING_TO_LEARN)
def test_a_batch_with_nothing_to_learn_has_zero_gradient_and_kept_frac_zero(
    name, log_ratios, advantages, kwargs
):
    logp = leaf(log_ratios)
    loss, metrics = LOSSES[name](
        logp, torch.zeros(1, 2), torch.tensor(advantages), torch.ones(1, 2), **kwargs
    )
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))
    assert metrics["kept_frac"] == 0.0


def test_kept_frac_counts_the_tokens_that_carry_a_gradient_by_hand():
    # aipo_clamp at rho 4: r = [e^2 = 7.39 (clamped, constant), 1, e^0.5 = 1.65, 1]; the last
    # token has A = 0. Of 4 valid tokens, tokens 1 and 2 carry a gradient: kept_frac = 2/4.
    logp = leaf([[2.0, 0.0, 0.5, 0.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, 0.0]])
    loss, metrics = LOSSES["aipo_clamp"](logp, torch.zeros(1, 4), advantages, torch.ones(1, 4))
    loss.backward()
    assert metrics["kept_frac"] == 0.5
    # d loss / d log pi = -r * A / 4 below rho, 0 above it and where A = 0
    close(logp.grad, [[0.0, -0.25, math.exp(0.5) / 4, 0.0]])


def harmful_batch():
    """One row of five tokens, mu = 0, so log r = logp: [0.5, -0.25, 0.125, -0.5, 0] with
    A = [1, -1, 1, 1, 1]. Harmful (A > 0 with r > 1, or A < 0 with r < 1): tokens 0, 1, 2, with
    (log r)^2 = 0.25, 0.0625, 0.015625 (exact in binary). Token 3 drifted the other way."""
    logp = leaf([[0.5, -0.25, 0.125, -0.5, 0.0]])
    advantages = torch.tensor([[1.0, -1.0, 1.0, 1.0, 1.0]])
    return logp, torch.zeros(1, 5), advantages, torch.ones(1, 5)


def test_m2po_release_threshold_caps_the_harmful_second_moment_by_hand():
    # sorted [0.015625, 0.0625, 0.25]: M2 = 0.328125 / 3 = 0.109375 > 0.04, budget sum 0.12.
    # capping at 0.015625: 3 * 0.015625 = 0.046875 < 0.12; at 0.0625: 0.015625 + 2 * 0.0625 =
    # 0.140625 >= 0.12. The largest cap under the budget is 0.015625: c = 0.125.
    values = torch.tensor([0.25, 0.0625, 0.015625])
    assert m2po_release_threshold(values, 0.04) == 0.015625
    # a looser budget 0.05 (sum 0.15) still stops at 0.0625: 0.140625 < 0.15 but 0.328125 is not
    assert m2po_release_threshold(values, 0.05) == 0.0625
    # M2 within the budget, or no harmful token: no clip
    assert m2po_release_threshold(values, 0.109375) == math.inf
    assert m2po_release_threshold(torch.tensor([]), 0.04) == math.inf
    # even the smallest cap reaches the budget (2 * 0.25 >= 2 * 0.04): c = 0
    assert m2po_release_threshold(torch.tensor([0.25, 0.25]), 0.04) == 0.0


def test_m2po_release_threshold_is_the_largest_cap_under_budget_in_any_order():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        values = torch.rand(9, generator=generator) ** 3
        budget = 0.02
        capped_means = {float(v): float(values.clamp(max=v).mean()) for v in values}
        under = [v for v, m in capped_means.items() if m < budget]
        expected = math.inf if values.mean() <= budget else max(under, default=0.0)
        assert m2po_release_threshold(values, budget) == pytest.approx(expected, rel=1e-6)
        shuffled = values[torch.randperm(9, generator=generator)]
        assert m2po_release_threshold(shuffled, budget) == m2po_release_threshold(values, budget)


def test_m2po_release_clips_harmful_tokens_and_keeps_the_rest_by_hand():
    logp, mu_logp, advantages, mask = harmful_batch()

    loss, metrics = m2po_release_loss(logp, mu_logp, advantages, mask, budget=0.04)
    loss.backward()

    # c^2 = 0.015625 (test above), c = 0.125: tokens 0 and 1 are clipped, at exp(0.125) and
    # exp(-0.125); token 2 sits exactly at c and is not. Token 3 (A > 0, r = e^-0.5) drifted the
    # other way and keeps r * A; the arXiv m2po would mask it as an outlier (log r)^2 = 0.25.
    # terms: 1.133148*1, 0.882497*(-1), e^0.125*1 = 1.133148, e^-0.5*1 = 0.606531, 1*1
    # loss = -(1.133148 - 0.882497 + 1.133148 + 0.606531 + 1) / 5 = -0.598066
    close(loss, -0.598066)
    # grad = -r * A / 5 on unclipped tokens, exactly 0 on clipped ones
    close(logp.grad, [[0.0, 0.0, -0.226630, -0.121306, -0.2]])
    assert logp.grad[0, :2].tolist() == [0.0, 0.0]
    close(metrics["clip_frac"], 2 / 5)
    close(metrics["kept_frac"], 3 / 5)
    close(metrics["m2_harmful"], 0.109375)


def test_m2po_release_clips_nothing_when_the_harmful_moment_is_within_budget():
    logp, mu_logp, advantages, mask = harmful_batch()
    # budget = M2 of the harmful tokens: the unclipped surrogate, grad -r * A / 5 everywhere
    loss, metrics = m2po_release_loss(logp, mu_logp, advantages, mask, budget=0.109375)
    loss.backward()
    ratio = torch.tensor([[0.5, -0.25, 0.125, -0.5, 0.0]]).exp()
    close(logp.grad, (-ratio * advantages / 5).tolist())
    assert metrics["clip_frac"] == 0.0


def test_m2po_release_clipped_ratio_too_large_for_exp_leaves_a_finite_gradient():
    # token 0: log r = 200 (e^200 is inf in float32), A > 0, harmful and far over any budget
    logp = leaf([[200.0, 0.0, 0.0]])
    loss, metrics = m2po_release_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3))
    loss.backward()
    # the only harmful token: c = 0, clipped at exp(0) = 1; the others are on-policy
    close(loss, -1.0)
    close(logp.grad, [[0.0, -1 / 3, -1 / 3]])
    assert metrics["clip_frac"] == pytest.approx(1 / 3)


def three_sequences():
    """Rows of 3, 1 and 2 valid tokens, mu = -1, non-finite padding. Log-ratios A [0.2, -0.1,
    0.3], B [-0.5], C [1.0, 0.5]: W_A = e^0.4 = 1.49182, W_B = e^-0.5 = 0.60653, W_C = e^1.5.
    Advantages per sequence: A 1, B -2, C 0.5. Sums of log pi: A -2.6, B -1.5, C -0.5."""
    logp = leaf([[-0.8, -1.1, -0.7], [-1.5, NAN, -INF], [0.0, -0.5, NAN]])
    mu_logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -INF, INF], [-1.0, -1.0, NAN]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, INF, NAN], [0.5, 0.5, -INF]])
    mask = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
    return logp, mu_logp, advantages, mask


def test_mis_seq_verl_divides_by_the_kept_tokens_only_by_hand():
    logp, mu_logp, advantages, mask = three_sequences()

    loss, metrics = mis_seq_verl_loss(logp, mu_logp, advantages, mask, lower=0.7, upper=2.0)
    loss.backward()

    # B (W = 0.60653 < 0.7) and C (W = 4.48 > 2) are rejected; A keeps W_A = 1.49182. mis_seq
    # divides by all 6 valid tokens (0.64646); verl by A's 3: -(1.49182 * 1 * (-2.6)) / 3
    close(loss, 1.29292)
    close(logp.grad, [[-0.49727] * 3, [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert metrics["kept_share"] == 0.5
    close(metrics["clip_frac"], 0.5)


def test_mis_seq_verl_rejecting_every_sequence_gives_zero_loss_and_gradient():
    logp, mu_logp, advantages, mask = three_sequences()
    # [0.95, 1.05] rejects all three sequences: 0 kept tokens, a zero loss rather than 0 / 0
    loss, metrics = mis_seq_verl_loss(logp, mu_logp, advantages, mask, lower=0.95, upper=1.05)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros(3, 3))
    assert (metrics["kept_share"], metrics["kept_frac"]) == (0.0, 0.0)


def geo_batch():
    """Three rows of two tokens, mu = 0 so log r = logp. Row 0: [0.004, -0.002], mean 0.001,
    G = 1.001; row 1: [0.5, 0.3], G = e^0.4 = 1.49; row 2: [0.3, -0.31], mean -0.005, G = 0.995.
    Advantages per row: 1, -1, 1."""
    logp = leaf([[0.004, -0.002], [0.5, 0.3], [0.3, -0.31]])
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [1.0, 1.0]])
    return logp, torch.zeros(3, 2), advantages, torch.ones(3, 2)


def test_geo_mask_masks_by_the_geometric_mean_and_clips_the_rest_by_hand():
    logp, mu_logp, advantages, mask = geo_batch()

    loss, metrics = geo_mask_loss(logp, mu_logp, advantages, mask)
    loss.backward()

    # SkyRL's [0.99, 1.01]: rows 0 and 2 kept, row 1 masked; 4 kept tokens of 6.
    # Row 2, token 0: r = e^0.3 = 1.34986 > 1.2 with A > 0, clipped to the constant 1.2; token 1:
    # r = e^-0.31 = 0.73345 with A > 0, PPO keeps the unclipped r * A (it is the smaller).
    # loss = -(e^0.004 + e^-0.002 + 1.2 + e^-0.31) / 4 = -(1.00401 + 0.99800 + 1.2 + 0.73345) / 4
    close(loss, -0.983864)
    # grad = -r * A / 4 on kept, unclipped tokens; 0 on the masked row and the clipped token
    close(logp.grad, [[-0.251002, -0.249500], [0.0, 0.0], [0.0, -0.183362]])
    close(metrics["kept_share"], 4 / 6)
    close(metrics["clip_frac"], 3 / 6)  # two masked, one clipped
    close(metrics["kept_frac"], 3 / 6)


def test_geo_mask_bound_does_not_grow_with_the_length():
    # Every token at log r = 0.008: G = e^0.008 = 1.008 whatever the length, kept by geo_mask;
    # the product W = e^(0.008 * 100) = 2.23 of the long row is rejected by mis_seq's upper 2.
    logp = leaf([[0.008] * 100, [0.008] * 2 + [NAN] * 98])
    mask = torch.zeros(2, 100, dtype=torch.bool)
    mask[0], mask[1, :2] = True, True
    advantages, mu_logp = torch.ones(2, 100), torch.zeros(2, 100)
    _, geo = geo_mask_loss(logp, mu_logp, advantages, mask)
    _, mis = mis_seq_verl_loss(logp, mu_logp, advantages, mask)
    assert geo["kept_share"] == 1.0
    close(mis["kept_share"], 2 / 102)


def test_kept_token_share_counts_tokens_not_sequences_by_hand():
    logp, mu_logp, _, mask = three_sequences()
    # each valid token carries its sequence's log W: A 0.4 (3 tokens), B -0.5, C 1.5 (2 tokens)
    values = token_sequence_log_weights(logp, mu_logp, mask)
    close(values, [0.4, 0.4, 0.4, -0.5, 1.5, 1.5])
    # [0.7, 5] keeps A and C: 5 tokens of 6 (counting sequences would give 2 of 3)
    assert kept_token_share(values, 0.7, 5.0) == pytest.approx(5 / 6)
    close(token_sequence_mean_log_ratios(logp, mu_logp, mask), [0.4 / 3] * 3 + [-0.5, 0.75, 0.75])
    assert kept_token_share(torch.tensor([]), 0.5, 2.0) == 1.0


@pytest.mark.parametrize(
    ("loss", "options"),
    [
        ("m2po_release", {"m2po_release_budget": 0.02}),
        ("mis_seq_verl", {"seq_mis_lower": 0.25, "seq_mis_upper": 3.0}),
        ("geo_mask", {"geo_mask_low": 0.9, "geo_mask_high": 1.1, "ppo_clip_eps": 0.3}),
    ],
)
def test_a_config_takes_each_new_loss_with_its_options(loss, options):
    overrides = [f"trainer.loss={loss}", *(f"trainer.{k}={v}" for k, v in options.items())]
    trainer = load_config(None, overrides).trainer
    assert trainer.loss == loss
    assert {k: getattr(trainer, k) for k in options} == options


def test_geo_mask_options_are_refused_with_another_loss():
    with pytest.raises(ValueError, match="an option of loss geo_mask"):
        load_config(None, ["trainer.loss=aipo", "trainer.geo_mask_high=1.1"])


# Two gloo ranks, each with half of a batch, as a trainer shards it (whole sequences per rank).


def stale_batch(seed: int, scale: float, rows: int = 8, width: int = 5):
    """Rows of random lengths, log-ratios within +-scale, advantages per row, nan padding."""
    generator = torch.Generator().manual_seed(seed)
    logp = torch.randn(rows, width, generator=generator) - 2.0
    mu_logp = logp - (torch.rand(rows, width, generator=generator) * 2 - 1) * scale
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, width).clone()
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    logp[~mask], mu_logp[~mask], advantages[~mask] = NAN, -INF, INF
    return logp, mu_logp, advantages, mask


# name: the batch (seed, log-ratio scale) that rejects or clips part of each half differently
RANK_CASES = {"mis_seq_verl": (2, 0.6), "geo_mask": (2, 0.03), "m2po_release": (3, 0.6)}


def defaults(name: str) -> dict:
    parameters = inspect.signature(LOSSES[name]).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not p.empty}


def shard_step(name: str, batch, rows: slice, gather: bool) -> tuple[float, torch.Tensor]:
    """One rank's loss (weighted by its token share, as the trainer weights it) and gradient,
    with the batch statistic gathered over the ranks as ``PolicyCore.loss_options`` does, or
    the rank's own."""
    logp, mu_logp, advantages, mask = batch
    shard_logp = logp[rows].clone().requires_grad_()
    kwargs = {}
    if gather and name in BATCH_STATISTICS:
        keyword, contribute, reduce = BATCH_STATISTICS[name]
        values = parallel.gather_cat(contribute(shard_logp.detach(), mu_logp[rows], mask[rows]))
        kwargs = {keyword: reduce(values, defaults(name))}
    loss, _ = LOSSES[name](shard_logp, mu_logp[rows], advantages[rows], mask[rows], **kwargs)
    loss = loss * (mask[rows].sum() / mask.sum())
    loss.backward()
    return float(loss.detach()), shard_logp.grad


def ranks_step(rank: int, world: int, store_path: str) -> dict:
    """This rank's (loss, gradient) of every case, with and without the gather."""
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        rows = slice(4 * rank, 4 * rank + 4)
        results = {}
        for name, (seed, scale) in RANK_CASES.items():
            batch = stale_batch(seed, scale)
            results[name, True] = shard_step(name, batch, rows, gather=True)
            results[name, False] = shard_step(name, batch, rows, gather=False)
        return results
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(ray_session, tmp_path_factory) -> dict:
    """Every case's (loss, gradient) summed over two gloo ranks, with and without the gather."""
    ranks = on_ranks(ranks_step, str(tmp_path_factory.mktemp("ranks") / "store"))
    return {
        key: (sum(r[key][0] for r in ranks), torch.cat([r[key][1] for r in ranks]))
        for key in ranks[0]
    }


def one_process(name: str, micro_batches: int) -> tuple[float, torch.Tensor]:
    """The whole batch in one process, as one call or as consecutive micro-batches of rows."""
    batch = stale_batch(*RANK_CASES[name])
    size = len(batch[0]) // micro_batches
    steps = [
        shard_step(name, batch, slice(i * size, (i + 1) * size), gather=False)
        for i in range(micro_batches)
    ]
    return sum(loss for loss, _ in steps), torch.cat([grad for _, grad in steps])


@pytest.mark.parametrize("name", ["mis_seq_verl", "geo_mask"])
def test_two_ranks_gathering_the_kept_share_take_the_whole_batchs_step(two_ranks, name):
    whole_loss, whole_grad = one_process(name, micro_batches=1)
    loss, grad = two_ranks[name, True]
    assert loss == pytest.approx(whole_loss, abs=1e-6)
    torch.testing.assert_close(grad, whole_grad, atol=1e-6, rtol=0)
    # without the gather each rank divides by its own kept share, and the step differs
    alone_loss, _ = two_ranks[name, False]
    assert abs(alone_loss - whole_loss) > 1e-3


def test_m2po_release_on_two_ranks_equals_one_process_given_the_same_micro_batches(two_ranks):
    assert "m2po_release" not in BATCH_STATISTICS
    loss, grad = two_ranks["m2po_release", True]
    micro_loss, micro_grad = one_process("m2po_release", micro_batches=2)
    assert loss == pytest.approx(micro_loss, abs=1e-6)
    torch.testing.assert_close(grad, micro_grad, atol=1e-6, rtol=0)
    # the statistic is the micro-batch's: one call over the whole batch clips differently
    whole_loss, _ = one_process("m2po_release", micro_batches=1)
    assert abs(whole_loss - loss) > 1e-3


def test_vcpo_baseline_weights_rewards_by_squared_weight_times_gradient_norm_by_hand():
    # group 0: R = [1, 0, 0], w = [2, 1, 1], s = [1, 1, 2]: w^2 s = [4, 1, 2], b = 4 / 7
    # group 1: R = [1, 1, 0], equal w and s: b = the mean 2/3 (GRPO's / Dr. GRPO's baseline)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    weights = torch.tensor([2.0, 1.0, 1.0, 3.0, 3.0, 3.0])
    grad_sq_norms = torch.tensor([1.0, 1.0, 2.0, 5.0, 5.0, 5.0])
    advantages = vcpo_baseline_advantages(rewards, weights, grad_sq_norms, group_size=3)
    close(advantages, [3 / 7, -4 / 7, -4 / 7, 1 / 3, 1 / 3, -2 / 3])


def test_vcpo_baseline_is_affine_equivariant_and_falls_back_to_the_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    weights = torch.tensor([2.0, 1.0, 0.5, 1.5])
    lengths = torch.tensor([3.0, 1.0, 4.0, 2.0])
    base = vcpo_baseline_advantages(rewards, weights, lengths, group_size=4)
    # GRPO-normalised rewards in, the baseline's advantages divided by the std out
    scaled = vcpo_baseline_advantages(rewards * 2.5 - 1.0, weights, lengths, group_size=4)
    close(scaled, (base * 2.5).tolist())
    # every w^2 s zero: the group's mean
    zero = vcpo_baseline_advantages(rewards, torch.zeros(4), lengths, group_size=4)
    close(zero, [0.5, -0.5, -0.5, 0.5])
    with pytest.raises(ValueError, match="group_size must be >= 1 and divide the 4 rewards"):
        vcpo_baseline_advantages(rewards, weights, lengths, group_size=3)


def test_vcpo_baseline_of_equal_rewards_is_exactly_zero():
    # sum(c R) / sum(c) rounds to R - 3.7e-9 for these c = w^2 s: no signal must stay none
    rewards = torch.full((3,), 0.058464765548706055)
    weights = torch.tensor([3.9919095039367676, 0.7101228833198547, 4.6732025146484375]).sqrt()
    advantages = vcpo_baseline_advantages(rewards, weights, torch.ones(3), group_size=3)
    assert advantages.tolist() == [0.0, 0.0, 0.0]


def test_tis_seq_weights_are_the_weights_tis_seq_gives_its_sequences():
    # log W = 0.5 - 0.2, ln 3 (above the cap 2), and no valid token (W = 1)
    logp = torch.tensor([[0.5, -0.2], [math.log(3.0), 9.0], [4.0, 4.0]])
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    weights = tis_seq_weights(logp, torch.zeros_like(logp), mask, cap=2.0)
    close(weights, [math.exp(0.3), 2.0, 1.0])
    # d tis_seq / d log pi_t = -min(W, C) A_t / n: the same weights, here with A = 1, n = 3
    leaf_logp = logp.clone().requires_grad_()
    loss, _ = tis_seq_loss(leaf_logp, torch.zeros_like(logp), torch.ones_like(logp), mask, cap=2.0)
    loss.backward()
    close(leaf_logp.grad[:, 0], (-weights * mask[:, 0] / 3).tolist())
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_seq_weights(logp, logp, mask, cap=0.0)


def test_vcpo_baseline_has_the_least_variance_of_any_constant_baseline():
    # The estimator's squared norm sum_i (w_i (R_i - b))^2 s_i (orthogonal score vectors) is
    # smallest at b*: any other b gives more.
    generator = torch.Generator().manual_seed(0)
    rewards = (torch.rand(8, generator=generator) > 0.5).double()
    weights = torch.rand(8, generator=generator, dtype=torch.float64) * 3
    norms = torch.rand(8, generator=generator, dtype=torch.float64) * 10
    advantages = vcpo_baseline_advantages(rewards, weights, norms, group_size=8)
    b_star = float(rewards[0] - advantages[0])

    def spread(b: float) -> float:
        return float(((weights * (rewards - b)) ** 2 * norms).sum())

    assert all(spread(b_star) < spread(b_star + d) for d in (-0.1, -0.01, 0.01, 0.1))
    assert spread(b_star) < spread(float(rewards.mean()))


@pytest.mark.parametrize(
    ("loss_fn", "kwargs", "message"),
    [
        (m2po_release_loss, {"budget": 0.0}, "budget must be > 0, got budget=0.0"),
        (geo_mask_loss, {"lower": 1.5}, "need 0 < lower <= 1 <= upper, got lower=1.5"),
        (geo_mask_loss, {"upper": 0.9}, r"got lower=0.99, upper=0.9"),
        (geo_mask_loss, {"clip_eps": 0.0}, "clip_eps must be > 0, got clip_eps=0.0"),
        (geo_mask_loss, {"kept_share": 1.5}, r"kept_share must be in \[0, 1\], got kept_share=1.5"),
        (mis_seq_verl_loss, {"lower": 0.0}, "need 0 < lower <= 1 <= upper, got lower=0.0"),
        (mis_seq_verl_loss, {"kept_share": -0.1}, r"kept_share must be in \[0, 1\]"),
    ],
)
def test_out_of_range_options_are_rejected(loss_fn, kwargs, message):
    batch = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match=message):
        loss_fn(*batch, **kwargs)


@pytest.mark.parametrize(
    ("loss", "override"),
    [
        ("m2po_release", "trainer.m2po_release_budget=0"),
        ("geo_mask", "trainer.geo_mask_low=1.5"),
        ("geo_mask", "trainer.geo_mask_high=0.9"),
    ],
)
def test_config_rejects_out_of_range_options_of_the_new_losses(loss, override):
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{field} = ") as refused:
        load_config(None, [f"trainer.loss={loss}", override])
    assert "an option of loss" not in str(refused.value)  # refused for its range, not presence
