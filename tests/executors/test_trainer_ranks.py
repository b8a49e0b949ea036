"""Trainer groups: two FSDP2 ranks (Ray actors, gloo) take the step one trainer takes.

Every rank is given the whole batch, as the controller does with one object reference; the
one-rank reference trains in this process on the same batches. Parameters are compared through
``save_pretrained``, which gathers the full state dict onto rank 0, so each test also checks the
checkpoint. A hang in a collective fails the test at TIMEOUT_S instead of blocking the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch
from conftest import (
    ATOL,
    TIMEOUT_S,
    TINY_VLA,
    nan_on_calls,
    on_all,
    segment,
    tiny_config,
    trainer_group,
)
from safetensors.torch import load_file

from relayrl.config import Config, load_config
from relayrl.executors.trainer import Trainer
from relayrl.executors.vla_trainer import VLATrainer
from relayrl.models.lm import build_policy
from relayrl.parallel import share
from relayrl.types import RolloutBatch, StepResult
from relayrl.weight_sync import TRANSPORTS


def rollouts(versions: list[int], *, seed: int, zero_signal: int | None = None) -> RolloutBatch:
    """Groups of 3 completions of 1 to 4 tokens after a 3-token prompt, sampled at ``versions``
    (one per group), with distinct random rewards; group ``zero_signal`` rewards all alike."""
    rng = np.random.default_rng(seed)
    rows, width = 3 * len(versions), 7
    tokens = rng.integers(3, 20, (rows, width))
    completion_len = rng.integers(1, 5, rows)
    completion = (np.arange(width) >= 3) & (np.arange(width) < 3 + completion_len[:, None])
    versions_per_row = np.repeat(versions, 3)[:, None]
    rewards = rng.random(rows).astype(np.float32)
    if zero_signal is not None:
        rewards[3 * zero_signal : 3 * zero_signal + 3] = 1.0
    return RolloutBatch(
        tokens=np.where(completion | (np.arange(width) < 3), tokens, 0),
        prompt_len=np.full(rows, 3),
        completion_len=completion_len,
        logprobs=np.where(completion, rng.uniform(-3.0, -0.5, (rows, width)), 0.0).astype(
            np.float32
        ),
        versions=np.where(completion, versions_per_row, -1),
        finished=rng.random(rows) < 0.8,
        group_size=3,
        answers=["x"] * rows,
        rewards=rewards,
    )


def assert_merged_books(results: list[StepResult], one: StepResult) -> None:
    """The ranks' results merge into the one-rank result: counts exactly, metrics closely."""
    merged = StepResult.merge(results)
    books = (
        "stepped",
        "version",
        "received",
        "trained",
        "dropped_stale",
        "lags",
        "skipped_nonfinite",
    )
    assert [getattr(merged, k) for k in books] == [getattr(one, k) for k in books]
    assert merged.metrics.keys() == one.metrics.keys()
    for key, value in one.metrics.items():
        assert merged.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def assert_same_weights(two: Path, one: Path, filename: str) -> None:
    """The two checkpoints hold the same tensors to ATOL."""
    got, expected = load_file(str(two / filename)), load_file(str(one / filename))
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=ATOL, rtol=0, msg=key)


def vla_config(*overrides: str) -> Config:
    """An embodied config for ``TINY_VLA``."""
    return load_config(
        None, ["workload=embodied", "env.image_size=8", "vla.patch_size=4", *overrides]
    )


def test_blocks_are_contiguous_in_rank_order_and_differ_by_at_most_one():
    assert [share(5, rank, 2) for rank in range(2)] == [slice(0, 3), slice(3, 5)]
    assert [share(1, rank, 3) for rank in range(3)] == [slice(0, 1), slice(1, 1), slice(1, 1)]
    assert [share(7, rank, 3) for rank in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 7)]


def test_rank_arguments_are_checked():
    with pytest.raises(ValueError, match="rank must be in"):
        Trainer(tiny_config(), rank=2, world=2)
    with pytest.raises(RuntimeError, match="no group to join"):
        Trainer(tiny_config()).join_group("127.0.0.1", 1)


