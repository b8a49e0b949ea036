"""Replay buffer: a FIFO of trajectory segments between rollout workers and the trainer.

``put`` never waits: when the buffer is full, it evicts the oldest segments. With ``wait_at``
set, a writer asks ``wait_for_room`` after its put, which returns once the buffer holds fewer
than ``wait_at`` env steps or a ``get`` is waiting for more: writers then make only the batch the
trainer has asked for (the controller asks for the next one as the current one starts
training), plus at most ``wait_at`` steps, and generate no env step only for it to age past
``max_staleness``. The trainer takes super-batches of whole segments, oldest first, after
dropping those whose oldest action is more than ``max_staleness`` versions behind it. Every env
step is accounted for: ``put == taken + dropped_stale + dropped_overflow + resident``.

As a Ray actor it must be threaded (``max_concurrency`` > 1), so that a ``get`` waiting for data
never blocks the writers; the buffer is thread-safe for that reason. The controller asks for the
next super-batch while the current one trains, so fetching overlaps training.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TypeVar

from relayrl.types import BufferStats, Segment

T = TypeVar("T")


class ReplayBufferClosed(Exception):
    """Raised by ``ReplayBuffer.get`` once the buffer is closed."""


class ReplayBuffer:
    """Thread-safe FIFO of ``Segment``s with a staleness filter and step accounting.

    ``capacity_steps`` bounds the env steps held (segments are kept or evicted whole).
    ``max_staleness`` is the largest allowed lag, in policy versions, between the trainer and the
    oldest action of a segment it trains on; None keeps every segment however old.
    """

    name = "replay_buffer"

    def __init__(
        self, capacity_steps: int, *, max_staleness: int | None, wait_at: int | None = None
    ):
        if capacity_steps < 1:
            raise ValueError(f"capacity_steps must be >= 1, got {capacity_steps}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        if wait_at is not None and not 1 <= wait_at <= capacity_steps:
            raise ValueError(
                f"wait_at must be in [1, capacity_steps={capacity_steps}], got {wait_at}"
            )
        self.capacity_steps = capacity_steps
        self.max_staleness = max_staleness
        self.wait_at = wait_at
        self._writer_wait_s = 0.0
        self._resident_max = 0
        self._readers = 0  # gets waiting for steps
        self._segments: deque[Segment] = deque()
        self._resident_steps = 0
        self._closed = False
        self._cond = threading.Condition()
        self._counts = {
            f"{what}_{unit}": 0
            for what in ("put", "taken", "dropped_stale", "dropped_overflow")
            for unit in ("steps", "segments")
        }
        self._wait_s = 0.0
        self._workers: dict[int, tuple[int, int]] = {}  # worker id -> books at its last put

    def put(self, segment: Segment) -> None:
        """Append ``segment``; never blocks. When full, the oldest segments are evicted and counted
        as ``dropped_overflow`` (a segment longer than the whole capacity is dropped itself)."""
        steps = len(segment)
        with self._cond:
            self._count("put", segment)
            self._workers[segment.worker] = (segment.worker_env_steps, segment.worker_dropped_error)
            if steps > self.capacity_steps:
                self._count("dropped_overflow", segment)
                return
            while self._resident_steps + steps > self.capacity_steps:
                self._count("dropped_overflow", self._pop())
            self._segments.append(segment)
            self._resident_steps += steps
            self._resident_max = max(self._resident_max, self._resident_steps)
            self._cond.notify_all()

    def put_many(self, segments: list[Segment]) -> bool:
        """``put`` each of ``segments``, in order (one call for a worker's round); returns whether
        the writer should ``wait_for_room`` (``wait_at`` env steps or more held, no get waiting)."""
        for segment in segments:
            self.put(segment)
        with self._cond:
            return self._full()

    def wait_for_room(self, timeout_s: float | None = None) -> bool:
        """Block while the buffer holds ``wait_at`` env steps or more and no ``get`` waits for
        steps, until it is closed, or ``timeout_s`` seconds (None: no limit); returns whether
        there is room now. Returns at once without ``wait_at``."""
        start = time.monotonic()
        with self._cond:
            try:
                return self._cond.wait_for(lambda: self._closed or not self._full(), timeout_s)
            finally:
                self._writer_wait_s += time.monotonic() - start

    def _full(self) -> bool:
        if self.wait_at is None or self._readers:
            return False
        return self._resident_steps >= self.wait_at

    def get(
        self, min_steps: int, trainer_version: int, timeout_s: float | None = None
    ) -> list[Segment]:
        """Oldest segments totalling at least ``min_steps`` env steps, none of them stale.

        Segments whose oldest action version is below ``trainer_version - max_staleness`` are
        dropped first (counted as ``dropped_stale``), also while waiting. Blocks until enough steps
        are resident; after ``timeout_s`` seconds (None waits forever) it raises ``TimeoutError``
        and takes nothing, so a caller never trains on a short batch by accident.
        """
        if not 1 <= min_steps <= self.capacity_steps:
            raise ValueError(
                f"min_steps must be in [1, capacity_steps={self.capacity_steps}], got {min_steps}"
            )
        start = time.monotonic()
        with self._cond:
            self._readers += 1
            self._cond.notify_all()  # writers waiting for room: a reader wants more
            try:
                enough = self._cond.wait_for(
                    lambda: self._closed or self._drop_stale(trainer_version) >= min_steps,
                    timeout_s,
                )
            finally:
                self._readers -= 1
                self._wait_s += time.monotonic() - start
            if self._closed:
                raise ReplayBufferClosed("replay buffer closed")
            if not enough:
                raise TimeoutError(
                    f"replay buffer: {self._resident_steps} of min_steps={min_steps} env steps "
                    f"after timeout_s={timeout_s}"
                )
            batch, steps = [], 0
            while steps < min_steps:
                segment = self._pop()
                self._count("taken", segment)
                batch.append(segment)
                steps += len(segment)
            self._cond.notify_all()  # writers waiting for room
            return batch

    def close(self) -> None:
        """Wake every waiting ``get`` with ``ReplayBufferClosed`` (later gets raise it too) and
        every writer waiting for room."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stats(self) -> BufferStats:
        """Env steps and segments put, taken, dropped (stale, overflow) and resident (now and at
        most); occupancy (resident steps / capacity); seconds readers spent waiting and writers
        spent waiting for room (summed over writers); and each worker's books (env steps, steps
        dropped by env errors) as of its last put."""
        with self._cond:
            return BufferStats(
                **self._counts,
                resident_steps=self._resident_steps,
                resident_segments=len(self._segments),
                resident_max_steps=self._resident_max,
                occupancy=self._resident_steps / self.capacity_steps,
                reader_wait_s=self._wait_s,
                writer_wait_s=self._writer_wait_s,
                workers=dict(self._workers),
            )

    def state_dict(self) -> dict:
        """Resident segments and counters, to resume a run with the same books."""
        with self._cond:
            return {
                "segments": list(self._segments),
                "counts": dict(self._counts),
                "workers": dict(self._workers),
            }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        with self._cond:
            self._segments = deque(state["segments"])
            self._resident_steps = sum(len(s) for s in self._segments)
            self._counts = dict(state["counts"])
            self._workers = dict(state["workers"])
            self._cond.notify_all()

    def _drop_stale(self, trainer_version: int) -> int:
        """Drop stale segments anywhere in the queue (workers interleave, so versions are not
        sorted); returns the resident steps left."""
        if self.max_staleness is not None:
            oldest_allowed = trainer_version - self.max_staleness
            keep = deque()
            for segment in self._segments:
                if int(segment.versions.min()) < oldest_allowed:
                    self._count("dropped_stale", segment)
                    self._resident_steps -= len(segment)
                else:
                    keep.append(segment)
            if len(keep) < len(self._segments):
                self._cond.notify_all()  # writers waiting for room
            self._segments = keep
        return self._resident_steps

    def _pop(self) -> Segment:
        segment = self._segments.popleft()
        self._resident_steps -= len(segment)
        return segment

    def _count(self, what: str, segment: Segment) -> None:
        self._counts[f"{what}_steps"] += len(segment)
        self._counts[f"{what}_segments"] += 1
