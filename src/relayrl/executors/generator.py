"""Generator executor: samples groups of completions with partial rollouts.

Each ``generate`` call starts ``prompts_per_step`` new prompts (``group_size`` completions each),
resumes the completions left unfinished by earlier calls, and generates at most
``max_new_tokens_per_step`` tokens for all of them. Every token records the policy version that
sampled it; weights change only between calls, so a completion resumed under newer weights carries
the versions of both. Only whole groups are returned (GRPO needs every sample of a prompt).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from relayrl.config import Config
from relayrl.engines.native import sample_chunk
from relayrl.envs import build_task
from relayrl.envs.arithmetic import Problem
from relayrl.models.lm import build_policy, load_codec
from relayrl.observability.tracing import Span, Tracer
from relayrl.types import GeneratorStats, RolloutBatch, RolloutMeta
from relayrl.weight_sync import TRANSPORTS, Ticket
from relayrl.weight_sync.buckets import precision_dtype
from relayrl.weight_sync.int8 import to_int8

REPLICA_SEED_STRIDE = 7919  # seed offset between generator replicas


@dataclass
class _Sample:
    group: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass
class _Group:
    answer: str
    samples: list[_Sample] = field(default_factory=list)


class Generator:
    """Inference copy of the policy; a Ray actor in a run, a plain object in tests."""

    name = "generator"

    def __init__(self, cfg: Config, replica: int = 0):
        torch.set_num_threads(cfg.ray.threads_per_executor)
        self.cfg = cfg.generator
        self.greedy = cfg.experiment.generator_greedy
        self.tokenizer, self.codec = load_codec(cfg)
        self.model = build_policy(cfg.model, self.tokenizer, cfg.run.seed).eval()
        if self.cfg.precision == "int8":
            to_int8(self.model)
        self.task = build_task(cfg.task)
        self.probe = probe_problems(cfg)
        # Replicas draw different prompts and samples; replica 0 keeps the single-replica seeds.
        seed = cfg.run.seed + REPLICA_SEED_STRIDE * replica
        self.rng = random.Random(seed + 1)
        self.torch_rng = torch.Generator().manual_seed(seed + 2)
        self.version = 0
        self.pending: list[_Sample] = []
        self.groups: dict[int, _Group] = {}
        self.next_group = 0
        self.tracer = Tracer(self.name)
        self.tokens_generated = 0
        self.sync_cfg = cfg.sync
        self.receiver = None
        self.sync_receive: list[float] = []  # per received publish, in order

    def generate(self) -> tuple[RolloutMeta, RolloutBatch]:
        """One chunk of generation; returns the groups that finished during it."""
        with self.tracer.span("generate", self.version):
            return self._generate()

    def _generate(self) -> tuple[RolloutMeta, RolloutBatch]:
        start = time.perf_counter()
        resumed = len(self.pending)
        active = self.pending + self._start_groups(
            self.task.sample(self.cfg.prompts_per_step, self.rng)
        )
        chunk = sample_chunk(
            self.model,
            [s.prompt + s.tokens for s in active],
            self.cfg.max_new_tokens_per_step,
            stop_ids=self.codec.stop_ids,
            pad_id=self.codec.pad_id,
            temperature=self.cfg.temperature,
            greedy=self.greedy,
            generator=self.torch_rng,
        )
        self.pending = []
        for sample, tokens, logprobs, finished in zip(
            active, chunk.tokens, chunk.logprobs, chunk.finished, strict=True
        ):
            room = self.cfg.max_new_tokens - len(sample.tokens)
            sample.tokens += tokens[:room]
            sample.logprobs += logprobs[:room]
            sample.versions += [self.version] * len(tokens[:room])
            sample.finished = finished and len(tokens) <= room
            self.tokens_generated += len(tokens[:room])
            _stop_at_string(self.codec, sample)
            if not sample.finished and len(sample.tokens) < self.cfg.max_new_tokens:
                self.pending.append(sample)
        batch = self._collect_finished_groups()
        elapsed = time.perf_counter() - start
        meta = RolloutMeta(
            samples=len(batch),
            tokens=int(batch.completion_len.sum()),
            version=self.version,
            resumed=resumed,
            pending=len(self.pending),
            busy_s=elapsed,
        )
        return meta, batch

    def evaluate(self, split: str = "heldout", batch_size: int = 500) -> RolloutBatch:
        """Greedy completions of the held-out split, or of the probe of training problems."""
        with self.tracer.span(f"evaluate:{split}", self.version):
            problems = {"heldout": self.task.heldout, "probe": lambda: self.probe}[split]()
            prompts = [self.codec.encode(p.prompt) for p in problems]
            return self._complete(
                prompts, [p.answer for p in problems], 1, True, self.cfg.max_new_tokens, batch_size
            )

    def complete(
        self,
        prompts: list[list[int]],
        answers: list[str],
        k: int = 1,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        batch_size: int = 64,
    ) -> RolloutBatch:
        """``k`` completions of each tokenised prompt, generated in one go, grouped per prompt."""
        with self.tracer.span("complete", self.version):
            limit = max_new_tokens or self.cfg.max_new_tokens
            return self._complete(prompts, answers, k, greedy, limit, batch_size)

    def _complete(
        self,
        prompts: list[list[int]],
        answers: list[str],
        k: int,
        greedy: bool,
        max_new_tokens: int,
        batch_size: int,
    ) -> RolloutBatch:
        return complete(
            self.model,
            self.codec,
            prompts,
            answers,
            k=k,
            greedy=greedy,
            max_new_tokens=max_new_tokens,
            temperature=self.cfg.temperature,
            generator=self.torch_rng,
            version=self.version,
            batch_size=batch_size,
        )

    def open_sync(self, addresses: list[dict], name: str = "generator") -> None:
        """Attach a weight-sync receiver to the publishers of every trainer rank; it holds the
        weights in ``sync.precision``, int8 when the generator computes in int8."""
        precision = "int8" if self.cfg.precision == "int8" else self.sync_cfg.precision
        dtype = precision_dtype(precision)
        if dtype is not None:
            self.model.to(dtype)
        self.receiver = TRANSPORTS[addresses[0]["kind"]].Receiver(
            self.model,
            addresses,
            name,
            precision=precision,
            timeout_s=self.sync_cfg.timeout_s,
        )

    def connect_sync(self) -> None:
        """Rendezvous with the publisher (it calls its ``connect_sync`` meanwhile)."""
        self.receiver.connect()

    def update_weights(self, *tickets: Ticket) -> int:
        """Swap in a newer policy, once every trainer rank's shard of it is here (one ticket per
        rank); called between generate calls, which is the safe point."""
        if self.receiver is None:
            raise RuntimeError("call open_sync() before update_weights()")
        with self.tracer.span("update_weights", tickets[0].version):
            stats = self.receiver.receive(tickets)
            self.version = stats.version
        self.sync_receive.append(stats.total_s)
        return self.version

    def sync_stats(self) -> dict:
        """Receiver-side seconds of every receive, in order, from ticket to serving it."""
        return {"receive_s": list(self.sync_receive)}

    def stats(self) -> GeneratorStats:
        """Counters for the run summary."""
        return GeneratorStats(
            version=self.version,
            busy_s=self.tracer.busy_s(),
            tokens_generated=self.tokens_generated,
            pending=len(self.pending),
        )

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits

    def state_dict(self) -> dict:
        """Everything needed to resume generation exactly (weights come from the trainer)."""
        return copy.deepcopy(
            {
                "version": self.version,
                "rng": self.rng.getstate(),
                "torch_rng": self.torch_rng.get_state(),
                "pending": self.pending,
                "groups": self.groups,
                "next_group": self.next_group,
            }
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.version = state["version"]
        self.rng.setstate(state["rng"])
        self.torch_rng.set_state(state["torch_rng"])
        self.pending = copy.deepcopy(state["pending"])
        self.groups = copy.deepcopy(state["groups"])
        self.next_group = state["next_group"]

    def _start_groups(self, problems: list[Problem]) -> list[_Sample]:
        started = []
        for problem in problems:
            group_id = self.next_group
            self.next_group += 1
            prompt = self.codec.encode(problem.prompt)
            group = _Group(
                problem.answer, [_Sample(group_id, prompt) for _ in range(self.cfg.group_size)]
            )
            self.groups[group_id] = group
            started += group.samples
        return started

    def _collect_finished_groups(self) -> RolloutBatch:
        unfinished = {s.group for s in self.pending}
        done = [g for g in self.groups if g not in unfinished]
        samples = [s for g in done for s in self.groups[g].samples]
        answers = [self.groups[g].answer for g in done for _ in self.groups[g].samples]
        for g in done:
            del self.groups[g]
        return _to_batch(samples, answers, self.cfg.group_size, self.tokenizer)


def probe_problems(cfg: Config) -> list[Problem]:
    """The warm start's probe: ``warm_start.probe_size`` training problems, fixed by the seed."""
    return build_task(cfg.task).sample(cfg.warm_start.probe_size, random.Random(cfg.run.seed + 4))