def test_two_llm_ranks_warm_start_and_step_as_one_trainer(ray_session, tmp_path):
    cfg = tiny_config(
        "trainer.loss=aipo",
        "trainer.grad_clip=0.05",
        "trainer.lr=0.01",
        "warm_start.batch_size=3",
        "warm_start.examples=16",
        "warm_start.probe_size=6",
    )
    one = Trainer(cfg)
    batches = [rollouts([step] * 5, seed=step, zero_signal=1) for step in range(3)]
    with trainer_group(Trainer, cfg) as ranks:
        warm = on_all(ranks, "warm_start", 2)
        expected = one.warm_start(2)
        assert warm[0]["warm_start/loss"] == pytest.approx(expected["warm_start/loss"], rel=1e-5)
        # The warm start's probe runs on every rank (its forwards are collective) and answers
        # as one trainer does.
        probes, probe = on_all(ranks, "probe"), one.probe()
        assert len(probe) == 6
        for batch in probes:
            np.testing.assert_array_equal(batch.tokens, probe.tokens)
        for batch in batches:
            ref = ray.put(batch)  # every rank is given the whole batch
            results = on_all(ranks, "train_step", ref)
            reference = one.train_step(batch)
            assert reference.stepped and reference.metrics["loss/grad_norm"] > 0.05  # clipped
            assert_merged_books(results, reference)
            assert [r.received for r in results] == [9, 6]  # 5 groups of 3: blocks of 3 and 2
        on_all(ranks, "save_pretrained", str(tmp_path / "two"))
        # Each rank publishes its own rows; the receiver assembles one trainer's weights.
        served = build_policy(cfg.model, one.tokenizer, seed=99)
        receiver = TRANSPORTS["shm"].Receiver(
            served, on_all(ranks, "open_sync", "shm", ["generator"]), "generator", timeout_s=20
        )
        receiver.receive(on_all(ranks, "publish"))
        on_all(ranks, "close_sync")
    with receiver.serving() as version:
        assert version == one.version == 3
        for key, value in one.model.state_dict().items():
            torch.testing.assert_close(served.state_dict()[key], value, atol=ATOL, rtol=0)
    one.save_pretrained(str(tmp_path / "one"))
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == files
    for name in files:
        if name != "model.safetensors":
            assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
    assert_same_weights(tmp_path / "two", tmp_path / "one", "model.safetensors")


@pytest.mark.parametrize(
    ("options", "statistic"),
    [
        (["trainer.loss=m2po"], "loss/clip_frac"),
        (["trainer.loss=ess_aipo"], "loss/ess_scale"),
        (["trainer.ess_lr=true"], "loss/ess_lr_scale"),
        # verl's [0.5, 2] and SkyRL's [0.99, 1.01] would reject every sequence of these random
        # behaviour log-probs (log W from -8 to -0.5 against the tiny model)
        (["trainer.loss=mis_seq_verl", "trainer.seq_mis_lower=0.05"], "loss/kept_share"),
        (
            ["trainer.loss=geo_mask", "trainer.geo_mask_low=0.5", "trainer.geo_mask_high=2"],
            "loss/kept_share",
        ),
        # VCPO's recipe, over two minibatches: groups 0-2 (group 1 skipped) and 3-4, one group
        # of each on each rank
        (
            ["trainer.loss=tis_seq", "trainer.seq_is_cap=8", "trainer.ess_lr=true"]
            + ["trainer.advantage=vcpo_baseline", "trainer.minibatches=2"]
            + ["generator.prompts_per_step=5"],
            "loss/ess_lr_scale",
        ),
    ],
    ids=["m2po", "ess_aipo", "ess_lr", "mis_seq_verl", "geo_mask", "vcpo"],
)
def test_losses_with_a_batch_statistic_take_it_over_every_rank(
    ray_session, tmp_path, options, statistic
):
    """M2PO's cutoff, the ESS of ess_aipo and ess_lr's scale, and the kept share of mis_seq_verl
    and geo_mask are statistics of the whole batch: each rank's own would give another step.
    Group 1 carries no signal; the losses with a batch statistic still count it (they do not
    skip it). VCPO's recipe adds its baseline, a statistic of each group, whole on its rank."""
    cfg = tiny_config(*options, "trainer.lr=0.01")
    one = Trainer(cfg)
    batches = [rollouts([step] * 5, seed=10 + step, zero_signal=1) for step in range(2)]
    with trainer_group(Trainer, cfg) as ranks:
        for batch in batches:
            results = on_all(ranks, "train_step", ray.put(batch))
            reference = one.train_step(batch)
            # the statistic is at work: tokens masked, or the step scaled down
            assert 0 < reference.metrics[statistic] < 1, reference.metrics
            assert_merged_books(results, reference)
        on_all(ranks, "save_pretrained", str(tmp_path / "two"))
    one.save_pretrained(str(tmp_path / "one"))
    assert_same_weights(tmp_path / "two", tmp_path / "one", "model.safetensors")


