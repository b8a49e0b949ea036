"""Trainer executor: supervised warm start, then off-policy-corrected policy updates.

The trainer owns the policy version. Each ``train_step`` first enforces the staleness bound — a
group with any token sampled more than ``max_staleness`` versions ago is dropped and counted, never
trained on — then computes group advantages and the configured loss against the per-token
behaviour log-probs recorded by the generator, and bumps the version. The fresh groups are cut
in order into ``trainer.minibatches`` blocks of whole groups, each one optimizer step with its own
token mean; one version per train step whatever their number. A nan or inf loss or gradient norm
skips that minibatch's optimizer step (see ``trainer_core.GradientStep``) and is counted in
``skipped_nonfinite``; so does a loss that masked, rejected or clipped away every token with an
advantage, counted in ``skipped_masked`` (``PolicyCore.holds_no_signal``: Adam's momentum alone
would still move the weights). A step none of whose minibatches stepped reports ``stepped`` false
and the version stays. With ``trainer.proximal=current`` a no-grad pass over every minibatch
before the first steps gives the proximal policy's log-probs, and the loss is
``decoupled.decoupled_loss`` around it.

As one rank of a group (``trainer.ranks``, see ``trainer_core``), every rank is given the whole
batch and decides alike which groups are stale or carry no signal. Its books (``StepResult``
counts, lags) are its block of the received groups, so that ``StepResult.merge`` of the ranks
gives one trainer's books; its work is its block of the trainable groups, so that it stays
balanced wherever the stale groups fall. Each rank's loss is its tokens' sum over the token count
of the whole batch and gradients sum over ranks, so the group takes the step one trainer takes
on the whole batch; a rank with no trainable group backpropagates a masked-out filler group. The
warm start splits its rows alike.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from relayrl import faults, parallel
from relayrl.algorithms.advantages import ADVANTAGES, zero_signal_samples
from relayrl.algorithms.decoupled import decoupled_loss
from relayrl.algorithms.kl import KL_ESTIMATORS, sequence_kl
from relayrl.algorithms.losses import (
    BATCH_STATISTICS,
    tis_seq_weights,
    vcpo_baseline_advantages,
)
from relayrl.config import Config
from relayrl.envs import build_task
from relayrl.executors.generator import complete, probe_problems
from relayrl.executors.trainer_core import GradientStep, PolicyCore
from relayrl.models.lm import autocast, build_policy, load_codec, token_logprobs
from relayrl.types import RolloutBatch, StepResult


class Trainer(PolicyCore):
    """Policy update of a causal LM; a Ray actor in a run, a plain object in tests."""

    def __init__(self, cfg: Config, rank: int = 0, world: int = 1):
        torch.set_num_threads(cfg.ray.threads_per_executor)
        self.tokenizer, self.codec = load_codec(cfg)
        model = build_policy(cfg.model, self.tokenizer, cfg.run.seed).train()
        if cfg.trainer.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        super().__init__(cfg, model, rank=rank, world=world)
        # None: gae (the critic's) or vcpo_baseline (from the log-probs), see _advantages
        self.advantage_fn = ADVANTAGES.get(cfg.trainer.advantage)
        self._warm: tuple | None = None

    def warm_start(self, steps: int) -> dict[str, float]:
        """``steps`` supervised steps on a fixed set of worked examples (prompt masked out).

        The example set, its sampler and the optimizer persist across calls, so the controller
        can run the warm start in slices and check progress in between.
        """
        with self.tracer.span("warm_start", self.version):
            return self._warm_start(steps)

    def _warm_start(self, steps: int) -> dict[str, float]:
        start = time.perf_counter()
        if self._warm is None:
            self._warm = self._warm_state()
        examples, rng, gradient_step = self._warm
        ws = self.cfg.warm_start
        loss = torch.zeros(())
        for _ in range(steps):
            rows = [examples[rng.randrange(len(examples))] for _ in range(ws.batch_size)]
            tokens, loss_mask, attention = _pack(rows, self.codec.pad_id)
            targets = loss_mask[:, 1:]
            own, filler = self._own(len(rows))
            weights = torch.zeros_like(targets[own]) if filler else targets[own]
            with autocast(self.model, self.cfg.trainer.precision):
                output = self.model(input_ids=tokens[own], attention_mask=attention[own])
            nll = torch.nn.functional.cross_entropy(
                output.logits[:, :-1].transpose(1, 2), tokens[own, 1:], reduction="none"
            )
            loss = (nll * weights).sum() / targets.sum()
            gradient_step.step(loss, writable=self.sync.writable)
        elapsed = time.perf_counter() - start
        metrics = parallel.global_metrics({"warm_start/loss": float(loss.detach())}, {})
        return metrics | {
            "warm_start/time_s": elapsed,
            "warm_start/skipped_nonfinite": float(gradient_step.skipped_nonfinite),
        }

    def probe(self) -> RolloutBatch:
        """Greedy completions of the warm start's probe problems by the policy as it trains (its
        own weights and precision, whatever copy the generators serve), for the warm start's
        stopping rule. Every rank of a group must call it: each forward is collective."""
        with self.tracer.span("probe", self.version):
            problems = probe_problems(self.cfg)
            self.model.eval()
            try:
                with torch.no_grad(), autocast(self.model, self.cfg.trainer.precision):
                    return complete(
                        self.model,
                        self.codec,
                        [self.codec.encode(p.prompt) for p in problems],
                        [p.answer for p in problems],
                        k=1,
                        greedy=True,
                        max_new_tokens=self.cfg.generator.max_new_tokens,
                        temperature=self.cfg.generator.temperature,
                        generator=None,
                        version=self.version,
                        batch_size=500,
                    )
            finally:
                self.model.train()

    def _own(self, count: int) -> tuple[slice, bool]:
        """This rank's block of ``count`` items, or the first item as a filler (true) when the
        block is empty: the rank must still run every forward and backward for FSDP's
        collectives."""
        own = parallel.share(count, self.rank, self.world)
        if own.start == own.stop:
            return slice(0, 1), True
        return own, False

    def _warm_state(self) -> tuple[list, random.Random, GradientStep]:
        """The warm start's worked examples, their sampler and its own optimizer (no clipping,
        the non-finite guard of every step)."""
        task = build_task(self.cfg.task)
        rng = random.Random(self.cfg.run.seed + 3)
        eos = self.tokenizer.eos_token_id
        examples = []
        for problem in task.sample(self.cfg.warm_start.examples, rng):
            prompt = self.codec.encode(problem.prompt)
            target = self.cfg.task.answer_template.format(answer=problem.answer)
            answer = self.tokenizer(target, add_special_tokens=False)["input_ids"] + [eos]
            examples.append((prompt, answer))
        gradient_step = GradientStep(
            self.model, lr=self.cfg.warm_start.lr, weight_decay=self.cfg.trainer.weight_decay
        )
        return examples, rng, gradient_step

    def train_step(self, batch: RolloutBatch) -> StepResult:
        """Drop stale groups, take one optimizer step on the rest, bump the version."""
        with self.tracer.span("train_step", self.version):
            faults.reach("train_step")
            return self._train_step(batch)

    def _train_step(self, batch: RolloutBatch) -> StepResult:
        start = time.perf_counter()
        # A generate call in which no group finished (partial rollouts) gives an empty batch.
        lag = self.version - batch.min_version  # [B], oldest token of each completion
        group_lag = lag.reshape(-1, batch.group_size).max(axis=1)
        keep = np.repeat(group_lag <= self.cfg.max_staleness, batch.group_size)
        books = _group_rows(parallel.share(len(group_lag), self.rank, self.world), batch)
        dropped = int((books & ~keep).sum())
        trained = int((books & keep).sum())
        self.dropped_stale += dropped
        self.trained += trained
        result = StepResult(
            stepped=False,
            version=self.version,
            received=int(books.sum()),
            trained=trained,
            dropped_stale=dropped,
            lags=np.bincount(lag[books & keep], minlength=self.cfg.max_staleness + 1).tolist(),
            train_s=0.0,
            trained_tokens=int(batch.completion_len[books & keep].sum()),
            dropped_tokens=int(batch.completion_len[books & ~keep].sum()),
            metrics=_drop_lengths(batch.completion_len, keep),
        )
        skipped = self.skipped_nonfinite
        if keep.any():
            metrics, result.stepped = self._update(batch.select(keep), lag[keep])
            result.metrics |= metrics
        result.skipped_nonfinite = self.skipped_nonfinite - skipped
        result.version = self.version
        result.train_s = time.perf_counter() - start
        return result

    def _update(self, batch: RolloutBatch, lag: np.ndarray) -> tuple[dict[str, float], bool]:
        """``trainer.minibatches`` optimizer steps on fresh groups, each on its block of them,
        but none on a block that carries no learning signal, whose loss kept none of its tokens
        with a signal (``holds_no_signal``) or whose loss or gradient is not finite; bumps the
        version once if any stepped. Returns the metrics (the ``loss/*`` ones means over the
        minibatches that stepped) and whether any stepped."""
        tc = self.cfg.trainer
        # The task's own reward, for the metrics: the rule reward, before later stages changed it.
        task_rewards = batch.rule_rewards if batch.rule_rewards is not None else batch.rewards
        kl_in_loss = tc.kl_coef > 0 and tc.kl_in == "loss"
        if tc.kl_coef > 0 and tc.kl_in == "reward":  # shaped before advantages and signal checks
            penalty = tc.kl_coef * sequence_kl(
                torch.from_numpy(batch.logprobs),
                torch.from_numpy(
                    _from_stage(batch, "ref_logprobs", "trainer.kl_coef > 0", "reference")
                ),
                torch.from_numpy(batch.completion_mask),
                tc.kl_estimator,
            )
            batch = replace(batch, rewards=(batch.rewards - penalty.numpy()).astype(np.float32))
        rewards = torch.from_numpy(batch.rewards)
        zero_signal = zero_signal_samples(rewards, batch.group_size)
        metrics = {
            "rollout/reward_mean": float(task_rewards.mean()),
            "rollout/trained_reward_mean": float(batch.rewards.mean()),
            "rollout/accuracy": float(((task_rewards > 0) & batch.finished).mean()),
            "rollout/finished": float(batch.finished.mean()),
            "rollout/completion_len": float(batch.completion_len.mean()),
            "rollout/zero_signal_groups": float(zero_signal.float().mean()),
            "rollout/score_errors": float(batch.score_errors),
            "staleness/mean": float(lag.mean()),
            "staleness/max": float(lag.max()),
        } | batch.stage_metrics  # what the scoring stages measured of this batch
        if tc.kl_coef > 0 and tc.kl_in == "reward":
            metrics["rollout/kl_penalty"] = float(penalty.mean())
        # Zero-advantage groups carry no policy gradient, but a batch statistic and the KL term
        # count their tokens.
        # Under GAE a group of equal rewards still has advantages (the values differ).
        per_token = tc.advantage == "gae"
        keeps_all = tc.loss in BATCH_STATISTICS or kl_in_loss or per_token
        skip = self.cfg.experiment.skip_zero_signal and not keeps_all
        groups = len(batch) // batch.group_size
        parts = []
        for i in range(tc.minibatches):  # every rank takes the same blocks, so steps alike
            rows = _group_rows(parallel.share(groups, i, tc.minibatches), batch)
            if rows.any():  # not when there are fewer fresh groups than minibatches
                parts += self._minibatch(batch.select(rows), zero_signal.numpy()[rows] & skip)
        # proximal=current: the policy as the step began, before the first minibatch moves it
        current = tc.proximal == "current"
        proximal = [self._logprobs(part.batch, grad=False) if current else None for part in parts]
        totals: dict[str, float] = {}
        drifts: dict[str, float] = {}
        updates, masked = 0, self.skipped_masked
        for part, prox in zip(parts, proximal, strict=True):
            drift, step = self._minibatch_step(part, prox)
            for key, value in drift.items():
                drifts[key] = drifts.get(key, 0.0) + value / len(parts)
            if step is None:
                continue
            for key, value in step.items():
                totals[key] = totals.get(key, 0.0) + value
            updates += 1
        metrics |= drifts  # stepped or not: a step that masked every token drifted the most
        if self.skipped_masked > masked:  # logged on the steps that skipped one, like a warning
            metrics["loss/skipped_masked"] = float(self.skipped_masked - masked)
        if not updates:
            return metrics, False
        self.bump_version()
        metrics |= {key: value / updates for key, value in totals.items()}
        return metrics | {"version": float(self.version)}, True

    def _minibatch(self, batch: RolloutBatch, left_out: np.ndarray) -> list[_Minibatch]:
        """A minibatch of whole groups (every rank's) without the rows ``left_out`` (zero-signal
        groups), as this rank trains it; none when nothing is left."""
        all_tokens = int(batch.completion_len.sum())
        batch = batch.select(~left_out)
        if len(batch) == 0:
            return []
        trainable_tokens = int(batch.completion_len.sum())
        own, filler = self._own(len(batch) // batch.group_size)
        batch = batch.select(_group_rows(own, batch))
        return [_Minibatch(batch, all_tokens, trainable_tokens, filler)]

    def _logprobs(self, batch: RolloutBatch, grad: bool = True) -> torch.Tensor:
        """[B, L-1] the policy's log-probs of ``batch``'s tokens (see ``token_logprobs``)."""
        with torch.set_grad_enabled(grad), autocast(self.model, self.cfg.trainer.precision):
            return token_logprobs(
                self.model,
                torch.from_numpy(batch.tokens),
                torch.from_numpy(batch.prompt_len + batch.completion_len),
                self.cfg.generator.temperature,
            )

    def _minibatch_step(
        self, part: _Minibatch, prox: torch.Tensor | None
    ) -> tuple[dict[str, float], dict[str, float] | None]:
        """One optimizer step on a minibatch, with ``prox`` the proximal policy's log-probs of
        its tokens under ``trainer.proximal=current``; the policy's drift from mu before the step
        (the ``staleness/*`` of ``PolicyCore.drift_metrics``) and the step's ``loss/*`` metrics,
        None when it took no step."""
        tc = self.cfg.trainer
        kl_in_loss = tc.kl_coef > 0 and tc.kl_in == "loss"
        batch, all_tokens, trainable_tokens, filler = part
        logp = self._logprobs(batch)
        mask = torch.from_numpy(batch.completion_mask[:, 1:])
        if filler:  # an all-false mask: a zero loss, still connected to every parameter
            mask = torch.zeros_like(mask)
        mu = torch.from_numpy(batch.logprobs[:, 1:])
        token_adv = self._advantages(batch, logp, mu, mask)
        if prox is None:
            options = self.loss_options(logp, mu, mask)
            loss, loss_stats = self.loss_fn(logp, mu, token_adv, mask, **options)
        else:  # the trust region around prox, the staleness of mu in a weight (see decoupled)
            options = self.loss_options(logp, prox, mask) | {"cap": tc.proximal_weight_cap}
            loss, loss_stats = decoupled_loss(
                self.loss_fn, logp, mu, prox, token_adv, mask, **options
            )
        # The losses take a token mean over the tokens they see. The minibatch's token mean is
        # over every fresh token, of every rank and of skipped zero-advantage groups alike, so
        # neither sharding nor skipping changes the update.
        own_tokens = 0 if filler else int(batch.completion_len.sum())
        loss = loss * (own_tokens / all_tokens)
        terms = {}
        if tc.kl_coef > 0:  # the reference's log-probs: a KL term
            ref = torch.from_numpy(
                _from_stage(batch, "ref_logprobs", "trainer.kl_coef > 0", "reference")[:, 1:]
            )
            kl_sum = torch.where(mask.bool(), KL_ESTIMATORS[tc.kl_estimator](logp, ref), 0.0).sum()
            if kl_in_loss:
                loss = loss + tc.kl_coef * kl_sum / all_tokens
            terms["kl_ref"] = float(kl_sum.detach()) / trainable_tokens
        health = self.drift_metrics(logp, mu, mask)
        # The drift is logged whether or not the minibatch steps, its loss/* metrics only if it
        # does, as every loss/* metric.
        drift = {k: v for k, v in health.items() if k.startswith("staleness/")}
        if self.holds_no_signal(loss, logp, token_adv, mask):
            self.skipped_masked += 1
            return drift, None
        lr_scale = self.ess_lr_scale(logp, mu, mask)
        grad_norm, stepped = self.apply_gradients(loss, lr_scale)
        if not stepped:
            return drift, None
        lr = self.scheduler.get_last_lr()[0] * lr_scale  # the rate this step used
        metrics = self._loss_metrics(
            {"value": float(loss.detach())} | terms,
            loss_stats,
            own_tokens / trainable_tokens,
            grad_norm,
            (logp.detach() - mu)[mask.bool()],
        )
        if tc.ess_lr:
            metrics["loss/ess_lr_scale"] = lr_scale
        return drift, metrics | {"loss/lr": lr} | {k: health[k] for k in health.keys() - drift}

    def _advantages(
        self, batch: RolloutBatch, logp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """[B, L-1] each token's advantage: the critic's (gae), or its completion's group
        advantage. ``vcpo_baseline`` weighs each completion by the weight ``tis_seq`` gives it,
        w = min(prod pi / mu, seq_is_cap), from this minibatch's log-probs, and by its length in
        tokens, OPO's proxy for the squared score norm (the exact norm would take a backward pass
        per completion). A group is whole on each rank (minibatches and ranks split a batch by
        groups), so the group's baseline needs no gather."""
        tc = self.cfg.trainer
        if tc.advantage == "gae":
            return torch.from_numpy(
                _from_stage(batch, "token_advantages", "trainer.advantage=gae", "critic")[:, 1:]
            )
        rewards = torch.from_numpy(batch.rewards)
        if tc.advantage == "vcpo_baseline":
            weights = tis_seq_weights(logp.detach(), mu, mask, tc.seq_is_cap)
            lengths = mask.sum(dim=1)
            advantages = vcpo_baseline_advantages(rewards, weights, lengths, batch.group_size)
        else:
            advantages = self.advantage_fn(rewards, batch.group_size)
        return advantages[:, None].expand_as(logp)

    def save_pretrained(self, path: str) -> str:
        """Save a Hugging Face checkpoint (safetensors) with its tokenizer. In a group every rank
        calls this (the weights are gathered) and rank 0 writes."""
        state = self._full_model_state()
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(path)
        return str(Path(path))


class _Minibatch(NamedTuple):
    """This rank's block of a minibatch, the token counts of the whole minibatch (every
    rank's; ``all_tokens`` with its zero-signal groups, ``trainable_tokens`` without) and
    whether the block is a filler (see ``Trainer._own``)."""

    batch: RolloutBatch
    all_tokens: int
    trainable_tokens: int
    filler: bool


def _from_stage(batch: RolloutBatch, name: str, setting: str, stage: str) -> np.ndarray:
    """The array a scoring stage put in ``batch.<name>``; a batch that did not pass that stage,
    though ``setting`` needs it, is refused."""
    value = getattr(batch, name)
    if value is None:
        raise ValueError(
            f"{setting} but the batch has no {name}: it did not pass the {stage} stage"
        )
    return value


def _drop_lengths(lengths: np.ndarray, keep: np.ndarray) -> dict[str, float]:
    """Mean completion length of the dropped and of the kept samples of the whole batch, on a
    step that dropped some (none otherwise: there is nothing to compare, and a 0 would drag
    averages over steps down). Stale samples are the long ones when completions span several
    generate calls (partial rollouts), so dropping them biases training towards short ones."""
    if keep.all():
        return {}
    metrics = {"staleness/dropped_len_mean": float(lengths[~keep].mean())}
    if keep.any():
        metrics["staleness/trained_len_mean"] = float(lengths[keep].mean())
    return metrics


def _group_rows(groups: slice, batch: RolloutBatch) -> np.ndarray:
    """[B] bool, true on the rows of a block of whole groups of ``batch``."""
    rows = np.zeros(len(batch), dtype=bool)
    rows[groups.start * batch.group_size : groups.stop * batch.group_size] = True
    return rows


def _pack(rows: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-pad (prompt, target) pairs: tokens, a mask on target positions, attention mask."""
    width = max(len(p) + len(t) for p, t in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    target = torch.zeros((len(rows), width))
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        seq = prompt + answer
        tokens[i, : len(seq)] = torch.tensor(seq)
        target[i, len(prompt) : len(seq)] = 1.0
        attention[i, : len(seq)] = 1
    return tokens, target, attention