def complete(
    model: torch.nn.Module,
    codec: Any,
    prompts: list[list[int]],
    answers: list[str],
    *,
    k: int,
    greedy: bool,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    version: int,
    batch_size: int,
) -> RolloutBatch:
    """``k`` completions of each tokenised prompt by ``model`` (greedy, or sampled at
    ``temperature`` from ``generator``), ``batch_size`` rows per engine call, cut at stop strings
    and grouped per prompt; every token carries ``version``."""
    samples = [_Sample(i, prompt) for i, prompt in enumerate(prompts) for _ in range(k)]
    for offset in range(0, len(samples), batch_size):
        part = samples[offset : offset + batch_size]
        chunk = sample_chunk(
            model,
            [s.prompt for s in part],
            max_new_tokens,
            stop_ids=codec.stop_ids,
            pad_id=codec.pad_id,
            temperature=temperature,
            greedy=greedy,
            generator=generator,
        )
        for sample, tokens, logprobs, finished in zip(
            part, chunk.tokens, chunk.logprobs, chunk.finished, strict=True
        ):
            sample.tokens, sample.logprobs, sample.finished = tokens, logprobs, finished
            sample.versions = [version] * len(tokens)
            _stop_at_string(codec, sample)
    return _to_batch(samples, [a for a in answers for _ in range(k)], k, codec.tokenizer)