def micro_batch_loss(trainer: Trainer, batch: RolloutBatch, blocks: list[slice]) -> torch.Tensor:
    """``trainer``'s loss taken alone on each block of groups (a micro-batch), weighted by the
    block's share of the tokens as a rank weighs its own, summed: the loss whose step ranks
    holding those blocks take together."""
    logp = trainer._logprobs(batch)
    mu = torch.from_numpy(batch.logprobs[:, 1:])
    mask = torch.from_numpy(batch.completion_mask[:, 1:])
    advantages = trainer.advantage_fn(torch.from_numpy(batch.rewards), batch.group_size)
    advantages = advantages[:, None].expand_as(logp)
    loss = logp.new_zeros(())
    for block in blocks:
        rows = slice(block.start * batch.group_size, block.stop * batch.group_size)
        part, _ = trainer.loss_fn(
            logp[rows], mu[rows], advantages[rows], mask[rows], **trainer.loss_kwargs
        )
        loss = loss + part * (mask[rows].sum() / mask.sum())
    return loss


def near_policy(trainer: Trainer, batch: RolloutBatch, seed: int) -> RolloutBatch:
    """``batch`` with behaviour log-probs the trainer's own plus N(0, 0.3^2) noise per token:
    (log pi / mu)^2 near the released M2PO's budget of 0.04, where its clip width depends on
    which tokens it sees (far from it, every harmful token is clipped at width 0)."""
    logp = trainer._logprobs(batch, grad=False).numpy()
    noise = np.random.default_rng(seed).normal(0.0, 0.3, logp.shape)
    valid = batch.completion_mask[:, 1:]
    batch.logprobs[:, 1:] = np.where(valid, logp + noise, 0.0).astype(np.float32)
    return batch


def test_m2po_release_on_two_ranks_takes_the_step_of_their_micro_batches(ray_session, tmp_path):
    """The released M2PO's clip is set per micro-batch and never gathered: two ranks take the
    step of one process whose loss is taken on each rank's block alone, not the whole batch's."""
    cfg = tiny_config("trainer.loss=m2po_release", "trainer.lr=0.01")
    one = Trainer(cfg)
    batches = [rollouts([step] * 5, seed=40 + step) for step in range(2)]
    blocks = [share(5, rank, 2) for rank in range(2)]  # groups 0-2 on rank 0, 3-4 on rank 1
    with trainer_group(Trainer, cfg) as ranks:
        for step, batch in enumerate(batches):
            batch = near_policy(one, batch, seed=step)
            merged = StepResult.merge(on_all(ranks, "train_step", ray.put(batch)))
            assert merged.stepped
            # each rank clipped with its own width: the harmful tokens' M2 is over the budget
            assert 0 < merged.metrics["loss/clip_frac"] < 1
            loss = micro_batch_loss(one, batch, blocks)
            assert merged.metrics["loss/value"] == pytest.approx(loss.item(), abs=1e-6)
            # one call over the whole batch clips with another width: another loss and step
            whole = micro_batch_loss(one, batch, [slice(0, 5)]).item()
            assert abs(whole - loss.item()) > 1e-4
            assert one.apply_gradients(loss)[1]
            one.bump_version()
        on_all(ranks, "save_pretrained", str(tmp_path / "two"))
    one.save_pretrained(str(tmp_path / "one"))
    assert_same_weights(tmp_path / "two", tmp_path / "one", "model.safetensors")


def test_two_ranks_take_minibatches_around_the_proximal_policy_as_one_trainer(
    ray_session, tmp_path
):
    cfg = tiny_config(
        "trainer.loss=ppo_clip",
        "trainer.proximal=current",
        "trainer.minibatches=2",
        "trainer.lr=0.01",
        "generator.prompts_per_step=5",
    )
    one = Trainer(cfg)
    # 5 groups: minibatch 0 holds groups 0-2 (rank 0 two, rank 1 one), minibatch 1 groups 3-4
    batches = [rollouts([step] * 5, seed=20 + step) for step in range(2)]
    with trainer_group(Trainer, cfg) as ranks:
        for batch in batches:
            reference = one.train_step(batch)
            # the second minibatch trains away from the proximal policy: its clip can act
            assert reference.stepped and "loss/behaviour_weight" in reference.metrics
            assert_merged_books(on_all(ranks, "train_step", ray.put(batch)), reference)
        on_all(ranks, "save_pretrained", str(tmp_path / "two"))
    one.save_pretrained(str(tmp_path / "one"))
    assert_same_weights(tmp_path / "two", tmp_path / "one", "model.safetensors")


