"""VLA trainer executor: values and GAE from the current critic, global normalisation, GIPO.

Each ``train_step`` takes a super-batch of trajectory segments (from the replay buffer, or from the
lockstep loop in sync mode) and

1. drops, and counts, every segment whose oldest action lags the trainer by more than
   ``max_staleness`` versions;
2. cuts the rest into micro-batches of about ``trainer.minibatch_steps`` env steps; for each it
   pads the segments, recomputes the value of every observation with the current critic (the
   behaviour values the workers recorded are stale; ``trainer.value_recompute=off`` uses them
   anyway) and computes GAE, bootstrapping from the value of a segment's last observation unless
   the segment ended with ``terminated`` (or, with ``trainer.timeout_terminal``, at the env's
   step limit);
3. normalises the advantages over the whole super-batch (``global_normalize``), as AcceRL does,
   or with the running statistics of the earlier steps (``trainer.adv_norm=lagged_welford``);
4. takes ``trainer.epochs`` passes of minibatches of env steps (in random order, or in order with
   ``trainer.minibatch_order=sequential``) with
   ``loss = LOSSES[trainer.loss] over action tokens + value_coef * (V - G)^2 - entropy_coef * H``,
   every action token of a step carrying the step's advantage. The loss's old policy is the
   behaviour policy mu, or with ``trainer.proximal=current`` the trainer's policy as the step
   began (log-probs from the value pass of 2): the trust region is then the same whatever the
   lag, and each token's advantage carries the stop-gradient behaviour weight
   ``min(pi_old / mu, trainer.proximal_weight_cap)`` (the decoupled objective of Hilton et al.
   2021, "Batch size-invariance for policy optimization");
5. bumps the policy version once, if at least one minibatch stepped.

``trainer.value_recompute=fused`` (AcceRL) folds 2-4 into one sequential pass: each micro-batch's
training forward gives its values, its GAE (from those values, detached) and its loss, and one
optimizer step follows; its advantages are standardised with the lagged statistics.

A minibatch whose loss (on any rank) or global gradient norm is nan or inf takes no optimizer step
(see ``trainer_core.GradientStep``) and the pass goes on to the next one: the others still hold
signal, and skipping the whole step would throw it away for one bad sample. ``StepResult``'s
``skipped_nonfinite`` counts the skipped minibatches; the step counts as ``stepped`` and bumps the
version when at least one minibatch stepped, and its ``loss/*`` metrics are means over those.

As one rank of a group (``trainer.ranks``, see ``trainer_core``), every rank is given the whole
super-batch and drops the same stale segments. Its books (``StepResult`` counts, lags) are its
block of the received segments, so that ``StepResult.merge`` of the ranks gives one trainer's
books. Its work is its block of the micro-batches of fresh segments: it computes their values
and GAE, the advantages are normalised over every rank's steps (one all-reduce), and every rank
draws the same permutation of the super-batch's env steps and trains on the ones it holds, its
loss terms scaled by its fraction of each minibatch, so that gradients summed over ranks are the
gradient of the whole minibatch. A rank holding no step of a minibatch backpropagates a filler
step with zero weight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from relayrl import faults, parallel
from relayrl.algorithms import decoupled
from relayrl.algorithms.advantages import gae
from relayrl.algorithms.normalization import Welford, global_normalize
from relayrl.config import Config
from relayrl.executors.trainer_core import PolicyCore
from relayrl.models.vla import VLAConfig, VLAPolicy, load_vla_weights, save_vla_checkpoint
from relayrl.types import Segment, StepResult, TrainerStats


@dataclass
class PaddedSegments:
    """B segments right-padded to the longest, T steps."""

    images: Tensor  # uint8 [B, T + 1, V, H, W, 3], zeros past each segment's last observation
    steps: Tensor  # int64 [B, T + 1] episode step of each observation
    actions: Tensor  # int64 [B, T, D]
    logprobs: Tensor  # float32 [B, T, D] behaviour log-probs mu
    rewards: Tensor  # float32 [B, T]
    versions: Tensor  # int64 [B, T]
    mask: Tensor  # bool [B, T], true on valid steps (a prefix of each row)
    terminated: Tensor  # bool [B]
    instructions: list[str]  # [B]

    @property
    def observed(self) -> Tensor:
        """bool [B, T + 1], true on valid observations: each step's and the one after the last."""
        return torch.cat([torch.ones_like(self.mask[:, :1]), self.mask], dim=1)


