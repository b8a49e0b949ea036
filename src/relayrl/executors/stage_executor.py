"""``StageExecutor``: the base of every scoring stage of the LLM workload, the built-in ones
(rewarder, reward model, reference, critic) and yours.

It keeps what every stage shares, so a stage writes only its ``score``: each call is traced as a
busy ``score`` span (the timeline's scoring phase) by a tracer named after the stage, the summary
it returns is timed, and the samples it scored (and those it could not: errors, timeouts) are
counted from that summary for ``stats`` and for the checkpoint (``state_dict``).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from relayrl.observability.tracing import Span, Tracer
from relayrl.types import RolloutBatch, StageStats

if TYPE_CHECKING:
    from relayrl.config import Config


class StageExecutor:
    """Base class of a scoring stage: implement ``score``.

    It is constructed on its actor as ``cls(cfg, *args, **kwargs)`` with the run's ``Config``.
    ``score`` takes a ``RolloutBatch`` (rewards already filled by the stages before it; the first
    stage, the rewarder, takes the generators' batches) and returns ``(summary, batch)``: a dict
    with ``samples``, ``busy_s``, ``errors`` (samples it could not score) and ``timeouts``
    (``summary()`` makes one), and the batch the next stage receives. The run's books count
    samples, so a stage changes rewards or adds fields, never rows. Extend ``state_dict`` and
    ``load_state_dict`` (calling the base's, which keeps the counters) if it holds state a
    resumed run needs.
    """

    name = "stage"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wrap a subclass's ``score`` so every call is traced, timed and counted."""
        super().__init_subclass__(**kwargs)
        inner = cls.__dict__.get("score")
        if inner is None:
            return

        @functools.wraps(inner)
        def score(self: StageExecutor, *batches: RolloutBatch) -> tuple[dict, RolloutBatch]:
            if self._scoring:  # an override calling super().score: the outer call counts
                return inner(self, *batches)
            self._scoring = True
            try:
                with self.tracer.span("score"):
                    self._started = time.perf_counter()
                    summary, batch = inner(self, *batches)
            finally:
                self._scoring = False
            self.scored += summary["samples"]
            self.errors += summary["errors"]
            self.timeouts += summary["timeouts"]
            return summary, batch

        cls.score = score

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.tracer = Tracer(self.name)
        self._started = time.perf_counter()
        self._scoring = False
        self.scored = 0
        self.errors = 0
        self.timeouts = 0

    def score(self, batch: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        """Score ``batch``; see the class docstring."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(batch)")

    def summary(self, batch: RolloutBatch, errors: int = 0, timeouts: int = 0) -> dict:
        """The summary ``score`` returns for ``batch``; ``busy_s`` is the time since the call
        began."""
        now = time.perf_counter()
        busy, self._started = now - self._started, now
        return {"samples": len(batch), "busy_s": busy, "errors": errors, "timeouts": timeouts}

    def stats(self) -> StageStats:
        """Counters for the run summary: busy time, samples scored, errors and timeouts."""
        return StageStats(
            busy_s=self.tracer.busy_s(),
            scored=self.scored,
            errors=self.errors,
            timeouts=self.timeouts,
        )

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits

    def state_dict(self) -> dict:
        """State a resumed run restores: the counters."""
        return {"scored": self.scored, "errors": self.errors, "timeouts": self.timeouts}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved (a checkpoint from before errors and timeouts were
        kept by every stage has only ``scored``)."""
        self.scored = state["scored"]
        self.errors = state.get("errors", 0)
        self.timeouts = state.get("timeouts", 0)