def test_a_loss_that_keeps_no_token_skips_the_step_only_when_it_does_so_on_every_rank(
    ray_session,
):
    cfg = tiny_config("trainer.loss=aipo", "trainer.lr=0.01", "trainer.weight_decay=0.1")

    def keep_nothing(trainer: Trainer) -> None:
        """This rank's loss has a zero gradient on every token from now on (its metrics stay)."""
        good_loss = trainer.loss_fn

        def zero(*args: Any, **kwargs: Any) -> Any:
            loss, stats = good_loss(*args, **kwargs)
            return loss * 0.0, stats

        trainer.loss_fn = zero

    with trainer_group(Trainer, cfg) as ranks:
        # Rank 1 alone keeps nothing: the group still has tokens to learn from and steps; a rank
        # that skipped on its own count would leave the other waiting in the gradient reduction.
        ray.get(ranks[1].__ray_call__.remote(keep_nothing), timeout=TIMEOUT_S)
        results = on_all(ranks, "train_step", ray.put(rollouts([0] * 5, seed=30)))
        assert [(r.stepped, r.version) for r in results] == [(True, 1)] * 2
        assert [s.skipped_masked for s in on_all(ranks, "stats")] == [0, 0]
        # Now every rank keeps nothing: every rank skips the step and counts it.
        ray.get(ranks[0].__ray_call__.remote(keep_nothing), timeout=TIMEOUT_S)
        results = on_all(ranks, "train_step", ray.put(rollouts([1] * 5, seed=31)))
        assert [(r.stepped, r.version) for r in results] == [(False, 1)] * 2
        assert all(r.metrics["loss/skipped_masked"] == 1.0 for r in results)
        assert [s.skipped_masked for s in on_all(ranks, "stats")] == [1, 1]


def test_a_rank_with_only_stale_groups_joins_every_collective(ray_session, tmp_path):
    cfg = tiny_config("trainer.loss=aipo", "max_staleness=1", "trainer.lr=0.01")
    one = Trainer(cfg)
    fresh = rollouts([0, 0, 0], seed=3)
    # At version 2, groups 1 and 2 lag 2 > 1: rank 1's block (group 2) is all stale, and the one
    # trainable group goes to rank 0, so rank 1 backpropagates a filler.
    stale_share = rollouts([2, 0, 0], seed=4)
    all_stale = rollouts([0, 1], seed=5)

    def round_trip(trainer: Trainer, batch: RolloutBatch) -> None:
        """A step undone by restoring this rank's state_dict: the step must leave no trace."""
        state = trainer.state_dict()
        trainer.train_step(batch)
        trainer.load_state_dict(state)

    with trainer_group(Trainer, cfg) as ranks:
        for batch in [fresh, fresh]:
            on_all(ranks, "train_step", ray.put(batch))
            one.train_step(batch)
        undone = [r.__ray_call__.remote(round_trip, stale_share) for r in ranks]
        ray.get(undone, timeout=TIMEOUT_S)
        results = on_all(ranks, "train_step", ray.put(stale_share))
        reference = one.train_step(stale_share)
        assert reference.stepped and reference.trained == 3 and reference.dropped_stale == 6
        assert [(r.received, r.trained) for r in results] == [(6, 3), (3, 0)]
        assert_merged_books(results, reference)
        results = on_all(ranks, "train_step", ray.put(all_stale))
        assert not any(r.stepped for r in results) and {r.version for r in results} == {3}
        assert_merged_books(results, one.train_step(all_stale))
        on_all(ranks, "save_pretrained", str(tmp_path / "two"))
    one.save_pretrained(str(tmp_path / "one"))
    assert_same_weights(tmp_path / "two", tmp_path / "one", "model.safetensors")