def _stop_at_string(codec: Any, sample: _Sample) -> None:
    """End ``sample`` at the token that completes a stop string, if one occurs: the tokens after
    it are dropped (they were generated, not trained on) and it counts as finished."""
    keep = codec.stop_length(sample.tokens)
    if keep is None:
        return
    del sample.tokens[keep:], sample.logprobs[keep:], sample.versions[keep:]
    sample.finished = True


def decode_completions(tokenizer: Any, samples: Sequence[Sequence[int]]) -> list[str]:
    """The text of each completion's tokens, special tokens (EOS, padding) left out: what the
    rewarder scores, so it needs no tokenizer and starts without torch."""
    return tokenizer.batch_decode([list(t) for t in samples], skip_special_tokens=True)


def _to_batch(
    samples: list[_Sample], answers: list[str], group_size: int, tokenizer: Any
) -> RolloutBatch:
    width = max((len(s.prompt) + len(s.tokens) for s in samples), default=0)
    count = len(samples)
    tokens = np.zeros((count, width), dtype=np.int64)
    logprobs = np.zeros((count, width), dtype=np.float32)
    versions = np.full((count, width), -1, dtype=np.int64)
    for row, s in enumerate(samples):
        p, c = len(s.prompt), len(s.tokens)
        tokens[row, :p] = s.prompt
        tokens[row, p : p + c] = s.tokens
        logprobs[row, p : p + c] = s.logprobs
        versions[row, p : p + c] = s.versions
    return RolloutBatch(
        tokens=tokens,
        prompt_len=np.array([len(s.prompt) for s in samples], dtype=np.int64),
        completion_len=np.array([len(s.tokens) for s in samples], dtype=np.int64),
        logprobs=logprobs,
        versions=versions,
        finished=np.array([s.finished for s in samples], dtype=bool),
        group_size=group_size,
        answers=answers,
        completions=decode_completions(tokenizer, [s.tokens for s in samples]),
    )
