"""Trainer: the staleness bound, version bumps, and the loss wiring."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from conftest import assert_bit_identical, core_state, tiny_config

from relayrl.algorithms.advantages import ADVANTAGES
from relayrl.algorithms.losses import LOSSES
from relayrl.executors.generator import Generator
from relayrl.executors.trainer import Trainer
from relayrl.models.lm import token_logprobs
from relayrl.observability.metrics import RunTally
from relayrl.types import RolloutBatch, StepResult


def _batch(versions_per_group: list[int], group_size: int = 2) -> RolloutBatch:
    """Groups of 2 samples, prompt of 3 tokens, completion of 2 tokens, alternating rewards."""
    rows = len(versions_per_group) * group_size
    tokens = np.tile(np.array([[2, 4, 13, 5, 1]]), (rows, 1))
    tokens[:, 3] = 5 + np.arange(rows) % 3
    versions = np.full((rows, 5), -1)
    for g, version in enumerate(versions_per_group):
        versions[g * group_size : (g + 1) * group_size, 3:] = version
    return RolloutBatch(
        tokens=tokens,
        prompt_len=np.full(rows, 3),
        completion_len=np.full(rows, 2),
        logprobs=np.where(versions >= 0, -1.0, 0.0).astype(np.float32),
        versions=versions,
        finished=np.ones(rows, dtype=bool),
        group_size=group_size,
        answers=["x"] * rows,
        rewards=np.tile(np.array([1.0, 0.0], dtype=np.float32), rows // 2),
    )


def _params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_sample_older_than_max_staleness_is_never_trained_on_and_is_counted():
    trainer = Trainer(tiny_config("max_staleness=2"))
    trainer.version = 5
    before = _params(trainer)
    result = trainer.train_step(_batch([2]))  # lag 3 > 2
    assert not result.stepped and result.version == 5
    assert (result.received, result.dropped_stale, result.trained) == (2, 2, 0)
    assert trainer.version == 5 and trainer.dropped_stale == 2
    assert all(torch.equal(a, b) for a, b in zip(before, _params(trainer), strict=True))


def test_mixed_batch_trains_exactly_on_the_fresh_groups():
    mixed, fresh_only = (
        Trainer(tiny_config("max_staleness=1")),
        Trainer(tiny_config("max_staleness=1")),
    )
    mixed.version = fresh_only.version = 4
    stale_and_fresh = _batch([1, 3, 4])  # lags 3, 1, 0: the first group goes
    result = mixed.train_step(stale_and_fresh)
    fresh_only.train_step(stale_and_fresh.select(np.array([False, False, True, True, True, True])))
    assert result.dropped_stale == 2 and result.trained == 4
    assert result.lags == [2, 2]  # two samples at lag 0, two at lag 1
    assert mixed.version == result.version == 5
    assert all(
        torch.allclose(a, b) for a, b in zip(_params(mixed), _params(fresh_only), strict=True)
    )


def test_a_step_changes_parameters_and_bumps_the_version():
    trainer = Trainer(tiny_config())
    before = _params(trainer)
    result = trainer.train_step(_batch([0, 0]))
    assert result.stepped and trainer.version == result.version == 1
    assert result.metrics["version"] == 1.0 and "loss/value" in result.metrics
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(trainer), strict=True))
    trainer.open_sync("shm", ["generator"])
    ticket = trainer.publish()
    assert ticket.version == 1 and ticket.bytes >= sum(p.numel() * 4 for p in before)
    payload = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
    assert trainer.sync_stats() == {
        "stall_s": [ticket.stall_s],
        "lost": {},
        "payload_bytes": payload,
    }
    trainer.sync.publisher.close()


def test_dropping_stale_groups_reports_the_lengths_of_what_was_dropped_and_trained():
    trainer = Trainer(tiny_config("max_staleness=1"))
    trainer.version = 3
    batch = _batch([1, 3, 0])  # lags 2, 0, 3: the first and last groups are dropped
    batch.completion_len[:] = [2, 2, 1, 1, 2, 1]
    batch.versions[[2, 3, 5], 4] = -1  # those rows' second completion token is padding
    result = trainer.train_step(batch)
    assert (result.dropped_stale, result.trained) == (4, 2)
    assert (result.dropped_tokens, result.trained_tokens) == (2 + 2 + 2 + 1, 1 + 1)
    assert result.metrics["staleness/dropped_len_mean"] == 7 / 4
    assert result.metrics["staleness/trained_len_mean"] == 1.0
    assert result.metrics["staleness/max"] == 0.0

    # nothing dropped: neither is reported (a 0 would pull averages over steps down)
    result = trainer.train_step(_batch([trainer.version]))
    assert result.trained_tokens == 4 and result.dropped_tokens == 0
    assert not any("len_mean" in key for key in result.metrics)

    # everything dropped: only the dropped mean
    result = trainer.train_step(_batch([0]))
    assert result.metrics == {"staleness/dropped_len_mean": 2.0} and not result.stepped


def test_the_run_tally_reports_the_run_level_lengths_of_dropped_and_trained_samples():
    trainer = Trainer(tiny_config("max_staleness=0"))
    tally = RunTally(steps=2, progress=False)
    tally.start()
    assert tally.lengths() == {"trained_len_mean": 0.0, "dropped_len_mean": None}
    short = _batch([0])
    short.completion_len[:] = 1
    short.versions[:, 4] = -1
    tally.on_trained(trainer.train_step(short))  # 2 samples of 1 token trained; now version 1
    tally.on_trained(trainer.train_step(_batch([0, 1])))  # 2 of 2 dropped, 2 of 2 trained
    tally.close()
    assert (tally.trained, tally.dropped_stale) == (4, 2)
    # per sample, not per step: (1 + 1 + 2 + 2) / 4 and (2 + 2) / 2
    assert tally.lengths() == {"trained_len_mean": 1.5, "dropped_len_mean": 2.0}


def test_the_run_tally_reports_the_mean_pi_mu_ratio_over_optimizer_steps():
    tally = RunTally(steps=3, progress=False)
    tally.start()
    assert tally.staleness()["ratio_mean"] is None
    # the middle step took no optimizer step, so it has no ratio and does not count
    for metrics in ({"loss/ratio_mean": 1.0}, {}, {"loss/ratio_mean": 0.9}):
        result = StepResult(bool(metrics), 0, 2, 2, 0, [2], 0.0, metrics=metrics)
        tally.on_trained(result)
    tally.close()
    assert tally.staleness()["ratio_mean"] == pytest.approx(0.95)
    resumed = RunTally(steps=3, progress=False)
    resumed.load_state_dict(tally.state_dict())
    assert resumed.staleness()["ratio_mean"] == pytest.approx(0.95)


def test_an_empty_batch_is_a_step_that_takes_no_update():
    trainer = Trainer(tiny_config("max_staleness=1"))
    result = trainer.train_step(_batch([0]).select(np.array([False, False])))
    assert not result.stepped and (result.received, result.trained) == (0, 0)
    assert result.lags == [0, 0] and trainer.version == 0


def test_all_equal_rewards_give_no_gradient_signal():
    trainer = Trainer(tiny_config())
    batch = _batch([0])
    batch.rewards[:] = 1.0
    before = _params(trainer)
    result = trainer.train_step(batch)
    assert result.metrics["rollout/zero_signal_groups"] == 1.0
    assert not result.stepped and result.trained == 2 and trainer.version == 0
    # zero advantages: a zero gradient, and AdamW without weight decay leaves parameters as they are
    assert all(torch.equal(a, b) for a, b in zip(before, _params(trainer), strict=True))


def test_state_dict_round_trip():
    a = Trainer(tiny_config())
    a.train_step(_batch([0]))
    b = Trainer(tiny_config("run.seed=7"))
    b.load_state_dict(a.state_dict())
    assert b.version == 1
    a.train_step(_batch([1]))
    b.train_step(_batch([1]))
    assert all(torch.allclose(x, y) for x, y in zip(_params(a), _params(b), strict=True))


def test_cosine_schedule_decays_from_lr_to_the_final_ratio():
    trainer = Trainer(tiny_config("steps=10", "trainer.lr_final_ratio=0.1"))
    factor = trainer.gradient_step.lr_factor
    # 0.1 + 0.9 * (1 + cos(pi * progress)) / 2: 1.0 at the start, 0.55 halfway, 0.1 at the end
    assert factor(0) == 1.0
    assert abs(factor(5) - 0.55) < 1e-12
    assert abs(factor(10) - 0.1) < 1e-12
    assert abs(factor(20) - 0.1) < 1e-12
    constant = Trainer(tiny_config("trainer.lr_schedule=constant"))
    assert constant.gradient_step.lr_factor(7) == 1.0


def test_ess_lr_scale_is_the_square_root_of_the_sequence_weights_normalised_ess():
    trainer = Trainer(tiny_config("trainer.ess_lr=true"))
    # two sequences of 2 and 1 valid tokens, log W = 0.3 - 0.3 = 0 and log 2; a third has none
    logp = torch.tensor([[0.3, -0.3], [math.log(2.0), 5.0], [7.0, 7.0]])
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    # W = 1, 2: ESS = (1 + 2)^2 / (2 * (1 + 4)) = 0.9
    assert trainer.ess_lr_scale(logp, torch.zeros_like(logp), mask) == pytest.approx(0.9**0.5)
    assert Trainer(tiny_config()).ess_lr_scale(logp, torch.zeros_like(logp), mask) == 1.0


def test_ess_lr_steps_at_the_schedules_rate_times_the_scale_for_that_step_only():
    scaled = Trainer(tiny_config("trainer.ess_lr=true", "trainer.lr=0.01"))
    batch = _batch([0, 0])
    result = scaled.train_step(batch)
    scale = result.metrics["loss/ess_lr_scale"]
    assert 0.5 < scale < 1.0  # the tiny model's pi is not the batch's mu
    assert result.metrics["loss/lr"] == pytest.approx(0.01 * scale)
    plain = Trainer(tiny_config(f"trainer.lr={0.01 * scale!r}"))
    plain.train_step(batch)
    pairs = zip(_params(scaled), _params(plain), strict=True)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in pairs)
    # the scale does not leak into the schedule: the next step starts from the scheduled rate
    assert scaled.optimizer.param_groups[0]["lr"] == scaled.scheduler.get_last_lr()[0]


def test_skipping_zero_signal_groups_leaves_the_update_unchanged():
    skip = Trainer(tiny_config("experiment.skip_zero_signal=true"))
    full = Trainer(tiny_config("experiment.skip_zero_signal=false"))
    batch = _batch([0, 0])
    batch.rewards[2:] = 1.0  # the second group is all-correct: zero advantage
    skip.train_step(batch)
    full.train_step(batch)
    assert all(
        torch.allclose(a, b, atol=1e-7) for a, b in zip(_params(skip), _params(full), strict=True)
    )


def test_in_place_sync_sends_the_trained_weights_from_the_trainers_memory():
    in_place = ["sync.transport=dist", "sync.in_place=true", "sync.timeout_s=20"]
    trainer = Trainer(tiny_config(*in_place))
    generator = Generator(tiny_config(*in_place))
    address = trainer.open_sync("dist", ["generator"])
    generator.open_sync([address])
    joining = threading.Thread(target=generator.connect_sync)
    joining.start()
    trainer.connect_sync()
    joining.join(timeout=30)
    buffer = trainer.sync.publisher.buffer
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    assert all(start <= p.data_ptr() < end for p in trainer.model.parameters())
    for step in range(2):
        before = _params(trainer)
        assert trainer.train_step(_batch([step, step])).stepped
        after = _params(trainer)
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert generator.update_weights(trainer.publish()) == trainer.version == step + 1
        served = [p.detach() for p in generator.model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(after, served, strict=True))
    stats = trainer.sync_stats()
    assert len(stats["stall_s"]) == 2 and stats["lost"] == {}
    trainer.close_sync()


def _nan_loss(logp, mu_logp, advantages, mask, **kwargs):
    """A nan loss whose gradient is finite (zero): only the loss itself says it is bad."""
    return (logp * 0.0).sum() + float("nan"), {"ratio_mean": 1.0, "ratio_max": 1.0, "clip_frac": 0}


def _nan_mu(batch: RolloutBatch) -> RolloutBatch:
    """A behaviour log-prob of nan on one completion token: a nan loss and nan gradients."""
    batch.logprobs[0, 3] = np.nan
    return batch


@pytest.mark.parametrize("bad", ["nan_loss", "nan_mu"])
def test_a_non_finite_step_leaves_weights_and_optimizer_state_untouched_and_is_counted(bad):
    trainer = Trainer(tiny_config("trainer.weight_decay=0.1"))  # decay alone would move weights
    assert trainer.train_step(_batch([0, 0])).stepped  # the optimizer now holds moments
    before = core_state(trainer)
    batch = _batch([1, 1])
    if bad == "nan_loss":
        trainer.loss_fn = _nan_loss
    else:
        batch = _nan_mu(batch)

    result = trainer.train_step(batch)

    assert not result.stepped and result.skipped_nonfinite == 1
    assert result.version == trainer.version == 1 and result.trained == 4
    assert not any(k.startswith("loss/") for k in result.metrics)
    assert_bit_identical(core_state(trainer), before)
    assert trainer.stats().skipped_nonfinite == 1
    assert all(p.grad is None for p in trainer.model.parameters())

    trainer.loss_fn = LOSSES["aipo"]
    result = trainer.train_step(_batch([1, 1]))
    assert result.stepped and result.skipped_nonfinite == 0 and trainer.version == 2
    assert np.isfinite(result.metrics["loss/value"])
    after = _params(trainer)
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before["model"].values(), after, strict=False))
    assert trainer.stats().skipped_nonfinite == 1


def test_the_run_tally_logs_the_total_of_skipped_steps():
    trainer = Trainer(tiny_config())
    tally = RunTally(steps=3, progress=False)
    tally.start()
    logged = [tally.on_trained(trainer.train_step(_batch([0])))]
    trainer.loss_fn = _nan_loss
    logged.append(tally.on_trained(trainer.train_step(_batch([1]))))
    trainer.loss_fn = LOSSES["aipo"]
    logged.append(tally.on_trained(trainer.train_step(_batch([1]))))
    tally.close()
    assert [out["loss/skipped_nonfinite"] for out in logged] == [0.0, 1.0, 1.0]
    assert tally.skipped_nonfinite == 1 and tally.updates == 2 and tally.steps == 3


def test_a_bf16_trainer_keeps_fp32_weights_and_takes_nearly_the_fp32_step():
    full = Trainer(tiny_config("trainer.lr=0.01"))
    half = Trainer(tiny_config("trainer.lr=0.01", "trainer.precision=bf16"))
    before = _params(full)
    one = full.train_step(_batch([0, 0]))
    two = half.train_step(_batch([0, 0]))
    assert all(p.dtype == torch.float32 for p in half.model.parameters())
    assert one.metrics["loss/value"] != two.metrics["loss/value"]  # the matmuls ran in bf16
    deltas = [
        torch.cat([(a - b).flatten() for a, b in zip(_params(t), before, strict=True)])
        for t in (full, half)
    ]
    assert torch.nn.functional.cosine_similarity(*deltas, dim=0) > 0.9


def test_the_probe_is_what_an_fp32_generator_answers_with_the_trainers_weights():
    cfg = tiny_config("warm_start.probe_size=12", "warm_start.examples=16")
    trainer, generator = Trainer(cfg), Generator(cfg)
    trainer.warm_start(30)
    generator.open_sync([trainer.open_sync("shm", ["generator"])])
    try:
        generator.update_weights(trainer.publish())
        served, own = generator.evaluate("probe"), trainer.probe()
    finally:
        trainer.close_sync()
    assert len(own) == 12 and own.completion_len.sum() > 0
    np.testing.assert_array_equal(own.tokens, served.tokens)
    np.testing.assert_array_equal(own.finished, served.finished)
    assert own.answers == served.answers
    assert trainer.model.training  # back to training after the probe


def test_linear_warmup_ramps_the_rate_then_hands_over_to_the_schedule():
    constant = Trainer(tiny_config("trainer.lr_schedule=constant", "trainer.lr_warmup_steps=4"))
    factor = constant.gradient_step.lr_factor
    # (u + 1) / 4 during the warmup: step 0 at 1/4, step 2 (warmup / 2) at 3/4, then 1
    assert [factor(u) for u in (0, 2, 3, 4, 50)] == [0.25, 0.75, 1.0, 1.0, 1.0]
    assert constant.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4 * 0.25)
    cosine = Trainer(
        tiny_config("steps=14", "trainer.lr_final_ratio=0.1", "trainer.lr_warmup_steps=4")
    )
    factor = cosine.gradient_step.lr_factor
    # warmup as above, then 0.1 + 0.9 * (1 + cos(pi * (u - 4) / 10)) / 2 over the 10 steps left:
    # 1.0 at u = 4, 0.55 at u = 9, 0.1 at u = 14
    assert [factor(u) for u in (0, 2)] == [0.25, 0.75]
    assert factor(4) == pytest.approx(1.0, abs=1e-12)
    assert factor(9) == pytest.approx(0.55, abs=1e-12)
    assert factor(14) == pytest.approx(0.1, abs=1e-12)
    # the rate a step takes is the warmed-up one, and it advances once per version
    batch = _batch([0, 0])
    assert cosine.train_step(batch).metrics["loss/lr"] == pytest.approx(3e-4 * 0.25)
    batch.versions[batch.versions >= 0] = 1
    assert cosine.train_step(batch).metrics["loss/lr"] == pytest.approx(3e-4 * 0.5)


def test_one_minibatch_takes_the_step_a_minibatchless_trainer_took():
    # The same weights as the single step the trainer took before minibatches existed: one
    # optimizer step over every fresh group, written out here with the loss's own token mean.
    trainer = Trainer(tiny_config("trainer.minibatches=1"))
    reference = Trainer(tiny_config())
    batch = _batch([0, 0])
    trainer.train_step(batch)
    tokens = torch.from_numpy(batch.tokens)
    logp = token_logprobs(reference.model, tokens, torch.full((4,), 5), 1.0)
    mask = torch.from_numpy(batch.completion_mask[:, 1:])
    advantages = ADVANTAGES["grpo"](torch.from_numpy(batch.rewards), 2)[:, None].expand_as(logp)
    loss, _ = LOSSES["aipo"](logp, torch.from_numpy(batch.logprobs[:, 1:]), advantages, mask)
    reference.apply_gradients(loss)
    assert_bit_identical(_params(trainer), _params(reference))


def test_each_minibatch_is_an_optimizer_step_on_its_block_of_groups_and_one_version():
    constant = "trainer.lr_schedule=constant"
    two = Trainer(tiny_config(constant, "trainer.minibatches=2"))
    batch = _batch([0, 0])
    result = two.train_step(batch)
    assert result.stepped and result.version == two.version == 1
    assert two.optimizer.state[next(two.model.parameters())]["step"] == 2
    # the same as two one-minibatch steps, on the first group, then on the second
    steps = Trainer(tiny_config(constant))
    steps.train_step(batch.select(np.arange(4) < 2))
    steps.train_step(batch.select(np.arange(4) >= 2))
    assert all(
        torch.allclose(a, b, atol=1e-7) for a, b in zip(_params(two), _params(steps), strict=True)
    )


def _on_policy(trainer: Trainer, batch: RolloutBatch) -> RolloutBatch:
    """``batch`` with the trainer's own log-probs as the behaviour's: every ratio is 1."""
    with torch.no_grad():
        logp = token_logprobs(trainer.model, torch.from_numpy(batch.tokens), torch.full((4,), 5), 1)
    batch.logprobs[:, 1:] = np.where(batch.completion_mask[:, 1:], logp.numpy(), 0.0)
    return batch


def test_a_step_whose_loss_masks_every_token_takes_no_optimizer_step_and_is_counted():
    trainer = Trainer(tiny_config("trainer.loss=m2po", "trainer.weight_decay=0.1"))
    # on policy (log r)^2 = 0 <= tau everywhere: m2po keeps every token, and the step moves
    assert trainer.train_step(_on_policy(trainer, _batch([0, 0]))).stepped
    before = core_state(trainer)
    # mu = -1 where the tiny model gives about -log(vocab): every (log r)^2 is far above
    # tau = 0.04, so m2po masks every token and its gradient is zero; decay or momentum alone
    # would still have moved the weights
    result = trainer.train_step(_batch([1, 1]))
    assert not result.stepped and result.version == trainer.version == 1
    assert result.skipped_nonfinite == 0 and result.metrics["loss/skipped_masked"] == 1.0
    assert trainer.stats().skipped_masked == 1
    assert_bit_identical(core_state(trainer), before)
    # a step with a signal is not one: its metrics carry no count
    assert "loss/skipped_masked" not in trainer.train_step(_on_policy(trainer, _batch([1]))).metrics


def test_a_step_without_any_advantage_is_not_counted_as_masked():
    # zero-signal groups trained anyway (m2po keeps them for its statistic) carry no advantage:
    # nothing was masked away, and the step goes on as before
    trainer = Trainer(tiny_config("trainer.loss=m2po"))
    batch = _batch([0])
    batch.rewards[:] = 1.0
    result = trainer.train_step(batch)
    assert result.stepped and trainer.stats().skipped_masked == 0


def test_with_one_minibatch_the_current_proximal_policy_takes_aipos_step_at_the_cap():
    decoupled = Trainer(
        tiny_config(
            "trainer.loss=ppo_clip",
            "trainer.proximal=current",
            "trainer.proximal_weight_cap=0.13",
            "trainer.grad_clip=1e9",  # gradients as the losses give them, unclipped
        )
    )
    aipo = Trainer(
        tiny_config("trainer.loss=aipo", "trainer.aipo_rho=0.13", "trainer.grad_clip=1e9")
    )
    # mu = -1, above the tiny model's log-probs: pi / mu from 0.12 to 0.17 on its 8 tokens,
    # so the cap of 0.13 truncates some weights and leaves others
    batch = _batch([0, 0])
    result = decoupled.train_step(batch)
    aipo.train_step(batch)
    assert 0.1 < result.metrics["loss/behaviour_weight"] < 0.13
    assert result.metrics["loss/clip_frac"] == 0.0  # pi is prox: the clip around it is idle
    # the gradients each step left behind: equal, so the update is aipo's
    pairs = zip(decoupled.model.parameters(), aipo.model.parameters(), strict=True)
    grads = [(a.grad, b.grad) for a, b in pairs]
    assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in grads)
    assert any(a.abs().sum() > 0 for a, _ in grads)


def test_the_proximal_pass_reads_the_policy_before_the_first_minibatch_moves_it():
    trainer = Trainer(
        tiny_config("trainer.loss=ppo_clip", "trainer.proximal=current", "trainer.minibatches=2")
    )
    passes = []
    forward = trainer._logprobs

    def spy(batch, grad=True):
        steps = [s.get("step", 0) for s in trainer.optimizer.state.values()]
        passes.append((grad, int(max(steps, default=0))))
        return forward(batch, grad)

    trainer._logprobs = spy
    assert trainer.train_step(_batch([0, 0])).version == 1
    # two proximal passes (no gradient) at optimizer step 0, then each minibatch's own forward
    assert passes == [(False, 0), (False, 0), (True, 0), (True, 1)]


def test_the_drift_metrics_of_a_hand_made_batch():
    trainer = Trainer(tiny_config())
    # two sequences: log pi / mu = 0.5, -1 (and padding holding nan), and 0
    logp = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 9.0, 9.0]])
    mu = torch.tensor([[-1.5, -1.0, math.nan], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    drift = trainer.drift_metrics(logp, mu, mask)
    # k3 = r - 1 - log r: e^0.5 - 1.5 and e^-1 - 1 + 1 and 0, over 3 tokens
    kl = (math.exp(0.5) - 1.5 + math.exp(-1)) / 3
    assert drift["staleness/kl_mu_pi"] == pytest.approx(kl, abs=1e-6)
    # sequence weights W = e^(0.5 - 1) and e^0: ESS = (sum W)^2 / (2 sum W^2)
    w = [math.exp(-0.5), 1.0]
    assert drift["staleness/seq_ess"] == pytest.approx(sum(w) ** 2 / (2 * (w[0] ** 2 + 1)))
    # -log pi over the 3 sampled tokens: (1 + 2 + 0.5) / 3
    assert drift["loss/entropy_sampled"] == pytest.approx(3.5 / 3)


def test_every_step_logs_the_drift_and_the_clipped_share():
    trainer = Trainer(tiny_config("trainer.loss=ppo_clip"))
    batch = _batch([0, 0])
    with torch.no_grad():
        logp = token_logprobs(trainer.model, torch.from_numpy(batch.tokens), torch.full((4,), 5), 1)
    metrics = trainer.train_step(batch).metrics
    valid = torch.from_numpy(batch.completion_mask[:, 1:])
    mu = torch.from_numpy(batch.logprobs[:, 1:])
    assert metrics["staleness/kl_mu_pi"] == pytest.approx(
        trainer.drift_metrics(logp, mu, valid)["staleness/kl_mu_pi"]
    )
    assert metrics["staleness/kl_mu_pi"] > 0.5  # pi / mu from 0.12 to 0.17: far apart
    assert 0 < metrics["staleness/seq_ess"] <= 1
    assert metrics["loss/entropy_sampled"] == pytest.approx(float(-logp[valid].mean()))
    # every ratio is below 1 - eps = 0.8: the clip holds the tokens whose advantage is negative,
    # half of them (rewards 1, 0 in each group)
    assert metrics["loss/clip_frac"] == 0.5


VCPO = ("trainer.advantage=vcpo_baseline", "trainer.loss=tis_seq", "trainer.seq_is_cap=8")


def _vcpo_batch(trainer: Trainer) -> RolloutBatch:
    """Two groups of 3 whose log sequence weights log W = sum(log pi - log mu) against the
    trainer's own policy are set by hand: ln 2, 0, ln 8 + 1 and 0, 0, 0; completion lengths
    2, 1, 2 and 2, 2, 1; rewards 1, 0, 0 and 0, 1, 1."""
    batch = _batch([0, 0], group_size=3)
    batch.versions[[1, 5], 4] = -1  # a one-token completion in each group
    batch.completion_len[:] = [2, 1, 2, 2, 2, 1]
    batch.rewards[:] = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    batch = _on_policy(trainer, batch)
    log_w = [math.log(2.0), 0.0, math.log(8.0) + 1.0, 0.0, 0.0, 0.0]
    valid = batch.completion_mask
    batch.logprobs[:] = np.where(valid, batch.logprobs - np.array(log_w)[:, None] / 2, 0.0)
    batch.logprobs[[1, 5], 3] -= np.array(log_w)[[1, 5]] / 2  # the one-token rows: all on it
    return batch


def test_the_vcpo_baseline_gives_the_loss_the_off_policy_optimal_advantages():
    trainer = Trainer(tiny_config(*VCPO, "experiment.skip_zero_signal=false"))
    seen = []
    loss_fn = trainer.loss_fn

    def spy(logp, mu_logp, advantages, mask, **options):
        seen.append((advantages.clone(), options))
        return loss_fn(logp, mu_logp, advantages, mask, **options)

    trainer.loss_fn = spy
    batch = _vcpo_batch(trainer)
    assert trainer.train_step(batch).stepped
    ((advantages, options),) = seen
    assert options == {"cap": 8.0}
    # group 0: w = 2, 1, min(8e, 8) = 8; s = 2, 1, 2; w^2 s = 8, 1, 128: b = 8 / 137
    # group 1: w = 1 on policy; s = 2, 2, 1: b = (2 + 1) / 5 = 3 / 5 (the plain mean is 2/3)
    expected = [129 / 137, -8 / 137, -8 / 137, -3 / 5, 2 / 5, 2 / 5]
    torch.testing.assert_close(advantages[:, 2], torch.tensor(expected), atol=1e-5, rtol=0)
    # every valid token of a completion carries its advantage
    valid = torch.from_numpy(batch.completion_mask[:, 1:])
    assert torch.equal(advantages[valid], advantages[:, 2:3].expand_as(valid)[valid])