def pad_segments(segments: list[Segment], timeout_terminal: bool = False) -> PaddedSegments:
    """Stack segments into right-padded tensors (see ``PaddedSegments``); with
    ``timeout_terminal`` a segment whose episode was cut at the step limit counts as terminated
    (``trainer.timeout_terminal``)."""
    if not segments:
        raise ValueError("segments must hold at least one Segment, got an empty list")
    batch, width = len(segments), max(len(s) for s in segments)
    first = segments[0]
    images = np.zeros((batch, width + 1, *first.images.shape[1:]), dtype=np.uint8)
    steps = np.zeros((batch, width + 1), dtype=np.int64)
    actions = np.zeros((batch, width, first.actions.shape[1]), dtype=np.int64)
    logprobs = np.zeros((batch, width, first.actions.shape[1]), dtype=np.float32)
    rewards = np.zeros((batch, width), dtype=np.float32)
    versions = np.zeros((batch, width), dtype=np.int64)
    mask = np.zeros((batch, width), dtype=bool)
    for i, s in enumerate(segments):
        n = len(s)
        images[i, : n + 1], steps[i, : n + 1] = s.images, s.steps
        actions[i, :n], logprobs[i, :n], rewards[i, :n] = s.actions, s.logprobs, s.rewards
        versions[i, :n], mask[i, :n] = s.versions, True
    return PaddedSegments(
        *(torch.from_numpy(a) for a in (images, steps, actions, logprobs, rewards, versions, mask)),
        terminated=torch.tensor(
            [s.terminated or (timeout_terminal and s.episode_done) for s in segments]
        ),
        instructions=[s.instruction for s in segments],
    )


@torch.no_grad()
def critic_values(policy: VLAPolicy, batch: PaddedSegments) -> tuple[Tensor, Tensor]:
    """One no-grad pass of the current policy over every valid observation: the critic's values
    float32 [B, T + 1] (0 on padding) and the log-probs float32 [B, T, D] of the actions taken
    (0 on padding; the old policy's of ``trainer.proximal=current``)."""
    observed = batch.observed
    rows = observed.nonzero()[:, 0]
    ids = policy.tokenize([batch.instructions[i] for i in rows.tolist()])
    logits, values = policy(batch.images[observed], ids, batch.steps[observed])
    out = torch.zeros(observed.shape, dtype=torch.float32)
    out[observed] = values.float()
    logp_all = torch.zeros((*observed.shape, *logits.shape[1:]), dtype=torch.float32)
    logp_all[observed] = logits.float().log_softmax(-1)
    taken = logp_all[:, :-1].gather(-1, batch.actions.unsqueeze(-1)).squeeze(-1)
    return out, taken * batch.mask.unsqueeze(-1)


@torch.no_grad()
def behaviour_values(policy: VLAPolicy, batch: PaddedSegments, segments: list[Segment]) -> Tensor:
    """Values float32 [B, T + 1] without recomputing them: the behaviour values the workers
    recorded for every step, and the current critic's value of each row's last observation only
    (the bootstrap; a worker never valued it). 0 on padding."""
    out = torch.zeros(batch.observed.shape, dtype=torch.float32)
    for i, segment in enumerate(segments):
        out[i, : len(segment)] = torch.from_numpy(segment.values)
    lengths = batch.mask.sum(dim=1)
    rows = torch.arange(len(segments))
    ids = policy.tokenize(batch.instructions)
    _, last = policy(batch.images[rows, lengths], ids, batch.steps[rows, lengths])
    out[rows, lengths] = last.float()
    return out