def test_two_vla_ranks_step_as_one_trainer(ray_session, tmp_path):
    cfg = vla_config(
        "trainer.loss=gipo",
        "trainer.minibatch_steps=3",
        "trainer.epochs=2",
        "trainer.lr=0.01",
        "max_staleness=0",
    )
    one = VLATrainer(cfg, TINY_VLA)
    lengths = [3, 1, 4, 2, 5]
    batches = [
        # 15 steps in 5 micro-batches (3 and 2 per rank), 5 minibatches per epoch
        [segment(n, seed=i, terminated=i % 2 == 1) for i, n in enumerate(lengths)],
        # at version 1 the last two segments are stale: rank 1's block of received segments
        [segment(n, seed=i + 5, version=0 if i >= 3 else 1) for i, n in enumerate(lengths)],
        # one fresh segment, one micro-batch: rank 1 runs a filler critic pass and filler steps
        [segment(2, seed=11, version=2), segment(3, seed=12, version=0)],
    ]
    with trainer_group(VLATrainer, cfg, TINY_VLA) as ranks:
        for batch in batches:
            results = on_all(ranks, "train_step", ray.put(batch))
            assert_merged_books(results, one.train_step(batch))
        assert [(r.received, r.trained) for r in results] == [(2, 2), (3, 0)]
        on_all(ranks, "save_pretrained", str(tmp_path / "two"))
    one.save_pretrained(str(tmp_path / "one"))
    config = json.loads((tmp_path / "two" / "vla_config.json").read_text())
    assert config == json.loads((tmp_path / "one" / "vla_config.json").read_text())
    assert_same_weights(tmp_path / "two", tmp_path / "one", "model.safetensors")


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(ray_session, tmp_path):
    cfg = tiny_config("trainer.loss=aipo", "trainer.lr=0.01", "trainer.weight_decay=0.1")
    one = Trainer(cfg)
    good = [rollouts([step] * 5, seed=step) for step in range(2)]
    # 5 groups: rank 0 holds groups 0-2, rank 1 groups 3-4. A nan behaviour log-prob in group 4
    # makes rank 1's loss and gradients nan; rank 0's share is clean.
    nan_mu = rollouts([1] * 5, seed=7)
    nan_mu.logprobs[12, 3] = np.nan

    def poison_next_loss(trainer: Trainer) -> None:
        """This rank's next loss is nan with finite gradients: only the loss tells."""
        good_loss = trainer.loss_fn

        def nan_once(*args: Any, **kwargs: Any) -> Any:
            trainer.loss_fn = good_loss
            loss, stats = good_loss(*args, **kwargs)
            return loss + float("nan"), stats

        trainer.loss_fn = nan_once

    with trainer_group(Trainer, cfg) as ranks:
        assert_merged_books(on_all(ranks, "train_step", ray.put(good[0])), one.train_step(good[0]))
        results = on_all(ranks, "train_step", ray.put(nan_mu))
        assert [(r.stepped, r.version, r.skipped_nonfinite) for r in results] == [(False, 1, 1)] * 2
        ray.get(ranks[1].__ray_call__.remote(poison_next_loss), timeout=TIMEOUT_S)
        results = on_all(ranks, "train_step", ray.put(good[1]))
        assert [(r.stepped, r.version, r.skipped_nonfinite) for r in results] == [(False, 1, 1)] * 2
        merged = StepResult.merge(results)
        assert not merged.stepped and merged.skipped_nonfinite == 1
        assert [s.skipped_nonfinite for s in on_all(ranks, "stats")] == [2, 2]
        # The group steps on as the one trainer that never saw the two bad steps.
        assert_merged_books(on_all(ranks, "train_step", ray.put(good[1])), one.train_step(good[1]))
        on_all(ranks, "save_pretrained", str(tmp_path / "two"))
    one.save_pretrained(str(tmp_path / "one"))
    assert_same_weights(tmp_path / "two", tmp_path / "one", "model.safetensors")


def test_a_non_finite_vla_minibatch_on_one_rank_is_skipped_by_every_rank(ray_session, tmp_path):
    cfg = vla_config("trainer.minibatch_steps=3", "trainer.epochs=1", "trainer.lr=0.01")
    one = VLATrainer(cfg, TINY_VLA)
    one.loss_fn = nan_on_calls(1)  # one trainer skipping the second of 4 minibatches
    poison = nan_on_calls(1)  # rank 1 alone: its loss is nan there, rank 0's is finite
    batch = [segment(n, seed=i) for i, n in enumerate([3, 1, 4, 2])]
    with trainer_group(VLATrainer, cfg, TINY_VLA) as ranks:
        ray.get(
            ranks[1].__ray_call__.remote(lambda t: setattr(t, "loss_fn", poison)), timeout=TIMEOUT_S
        )
        results = on_all(ranks, "train_step", ray.put(batch))
        reference = one.train_step(batch)
        assert reference.stepped and reference.skipped_nonfinite == 1
        assert [(r.stepped, r.skipped_nonfinite) for r in results] == [(True, 1)] * 2
        assert_merged_books(results, reference)
        on_all(ranks, "save_pretrained", str(tmp_path / "two"))
    one.save_pretrained(str(tmp_path / "one"))
    assert_same_weights(tmp_path / "two", tmp_path / "one", "model.safetensors")
