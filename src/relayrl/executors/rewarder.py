"""Rewarder executor: scores completions' text (decoded by the generator that sampled them) with a
rule-based scorer: the config's ``rewarder.scorer`` (a built-in name, or a ``module:function`` rule
of the user's), or a ``rule`` function handed to the pipeline, run in this process. It loads no
tokenizer and imports no torch, so a rewarder starts in about a second.

A completion that did not end with EOS scores 0 (it was cut at the length limit). A scorer that
raises scores 0 for that sample and is counted in ``errors`` (and the batch's ``score_errors``); the
run goes on. The ``math`` scorer and ``module:function`` rules run in a ``ScoringPool`` (worker
processes with a time and a memory limit), where an item that raises or kills its worker is
counted the same way and one that times out (a rule that loops forever) scores 0 and is counted in
``timeouts``. ``close()`` stops the pool's processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from relayrl.config import Config
from relayrl.executors.stage_executor import StageExecutor
from relayrl.rewards.exact import exact_answer
from relayrl.rewards.sandbox import ScoringPool
from relayrl.types import RolloutBatch

# Run in this process: exact matching is safe and cheap.
SCORERS: dict[str, Callable[[str, str], float]] = {"exact_answer": exact_answer}
# Run in a ScoringPool: they parse model output. By name, so that this process never loads sympy.
SANDBOXED: dict[str, str] = {"math": "relayrl.rewards.math:_score_unbounded"}


class Rewarder(StageExecutor):
    """Scores rollout batches; a Ray actor in a run, a plain object in tests."""

    name = "rewarder"

    def __init__(self, cfg: Config, rule: Callable[[str, str], float] | None = None):
        super().__init__(cfg)
        rc = cfg.rewarder
        sandboxed = rule is None and rc.scorer not in SCORERS  # math, or a module:function rule
        self.pool = (
            ScoringPool(SANDBOXED.get(rc.scorer, rc.scorer), rc.workers, rc.timeout_s, rc.memory_mb)
            if sandboxed
            else None
        )
        self.scorer = rule if rule is not None else SCORERS.get(rc.scorer)

    def score(self, *batches: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        """A small summary, and one batch (``batches`` one after the other) with ``rewards`` and
        ``score_errors`` filled in; each batch must carry its ``completions`` (the generator's)."""
        batch = RolloutBatch.concat(batches)
        texts = batch.completions
        if len(texts) != len(batch):
            raise ValueError(
                f"RolloutBatch.completions has {len(texts)} texts for {len(batch)} samples: the "
                "rewarder scores the text the generator decoded (generator.decode_completions)"
            )
        rewards = np.zeros(len(batch), dtype=np.float32)
        finished = np.flatnonzero(batch.finished)  # a completion cut at the length limit scores 0
        scores, errors, timeouts = self._score_pairs(
            [(texts[i], batch.answers[i]) for i in finished]
        )
        rewards[finished] = scores
        summary = self.summary(batch, errors, timeouts) | {
            "reward_mean": float(rewards.mean()) if len(batch) else 0.0
        }
        scored = replace(batch, rewards=rewards, score_errors=errors)
        return summary, replace(scored, rule_rewards=rewards.copy())  # kept as later stages mix

    def _score_pairs(self, pairs: list[tuple[str, str]]) -> tuple[list[float], int, int]:
        """Scores of (completion, reference) pairs, and how many raised and how many timed out."""
        if self.pool is not None:
            before = self.pool.counters
            scores = self.pool.score_batch(pairs)
            after = self.pool.counters
            return (
                scores,
                after["errors"] - before["errors"],
                after["timeouts"] - before["timeouts"],
            )
        scores, errors = [], 0
        for completion, reference in pairs:
            try:
                scores.append(self.scorer(completion, reference))
            except Exception:  # a scorer bug must not stop the run; it is counted and reported
                scores.append(0.0)
                errors += 1
        return scores, errors, 0

    def close(self) -> None:
        """Stop the scoring processes, if any."""
        if self.pool is not None:
            self.pool.close()