def _concat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-step samples of consecutive micro-batches as one set (see ``advantages``)."""
    return {
        key: sum((p[key] for p in parts), [])
        if key == "instructions"
        else torch.cat([p[key] for p in parts])
        for key in parts[0]
    }


def micro_batches(segments: list[Segment], max_steps: int) -> list[list[Segment]]:
    """Consecutive groups of segments of at most ``max_steps`` env steps (one segment at least)."""
    groups: list[list[Segment]] = [[]]
    steps = 0
    for segment in segments:
        if groups[-1] and steps + len(segment) > max_steps:
            groups.append([])
            steps = 0
        groups[-1].append(segment)
        steps += len(segment)
    return groups


class VLATrainer(PolicyCore):
    """Actor-critic update of a ``VLAPolicy``; a Ray actor in a run, a plain object in tests."""

    name = "trainer"

    def __init__(self, cfg: Config, vla: VLAConfig, rank: int = 0, world: int = 1):
        torch.set_num_threads(cfg.ray.threads_per_executor)
        torch.manual_seed(cfg.run.seed)
        self.tc = cfg.trainer
        self.vla = vla
        self.policy = VLAPolicy(vla).train()
        if cfg.vla.path is not None:  # checked by the workload; a resume loads over it
            self.policy.load_state_dict(load_vla_weights(cfg.vla.path, vla))
        super().__init__(
            cfg,
            self.policy,
            adam_eps=1e-5,
            rank=rank,
            world=world,
            publish_lag=cfg.inference.min_lag,
        )
        self.generator = torch.Generator().manual_seed(cfg.run.seed + 5)
        self.adv_stats = Welford()  # every earlier step's raw advantages (adv_norm=lagged_welford)
        self.imagined_trained = 0  # imagined env steps (world model), booked apart from the real
        self.imagined_dropped_stale = 0

    def advantages(self, segments: list[Segment]) -> dict[str, Any]:
        """Per-step training samples of ``segments``, in segment-then-step order: images, steps,
        instructions, actions, logprobs, values (current critic), raw GAE ``advantages`` and
        ``returns``; values and GAE are computed one micro-batch at a time."""
        return _concat([self._samples(g) for g in micro_batches(segments, self.tc.minibatch_steps)])

    def _samples(self, group: list[Segment]) -> dict[str, Any]:
        """The per-step training samples of one micro-batch (see ``advantages``)."""
        batch = pad_segments(group, self.tc.timeout_terminal)
        if self.tc.value_recompute == "off":
            values, old = behaviour_values(self.policy, batch, group), batch.logprobs
        else:
            values, old = critic_values(self.policy, batch)
        adv, ret = gae(
            batch.rewards,
            values,
            batch.terminated,
            batch.mask,
            gamma=self.tc.gamma,
            lam=self.tc.lam,
        )
        mask = batch.mask
        rows = mask.nonzero()[:, 0].tolist()
        return {
            "images": batch.images[:, :-1][mask],
            "steps": batch.steps[:, :-1][mask],
            "instructions": [batch.instructions[i] for i in rows],
            "actions": batch.actions[mask],
            "logprobs": batch.logprobs[mask],
            "old_logprobs": old[mask],
            "versions": batch.versions[mask],
            "values": values[:, :-1][mask],
            "advantages": adv[mask],
            "returns": ret[mask],
        }

    def _own_samples(self, fresh: list[Segment]) -> tuple[dict[str, Any], int, int]:
        """The samples of this rank's block of the micro-batches of ``fresh``, the index of its
        first step among all of ``fresh``'s and its step count. A rank with a block shorter than
        the longest adds the samples of a filler micro-batch after its own: FSDP gathers the
        parameters in every forward, so every rank runs as many."""
        groups = micro_batches(fresh, self.tc.minibatch_steps)
        block = parallel.share(len(groups), self.rank, self.world)
        parts = [self._samples(group) for group in groups[block]]
        first = sum(len(s) for group in groups[: block.start] for s in group)
        own = sum(len(part["advantages"]) for part in parts)
        if len(parts) < -(-len(groups) // self.world):
            parts.append(self._samples(fresh[:1]))
        return _concat(parts), first, own

    def train_step(self, segments: list[Segment], *more: list[Segment]) -> StepResult:
        """Drop stale segments, update on the rest, bump the version. ``more`` are further
        parts of the super-batch (the imagined segments beside the real ones)."""
        with self.tracer.span("train_step", self.version):
            faults.reach("train_step")
            return self._train_step([s for part in (segments, *more) for s in part])

    def _train_step(self, segments: list[Segment]) -> StepResult:
        start = time.perf_counter()
        oldest_allowed = self.version - self.cfg.max_staleness
        fresh = [s for s in segments if int(s.versions.min()) >= oldest_allowed]
        books = segments[parallel.share(len(segments), self.rank, self.world)]
        kept = [s for s in books if int(s.versions.min()) >= oldest_allowed]
        # The real and the imagined env steps are kept in books of their own.
        received = sum(len(s) for s in books if not s.imagined)
        trained = sum(len(s) for s in kept if not s.imagined)
        imagined_received = sum(len(s) for s in books if s.imagined)
        imagined_trained = sum(len(s) for s in kept if s.imagined)
        self.dropped_stale += received - trained
        self.trained += trained
        self.imagined_trained += imagined_trained
        self.imagined_dropped_stale += imagined_received - imagined_trained
        kept_versions = np.concatenate([s.versions for s in kept]) if kept else np.zeros(0, int)
        skipped = self.skipped_nonfinite
        result = StepResult(
            stepped=False,
            version=self.version,
            received=received,
            trained=trained,
            dropped_stale=received - trained,
            lags=np.bincount(
                self.version - kept_versions, minlength=self.cfg.max_staleness + 1
            ).tolist(),
            train_s=0.0,
            imagined_received=imagined_received,
            imagined_trained=imagined_trained,
            imagined_dropped_stale=imagined_received - imagined_trained,
        )
        if fresh:
            lag = self.version - np.concatenate([s.versions for s in fresh])
            ended = [s for s in fresh if s.episode_done]
            metrics: dict[str, float] = {
                "rollout/reward_mean": float(np.mean(np.concatenate([s.rewards for s in fresh]))),
                "rollout/episodes_ended": float(len(ended)),
                "staleness/mean": float(lag.mean()),
                "staleness/max": float(lag.max()),
            }
            if ended:  # the progress bar and learning curve read rollout/accuracy
                metrics["rollout/accuracy"] = float(np.mean([s.success for s in ended]))
            if self.tc.value_recompute == "fused":  # values, GAE and steps in the same passes
                losses, updates = self._fused_update(fresh)
            else:
                data, first, own = self._own_samples(fresh)
                metrics |= parallel.global_metrics(
                    {"rollout/value_mean": float(data["values"][:own].sum() / len(lag))}, {}
                )
                held = torch.arange(len(data["advantages"])) < own
                advantages = self._normalize(data["advantages"], held)
                losses, updates = self._update(data, advantages, first, own, len(lag))
            result.metrics = metrics | losses
            if updates:
                self.bump_version()
                result.stepped = True
                result.metrics |= {
                    "loss/lr": self.scheduler.get_last_lr()[0],
                    "version": float(self.version),
                }
        result.skipped_nonfinite = self.skipped_nonfinite - skipped
        result.version = self.version
        result.train_s = time.perf_counter() - start
        return result

    def _update(
        self, data: dict[str, Any], advantages: Tensor, first: int, own: int, count: int
    ) -> tuple[dict[str, float], int]:
        """``epochs`` passes of shuffled minibatches of the ``count`` steps of every rank, each
        rank on its ``own`` steps from index ``first``; returns the mean of each loss metric over
        the minibatches that stepped, and their number."""
        totals: dict[str, float] = {}
        updates = 0
        for _ in range(self.tc.epochs):
            order = self.minibatch_order(count)
            for begin in range(0, count, self.tc.minibatch_steps):
                minibatch = order[begin : begin + self.tc.minibatch_steps]
                idx = minibatch[(minibatch >= first) & (minibatch < first + own)] - first
                weight = len(idx) / len(minibatch)  # its part of means over the whole minibatch
                filler = len(idx) == 0
                if filler:
                    idx = minibatch.new_zeros(1)  # a filler step: see the module docstring
                ids = self.policy.tokenize([data["instructions"][i] for i in idx.tolist()])
                logp, entropy, values = self.policy.evaluate_actions(
                    data["images"][idx], ids, data["steps"][idx], data["actions"][idx]
                )
                mu, behaviour_weight = data["logprobs"][idx], None
                if self.tc.proximal == "current":  # the trust region around the old policy
                    old = data["old_logprobs"][idx]
                    every = torch.ones_like(mu, dtype=torch.bool)
                    cap = self.tc.proximal_weight_cap
                    behaviour_weight = decoupled.behaviour_weight(old, mu, every, cap)
                    mu = old
                step = self._minibatch_step(
                    logp,
                    entropy,
                    values,
                    mu,
                    advantages[idx],
                    data["returns"][idx],
                    weight,
                    filler,
                    behaviour_weight,
                )
                if step is None:
                    continue
                for key, value in step.items():
                    totals[key] = totals.get(key, 0.0) + value
                updates += 1
        return {key: value / updates for key, value in totals.items()}, updates

    def _minibatch_step(
        self,
        logp: Tensor,
        entropy: Tensor,
        values: Tensor,
        mu: Tensor,
        advantages: Tensor,
        returns: Tensor,
        weight: float,
        filler: bool,
        behaviour_weight: Tensor | None = None,
    ) -> dict[str, float] | None:
        """One optimizer step on a minibatch of env steps (this rank's part, ``weight`` of the
        whole; a ``filler`` contributes nothing); its ``loss/*`` metrics, or None if skipped.
        ``mu`` is the loss's old policy; ``behaviour_weight`` [N, D] (``trainer.proximal=current``)
        scales each token's advantage, a constant like the advantage itself."""
        token_adv = advantages[:, None].expand_as(logp)
        if behaviour_weight is not None:
            token_adv = token_adv * behaviour_weight
        mask = torch.ones_like(logp, dtype=torch.bool)
        # A filler's dummy row adds nothing to a batch statistic (it is weighted 0 below).
        options = self.loss_options(logp, mu, mask & (not filler))
        policy_loss, stats = self.loss_fn(logp, mu, token_adv, mask, **options)
        if behaviour_weight is not None:
            stats = stats | {"behaviour_weight": float(behaviour_weight.mean())}
        value_loss = (values - returns).square().mean()
        entropy = entropy.mean()
        loss = policy_loss + self.tc.value_coef * value_loss
        loss = (loss - self.tc.entropy_coef * entropy) * weight
        grad_norm, stepped = self.apply_gradients(loss)
        if not stepped:  # every rank decides alike, so all skip the collective below
            return None
        terms = {"policy": policy_loss, "value": value_loss, "entropy": entropy}
        return self._loss_metrics(
            {k: weight * float(v.detach()) for k, v in terms.items()},
            stats,
            weight,
            grad_norm,
            (logp.detach() - mu)[mask & (not filler)],
        )

    def minibatch_order(self, count: int) -> Tensor:
        """The order of a pass over ``count`` env steps: random (``shuffled``, from the trainer's
        generator, the same on every rank) or ``sequential``."""
        if self.tc.minibatch_order == "sequential":
            return torch.arange(count)
        return torch.randperm(count, generator=self.generator)

    def _normalize(self, raw: Tensor, held: Tensor) -> Tensor:
        """Standardised advantages (``trainer.adv_norm``) of this rank's ``held`` entries of
        ``raw``: with the super-batch's statistics over every rank, or with the running ones of
        every earlier step (the first step uses its own), which then take in this step's."""
        if self.tc.adv_norm == "batch":
            return global_normalize(raw, held)
        if self.adv_stats.count == 0:
            normalized = global_normalize(raw, held)
        else:
            mean, std = float(self.adv_stats.mean), float(self.adv_stats.std)
            normalized = torch.where(held, (raw - mean) / (std + 1e-8), 0.0)
        self.adv_stats.update(parallel.gather_cat(raw[held].detach()))
        return normalized

    def fused_samples(self, group: list[Segment]) -> dict[str, Tensor]:
        """One micro-batch's training forward pass, with gradients: for each valid env step its
        action log-probs [N, D], entropies [N, D] and values [N], from ONE forward over every
        observation (the bootstrap ones too), and GAE's raw ``advantages`` and ``returns`` [N]
        from those same values, detached (``value_recompute=fused``); also ``logprobs`` (mu)."""
        batch = pad_segments(group, self.tc.timeout_terminal)
        observed = batch.observed
        rows = observed.nonzero()[:, 0]
        ids = self.policy.tokenize([batch.instructions[i] for i in rows.tolist()])
        logits, values = self.policy(batch.images[observed], ids, batch.steps[observed])
        grid = torch.zeros(observed.shape, dtype=torch.float32)
        grid[observed] = values.float().detach()
        adv, ret = gae(
            batch.rewards, grid, batch.terminated, batch.mask, gamma=self.tc.gamma, lam=self.tc.lam
        )
        index = torch.full(observed.shape, -1, dtype=torch.long)
        index[observed] = torch.arange(int(observed.sum()))
        at = index[:, :-1][batch.mask]  # each valid step's observation among the observed
        logp_all = logits[at].log_softmax(-1)
        return {
            "logp": logp_all.gather(-1, batch.actions[batch.mask].unsqueeze(-1)).squeeze(-1),
            "entropy": -(logp_all.exp() * logp_all).sum(-1),
            "values": values[at],
            "logprobs": batch.logprobs[batch.mask],
            "advantages": adv[batch.mask],
            "returns": ret[batch.mask],
        }

    def _fused_update(self, fresh: list[Segment]) -> tuple[dict[str, float], int]:
        """AcceRL's single sequential pass: each micro-batch's forward gives its values, its GAE
        and its loss at once, and one optimizer step follows. With ranks, round r steps on the
        r-th micro-batch of every rank's block together (a rank past its block adds a filler),
        each weighted by its share of the round's env steps. Advantages are standardised with the
        running statistics of the earlier steps (the first step: each round's own, over ranks),
        which take in this step's raw advantages at the end."""
        groups = micro_batches(fresh, self.tc.minibatch_steps)
        mine = groups[parallel.share(len(groups), self.rank, self.world)]
        rounds = -(-len(groups) // self.world)
        seen = self.adv_stats.count > 0
        mean, std = float(self.adv_stats.mean), float(self.adv_stats.std)
        raw, totals, updates = [], {}, 0
        for r in range(rounds):
            filler = r >= len(mine)
            out = self.fused_samples(fresh[:1] if filler else mine[r])
            steps = 0 if filler else len(out["advantages"])
            total = parallel.global_metrics({"steps": float(steps)}, {})["steps"]
            held = torch.full_like(out["advantages"], not filler, dtype=torch.bool)
            if seen:
                advantages = torch.where(held, (out["advantages"] - mean) / (std + 1e-8), 0.0)
            else:
                advantages = global_normalize(out["advantages"], held)
            if not filler:
                raw.append(out["advantages"])
            step = self._minibatch_step(
                out["logp"],
                out["entropy"],
                out["values"],
                out["logprobs"],
                advantages,
                out["returns"],
                steps / total if total else 0.0,
                filler,
            )
            if step is None:
                continue
            for key, value in step.items():
                totals[key] = totals.get(key, 0.0) + value
            updates += 1
        self.adv_stats.update(parallel.gather_cat(torch.cat(raw) if raw else torch.zeros(0)))
        return {key: value / updates for key, value in totals.items()}, updates

    def save_pretrained(self, path: str) -> str:
        """Save ``model.safetensors`` and ``vla_config.json`` (``VLAPolicy(VLAConfig(**json))``
        rebuilds the model) into the directory ``path``. In a group every rank calls this (the
        weights are gathered) and rank 0 writes."""
        out = Path(path)
        state = self._full_model_state()
        if self.rank == 0:
            save_vla_checkpoint(out, state, self.vla, self.version)
        return str(out)

    def state_dict(self) -> dict:
        """The core's snapshot plus the minibatch shuffling generator and the running advantage
        statistics."""
        return super().state_dict() | {
            "generator": self.generator.get_state(),
            "adv_stats": self.adv_stats.state_dict(),
            "imagined": (self.imagined_trained, self.imagined_dropped_stale),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved (a checkpoint from before the running statistics
        existed restores none)."""
        super().load_state_dict(state)
        self.generator.set_state(state["generator"])
        if "adv_stats" in state:
            self.adv_stats.load_state_dict(state["adv_stats"])
        self.imagined_trained, self.imagined_dropped_stale = state.get("imagined", (0, 0))

    def stats(self) -> TrainerStats:
        """The core's counters plus the imagined env steps trained and dropped stale."""
        return replace(
            super().stats(),
            imagined_trained=self.imagined_trained,
            imagined_dropped_stale=self.imagined_dropped_stale,
        )
