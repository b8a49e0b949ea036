"""Trainer executor: supervised warm start, then off-policy-corrected policy updates.

The trainer owns the policy version. Each ``train_step`` first enforces the staleness bound — a
group with any token sampled more than ``max_staleness`` versions ago is dropped and counted, never
trained on — then computes group advantages and the configured loss against the per-token
behaviour log-probs recorded by the generator, takes one optimizer step and bumps the version.
"""

from __future__ import annotations

import copy
import math
import random
import time
from pathlib import Path

import numpy as np
import ray
import torch

from relayrl.algorithms.advantages import ADVANTAGES, zero_signal_samples
from relayrl.algorithms.losses import LOSSES
from relayrl.config import Config
from relayrl.envs import build_task
from relayrl.models.lm import build_policy, encode_prompt, load_tokenizer
from relayrl.observability.tracing import Span, Tracer
from relayrl.types import RolloutBatch
from relayrl.weight_sync import TRANSPORTS, Ticket
from relayrl.weight_sync.base import TrainerSide


class Trainer:
    """Policy update; a Ray actor in a run, a plain object in tests."""

    name = "trainer"

    def __init__(self, cfg: Config):
        torch.set_num_threads(cfg.ray.threads_per_executor)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.model = build_policy(cfg.model, self.tokenizer, cfg.run.seed).train()
        self.optimizer = self._adamw(cfg.trainer.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.loss_fn = LOSSES[cfg.trainer.loss]
        self.loss_kwargs = {
            "aipo": {"rho": cfg.trainer.aipo_rho},
            "aipo_clamp": {"rho": cfg.trainer.aipo_rho},
            "ppo_clip": {"clip_eps": cfg.trainer.ppo_clip_eps},
            "gipo": {"sigma": cfg.trainer.gipo_sigma, "neg_ratio": cfg.trainer.gipo_neg_ratio},
        }.get(cfg.trainer.loss, {})
        self.advantage_fn = ADVANTAGES[cfg.trainer.advantage]
        self.version = 0
        self._warm: tuple | None = None
        self.tracer = Tracer(self.name)
        self.trained = 0
        self.dropped_stale = 0
        self.sync = TrainerSide(
            timeout_s=cfg.sync.timeout_s,
            bucket_bytes=cfg.sync.bucket_mb << 20,
            streams=cfg.sync.streams,
            in_place=cfg.sync.in_place,
        )

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
        examples, rng, optimizer = self._warm
        ws = self.cfg.warm_start
        loss = torch.zeros(())
        for _ in range(steps):
            rows = [examples[rng.randrange(len(examples))] for _ in range(ws.batch_size)]
            tokens, loss_mask, attention = _pack(rows, self.tokenizer.pad_token_id)
            logits = self.model(input_ids=tokens, attention_mask=attention).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), tokens[:, 1:], reduction="none"
            )
            loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.sync.writable()
            optimizer.step()
        elapsed = time.perf_counter() - start
        return {"warm_start/loss": float(loss.detach()), "warm_start/time_s": elapsed}

    def _warm_state(self) -> tuple[list, random.Random, torch.optim.Optimizer]:
        task = build_task(self.cfg.task)
        rng = random.Random(self.cfg.run.seed + 3)
        eos = self.tokenizer.eos_token_id
        examples = []
        for problem in task.sample(self.cfg.warm_start.examples, rng):
            prompt = encode_prompt(self.tokenizer, problem.prompt)
            target = self.cfg.task.answer_template.format(answer=problem.answer)
            answer = self.tokenizer(target, add_special_tokens=False)["input_ids"] + [eos]
            examples.append((prompt, answer))
        return examples, rng, self._adamw(self.cfg.warm_start.lr)

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """Drop stale groups, take one optimizer step on the rest, bump the version."""
        with self.tracer.span("train_step", self.version):
            return self._train_step(batch)

    def _train_step(self, batch: RolloutBatch) -> dict[str, float]:
        start = time.perf_counter()
        if len(batch) == 0:  # a generate call in which no group finished (partial rollouts)
            return {
                "samples/received": 0.0,
                "samples/dropped_stale": 0.0,
                "samples/trained": 0.0,
                "perf/train_s": 0.0,
                "stepped": 0.0,
            }
        lag = self.version - batch.min_version  # [B], oldest token of each completion
        group_lag = lag.reshape(-1, batch.group_size).max(axis=1)
        keep = np.repeat(group_lag <= self.cfg.max_staleness, batch.group_size)
        dropped = int((~keep).sum())
        self.dropped_stale += dropped
        batch = batch.select(keep)
        lag = lag[keep]
        metrics: dict[str, float] = {
            "samples/received": float(len(keep)),
            "samples/dropped_stale": float(dropped),
            "samples/trained": float(len(batch)),
        }
        if len(batch) == 0:
            return metrics | {"perf/train_s": time.perf_counter() - start, "stepped": 0.0}
        rewards = torch.from_numpy(batch.rewards)
        zero_signal = zero_signal_samples(rewards, batch.group_size)
        metrics |= {
            "rollout/reward_mean": float(batch.rewards.mean()),
            "rollout/accuracy": float(((batch.rewards > 0) & batch.finished).mean()),
            "rollout/finished": float(batch.finished.mean()),
            "rollout/completion_len": float(batch.completion_len.mean()),
            "rollout/zero_signal_groups": float(zero_signal.float().mean()),
            "rollout/score_errors": float(batch.score_errors),
            "staleness/mean": float(lag.mean()),
            "staleness/max": float(lag.max()),
            "lags": np.bincount(lag, minlength=self.cfg.max_staleness + 1).tolist(),
        }
        self.trained += len(batch)
        all_tokens = int(batch.completion_len.sum())
        if self.cfg.trainer.skip_zero_signal:
            batch = batch.select(~zero_signal.numpy())
            rewards = torch.from_numpy(batch.rewards)
        if len(batch) == 0:
            return metrics | {"perf/train_s": time.perf_counter() - start, "stepped": 0.0}
        advantages = self.advantage_fn(rewards, batch.group_size)
        tokens = torch.from_numpy(batch.tokens)
        lengths = torch.from_numpy(batch.prompt_len + batch.completion_len)
        attention = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).long()
        logits = self.model(input_ids=tokens, attention_mask=attention).logits[:, :-1]
        logp_all = torch.log_softmax(logits.float() / self.cfg.generator.temperature, dim=-1)
        logp = logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        mask = torch.from_numpy(batch.completion_mask[:, 1:])
        mu = torch.from_numpy(batch.logprobs[:, 1:])
        token_adv = advantages[:, None].expand_as(logp)
        loss, loss_metrics = self.loss_fn(logp, mu, token_adv, mask, **self.loss_kwargs)
        # The losses take a token mean over the tokens they see; skipped zero-advantage tokens
        # belong in its denominator, so skipping them leaves the update exactly as it would be.
        loss = loss * (int(batch.completion_len.sum()) / all_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.cfg.trainer.grad_clip
        )
        self.sync.writable()  # in place: the sends of the last publish read these tensors
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1

        elapsed = time.perf_counter() - start
        return metrics | {
            "stepped": 1.0,
            "loss/value": float(loss.detach()),
            "loss/grad_norm": float(grad_norm),
            "loss/lr": self.scheduler.get_last_lr()[0],
            **{f"loss/{k}": v for k, v in loss_metrics.items()},
            "perf/train_s": elapsed,
            "version": float(self.version),
        }

    def open_sync(self, transport: str, receivers: list[str], host: str = "127.0.0.1") -> dict:
        """Create the weight-sync publisher; returns the address receivers attach to."""
        return self.sync.open(TRANSPORTS[transport], self.model, receivers, host)

    def connect_sync(self) -> None:
        """Rendezvous with the receivers (they call their ``connect_sync`` meanwhile)."""
        self.sync.publisher.connect()

    def publish(self) -> Ticket:
        """Publish the current weights as the current version; returns the receivers' ticket."""
        with self.tracer.span("publish", self.version):
            return self.sync.publish(self.version, self.model.state_dict())

    def node(self) -> tuple[str, str]:
        """The Ray node id and IP address this executor runs on."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def sync_stats(self) -> dict:
        """Trainer-side stall of every publish, in order, and the receivers lost."""
        return self.sync.stats()

    def close_sync(self) -> None:
        """Close the weight-sync publisher before the actor is killed."""
        self.sync.close()

    def save_pretrained(self, path: str) -> str:
        """Save a Hugging Face checkpoint (safetensors) with its tokenizer."""
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        return str(Path(path))

    def stats(self) -> dict[str, float]:
        """Counters for the run summary."""
        return {
            "busy_s": self.tracer.busy_s(),
            "version": self.version,
            "trained": self.trained,
            "dropped_stale": self.dropped_stale,
        }

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits

    def state_dict(self) -> dict:
        """A snapshot (not a view) of model, optimizer, version and counters."""
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "version": self.version,
                "trained": self.trained,
                "dropped_stale": self.dropped_stale,
            }
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.sync.writable()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        self.trained = state["trained"]
        self.dropped_stale = state["dropped_stale"]

    def _lr_factor(self, update: int) -> float:
        """Multiplier of the RL learning rate after ``update`` optimizer steps."""
        tc = self.cfg.trainer
        if tc.lr_schedule == "constant":
            return 1.0
        progress = min(update / max(self.cfg.steps, 1), 1.0)
        return tc.lr_final_ratio + (1 - tc.lr_final_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )

    def _adamw(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=self.cfg.trainer.weight_decay
        )


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
