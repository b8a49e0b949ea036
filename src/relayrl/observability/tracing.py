"""Spans of executor work, written as a Chrome/Perfetto trace and used for busy fractions.

Every executor keeps a ``Tracer``; each unit of work (a generate call, a train step, a weight
swap) is one span with the policy version it ran under. The same spans give ``perf.busy`` in
``summary.json`` and the ``trace.json`` timeline, so the two cannot disagree. Times come from
``time.time()`` so that spans recorded in different processes (or hosts) share one axis.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_WAIT_S = 1e-4


@dataclass(frozen=True)
class Span:
    """One timed piece of work of one executor."""

    name: str
    start: float  # seconds since the epoch
    end: float
    version: int


class Tracer:
    """Records spans; ``busy`` spans count towards the executor's busy time, waits do not."""

    def __init__(self, executor: str, max_spans: int = 200_000):
        self.executor = executor
        self.max_spans = max_spans
        self.spans: list[Span] = []
        self.waits: list[Span] = []
        self.dropped = 0

    @contextmanager
    def span(self, name: str, version: int = -1) -> Iterator[None]:
        """Time the body as a busy span called ``name``."""
        start = time.time()
        try:
            yield
        finally:
            self._add(self.spans, Span(name, start, time.time(), version))

    def record(self, name: str, start: float, end: float, version: int = -1) -> None:
        """Record a busy span that already happened (one whose version is known only at its end)."""
        self._add(self.spans, Span(name, start, end, version))

    def wait(self, name: str, start: float, end: float, version: int = -1) -> None:
        """Record an idle wait (e.g. on a channel) that already happened; waits under
        ``MIN_WAIT_S`` are not worth a trace event."""
        if end - start >= MIN_WAIT_S:
            self._add(self.waits, Span(name, start, end, version))

    def busy_s(self, since: float = 0.0, until: float = float("inf")) -> float:
        """Seconds of busy spans inside the window [since, until]."""
        return busy_seconds(self.spans, since, until)

    def _add(self, spans: list[Span], span: Span) -> None:
        if len(spans) >= self.max_spans:
            self.dropped += 1
            return
        spans.append(span)


def busy_seconds(spans: list[Span], since: float, until: float) -> float:
    """Seconds inside the window [since, until] that at least one span covers. An executor's
    spans may overlap: an inference service's weight transfer runs beside its forward passes
    under the early drain."""
    total, reached = 0.0, since
    for s in sorted(spans, key=lambda s: s.start):
        start, end = max(s.start, reached), min(s.end, until)
        if end > start:
            total += end - start
            reached = end
    return total


def chrome_trace(tracers: dict[str, tuple[list[Span], list[Span]]], origin: float) -> dict:
    """Chrome trace-event JSON (opens in Perfetto and chrome://tracing) for executors' spans.

    ``tracers`` maps an executor name to its (busy spans, waits); each executor is one process
    row with a ``work`` thread and a ``wait`` thread. Times are microseconds since ``origin``.
    """
    events: list[dict] = []
    for pid, (executor, (busy, waits)) in enumerate(sorted(tracers.items()), start=1):
        events.append(_meta("process_name", pid, 0, executor))
        lanes = _lanes(busy)
        rows = [
            ("work" if i == 0 else f"work {i + 1}", "work", lane) for i, lane in enumerate(lanes)
        ]
        for tid, (row, label, spans) in enumerate([*rows, ("wait", "wait", waits)], start=1):
            events.append(_meta("thread_name", pid, tid, row))
            for s in spans:
                events.append(
                    {
                        "name": s.name,
                        "cat": label,
                        "ph": "X",
                        "ts": round((s.start - origin) * 1e6, 1),
                        "dur": round((s.end - s.start) * 1e6, 1),
                        "pid": pid,
                        "tid": tid,
                        "args": {"version": s.version},
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _lanes(spans: list[Span]) -> list[list[Span]]:
    """The spans on as few rows as keep each row free of overlaps (trace viewers nest the slices
    of one row): one row unless some overlap, as a weight transfer under the early drain does."""
    lanes: list[list[Span]] = [[]]
    for span in sorted(spans, key=_start):
        lane = next((lane for lane in lanes if not lane or lane[-1].end <= span.start), None)
        if lane is None:
            lane = []
            lanes.append(lane)
        lane.append(span)
    return lanes


def collect_spans(
    traced: dict[str, Any], seen: Mapping[str, Tracer]
) -> dict[str, tuple[list[Span], list[Span]]]:
    """Each executor's busy spans, and its waits: its own plus those ``seen`` by the controller
    on its behalf (``traced``: Ray actor handles by executor name). An executor that died since
    it was last replaced gives no spans of its own."""
    if not traced:  # a run that failed before placing anything: ray.get would start a Ray
        return {}
    import ray

    refs = [handle.trace.remote() for handle in traced.values()]
    traces = []
    for ref in refs:
        try:
            traces.append(ray.get(ref, timeout=60))
        except ray.exceptions.RayActorError:
            traces.append(([], []))
    return {
        name: (busy, sorted(waits + (seen[name].waits if name in seen else []), key=_start))
        for name, (busy, waits) in zip(traced, traces, strict=True)
    }


def save_trace(
    run_dir: Path, spans: dict, origin: float, window: tuple[float, float], steps: int
) -> tuple[Path, Path]:
    """trace.json (all spans, RL window and busy fractions in ``otherData``) and timeline.png
    (eight steps around the middle of the RL window)."""
    from relayrl.observability.plots import plot_timeline

    start, end = window
    trace = chrome_trace(spans, origin)
    trace["otherData"] = {
        "rl_window_us": [(start - origin) * 1e6, (end - origin) * 1e6],
        "busy": {
            n: busy_seconds(b, start, end) / max(end - start, 1e-9) for n, (b, _) in spans.items()
        },
    }
    step = (end - start) / max(steps, 1)
    middle = (start + end) / 2
    shown = (max(start, middle - 4 * step), min(end, middle + 4 * step))
    return (
        write_trace(run_dir / "trace.json", trace),
        plot_timeline(spans, run_dir / "timeline.png", shown, trace["otherData"]["busy"]),
    )


def _start(span: Span) -> float:
    return span.start


def write_trace(path: Path, trace: dict) -> Path:
    """Write a trace made by ``chrome_trace``."""
    path.write_text(json.dumps(trace))
    return path


def _meta(kind: str, pid: int, tid: int, name: str) -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
