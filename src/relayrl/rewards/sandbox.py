"""A pool of worker processes that score math answers under a time and a memory limit.

Scoring parses model output with sympy, which can be made to hang (``9^{9^{9^{9}}}``), to eat
memory or to recurse without end. ``ScoringPool`` keeps that out of the calling process: each
worker is a ``multiprocessing`` process with its own ``Pipe`` and ``RLIMIT_AS``; it is given one
item at a time, and a worker that overruns ``timeout_s`` or dies is killed and replaced while the
rest of the batch goes on. Such an item scores 0 and is counted.

Messages are JSON in both directions, so nothing the workers send back is unpickled here.
``concurrent.futures.ProcessPoolExecutor`` is not used because it cannot kill one hung worker.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import resource
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from types import TracebackType

_START_TIMEOUT_S = 120.0  # a fresh worker imports sympy: seconds on a loaded 2-core machine


def _serve(conn: Connection, memory_mb: int) -> None:
    """Worker loop: receive [response, reference], reply {"score": x} or {"error": name}."""
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from relayrl.rewards.math import score  # preloaded by the forkserver, so already imported

    # math-verify warns once per process that its signal timeouts are off: this pool replaces them.
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            response, reference = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            reply = {"score": float(score(response, reference))}
        except BaseException as error:  # MemoryError, RecursionError, ...: the parent replaces us
            reply = {"error": type(error).__name__}
        conn.send_bytes(json.dumps(reply).encode())


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, context: multiprocessing.context.BaseContext, memory_mb: int):
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_conn, memory_mb), daemon=True)
        self.process.start()
        child_conn.close()  # so that a dead worker reads as EOF here

    def wait_ready(self) -> None:
        """Block until the worker has imported the scorer; raise if it does not come up."""
        if not self.conn.poll(_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"scoring worker did not start within {_START_TIMEOUT_S:.0f} s")
        try:
            self.conn.recv_bytes()
        except EOFError as error:
            self.kill()
            message = "scoring worker exited while starting: is memory_mb too small?"
            raise RuntimeError(message) from error

    def kill(self) -> None:
        """Kill the process and release its pipe."""
        self.process.kill()
        self.process.join()
        self.conn.close()


class ScoringPool:
    """Scores (response, reference) pairs with ``rewards.math.score`` in sandboxed workers."""

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, memory_mb: int = 1024):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        # forkserver, not fork: the parent may hold torch threads or Ray state that fork would
        # copy. The server imports the scorer once, so a replacement worker starts in
        # milliseconds; like spawn, each worker still re-runs the main script (guard it).
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["relayrl.rewards.math"])
        self._counters = {"timeouts": 0, "errors": 0, "scored": 0}
        self._workers = [_Worker(self._context, memory_mb) for _ in range(workers)]
        for worker in self._workers:
            worker.wait_ready()

    @property
    def counters(self) -> dict[str, int]:
        """Items scored in all, and how many of them timed out or failed (and scored 0)."""
        return dict(self._counters)

    def score_batch(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Scores in input order; an item that times out, crashes its worker or fails scores 0."""
        if not self._workers:
            raise RuntimeError("ScoringPool is closed")
        scores = [0.0] * len(pairs)
        todo = deque(range(len(pairs)))
        idle = list(self._workers)
        busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (item, deadline)
        while todo or busy:
            while todo and idle:
                item, worker = todo.popleft(), idle.pop()
                if not worker.process.is_alive():  # killed while idle, e.g. by the OOM killer
                    worker = self._replace(worker)
                if self._send(worker, pairs[item]):
                    busy[worker] = (item, time.monotonic() + self.timeout_s)
                else:
                    self._counters["errors"] += 1
                    idle.append(self._replace(worker))
            if not busy:
                continue
            first_deadline = min(deadline for _, deadline in busy.values())
            ready = wait(
                [w.conn for w in busy] + [w.process.sentinel for w in busy],
                timeout=max(0.0, first_deadline - time.monotonic()),
            )
            for worker in [w for w in busy if w.conn in ready or w.process.sentinel in ready]:
                item, _ = busy.pop(worker)
                result = self._receive(worker)
                if result is None:  # crashed, out of memory, or raised: start afresh
                    self._counters["errors"] += 1
                    worker = self._replace(worker)
                else:
                    scores[item] = result
                idle.append(worker)
            now = time.monotonic()
            for worker in [w for w, (_, deadline) in busy.items() if deadline <= now]:
                del busy[worker]
                self._counters["timeouts"] += 1
                idle.append(self._replace(worker))
        self._counters["scored"] += len(pairs)
        return scores

    def _send(self, worker: _Worker, pair: tuple[str, str]) -> bool:
        """Hand one pair to a worker; False if it died taking it (too large for its memory)."""
        try:
            worker.conn.send_bytes(json.dumps(list(pair)).encode())
        except OSError:
            return False
        return True

    def _receive(self, worker: _Worker) -> float | None:
        """The worker's score, or None if it died or reported an error."""
        try:
            if worker.conn.poll():
                return float(json.loads(worker.conn.recv_bytes())["score"])
        except (EOFError, OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def _replace(self, worker: _Worker) -> _Worker:
        """Kill a hung or dead worker and start a new one in its place."""
        worker.kill()
        fresh = _Worker(self._context, self.memory_mb)
        fresh.wait_ready()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        """Stop every worker."""
        for worker in self._workers:
            worker.kill()
        self._workers = []

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
