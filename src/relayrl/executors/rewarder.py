"""Rewarder executor: decodes completions and scores them with a rule-based scorer.

A completion that did not end with EOS scores 0 (it was cut at the length limit). A scorer that
raises scores 0 for that sample and is counted in ``score_errors``; the run goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from relayrl.config import Config
from relayrl.models.lm import load_tokenizer
from relayrl.observability.tracing import Span, Tracer
from relayrl.rewards.exact import exact_answer
from relayrl.types import RolloutBatch

SCORERS: dict[str, Callable[[str, str], float]] = {"exact_answer": exact_answer}


class Rewarder:
    """Scores rollout batches; a Ray actor in a run, a plain object in tests."""

    name = "rewarder"

    def __init__(self, cfg: Config):
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.scorer = SCORERS[cfg.rewarder.scorer]
        self.tracer = Tracer(self.name)
        self.scored = 0
        self.errors = 0

    def score(self, batch: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        """A small summary, and the batch with ``completions``, ``rewards``, ``score_errors``."""
        with self.tracer.span("score"):
            return self._score(batch)

    def _score(self, batch: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        start = time.perf_counter()
        texts = [
            self.tokenizer.decode(row[p : p + c], skip_special_tokens=True)
            for row, p, c in zip(batch.tokens, batch.prompt_len, batch.completion_len, strict=True)
        ]
        rewards = np.zeros(len(batch), dtype=np.float32)
        errors = 0
        for i, (text, answer, finished) in enumerate(
            zip(texts, batch.answers, batch.finished, strict=True)
        ):
            if not finished:
                continue
            try:
                rewards[i] = self.scorer(text, answer)
            except Exception:  # a scorer bug must not stop the run; it is counted and reported
                errors += 1
        self.scored += len(batch)
        self.errors += errors
        elapsed = time.perf_counter() - start
        summary = {
            "samples": len(batch),
            "errors": errors,
            "reward_mean": float(rewards.mean()) if len(batch) else 0.0,
            "busy_s": elapsed,
        }
        return summary, replace(batch, completions=texts, rewards=rewards, score_errors=errors)

    def stats(self) -> dict[str, float]:
        """Counters for the run summary."""
        return {"busy_s": self.tracer.busy_s(), "scored": self.scored, "errors": self.errors}

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits

    def state_dict(self) -> dict:
        """Counters to restore on resume."""
        return {"scored": self.scored, "errors": self.errors}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.scored, self.errors = state["scored"], state["errors"]
