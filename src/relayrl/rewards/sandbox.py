"""A pool of worker processes that score math answers under a time and a memory limit.

Scoring parses model output with sympy, which can be made to hang (``9^{9^{9^{9}}}``), to eat
memory or to recurse without end. ``ScoringPool`` keeps that out of the calling process: each
worker is a ``multiprocessing`` process with its own ``Pipe`` and ``RLIMIT_AS``; it is given one
item at a time, and a worker that overruns ``timeout_s`` or dies is killed and replaced while the
rest of the batch goes on. Such an item scores 0 and is counted.

Messages are JSON in both directions, so nothing the workers send back is unpickled here.
``concurrent.futures.ProcessPoolExecutor`` is not used because it cannot kill one hung worker.

``score_one`` backs the public ``rewards.math.score``: a one-worker pool shared by the process,
started on first use and closed at exit. The workers come from multiprocessing's forkserver, whose
listening socket lives in a temporary directory; this module gives multiprocessing one it owns and,
when the last pool closes, stops the forkserver it started and removes that directory, so that
closed pools leave no ``/tmp/pymp-*`` behind (multiprocessing's own one is removed only at a normal
interpreter exit, never when a Ray actor is killed).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import resource
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from types import TracebackType

DEFAULT_TIMEOUT_S = 5.0  # per item; answers take 0.1-70 ms, hostile ones minutes or more
DEFAULT_MEMORY_MB = 1024  # address space per worker, sympy included
_START_TIMEOUT_S = 120.0  # a fresh worker imports sympy: seconds on a loaded 2-core machine


def _serve(conn: Connection, memory_mb: int) -> None:
    """Worker loop: receive [response, reference], reply {"score": x} or {"error": name}."""
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # preloaded by the forkserver, so already imported
    from relayrl.rewards.math import _score_unbounded

    # math-verify warns once per process that its signal timeouts are off: this pool replaces them.
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            response, reference = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            reply = {"score": float(_score_unbounded(response, reference))}
        except BaseException as error:  # MemoryError, RecursionError, ...: the parent replaces us
            reply = {"error": type(error).__name__}
        conn.send_bytes(json.dumps(reply).encode())


class _Forkserver:
    """Counts the open pools; owns multiprocessing's temp dir and the forkserver it started.

    The forkserver listens on a socket in ``multiprocessing.util.get_temp_dir()``, a ``pymp-*``
    directory that multiprocessing removes only at a normal interpreter exit. If the process has
    no such directory yet when the first pool opens, this hands multiprocessing one of ours; when
    the last pool closes it stops the forkserver (the next pool or other user starts a fresh one)
    and removes the directory. If the directory already existed, someone else uses multiprocessing
    here: both are left alone and nothing new is created.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools = 0
        self._tempdir: str | None = None

    def acquire(self) -> None:
        """A pool is opening."""
        with self._lock:
            config = multiprocessing.current_process()._config
            server = multiprocessing.forkserver._forkserver
            untouched = config.get("tempdir") is None and server._forkserver_pid is None
            if self._pools == 0 and untouched:
                self._tempdir = tempfile.mkdtemp(prefix="relayrl-scoring-")
                config["tempdir"] = self._tempdir
                # For pools still open at exit, as multiprocessing does for its own directory.
                multiprocessing.util.Finalize(
                    None, shutil.rmtree, (self._tempdir, True), exitpriority=-100
                )
            self._pools += 1

    def release(self) -> None:
        """A pool has closed and killed its workers."""
        with self._lock:
            self._pools -= 1
            if self._pools or self._tempdir is None:
                return
            server = multiprocessing.forkserver._forkserver
            if server._forkserver_pid is not None:
                # Closing its "alive" pipe alone would wait on any other process forked from it.
                os.kill(server._forkserver_pid, signal.SIGKILL)
                server._stop()
            shutil.rmtree(self._tempdir, ignore_errors=True)
            config = multiprocessing.current_process()._config
            if config.get("tempdir") == self._tempdir:
                del config["tempdir"]
            self._tempdir = None

    def forget(self) -> None:
        """In a forked child: the open pools, the temp dir and the forkserver are the parent's."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        if self._tempdir is not None:
            # The parent stops this forkserver and removes its directory; the child starts its own
            # (the stdlib would instead waitpid() on the parent's child and raise).
            server = multiprocessing.forkserver._forkserver
            if server._forkserver_alive_fd is not None:
                os.close(server._forkserver_alive_fd)
            server._forkserver_pid = server._forkserver_alive_fd = None
            server._forkserver_address = None
            multiprocessing.current_process()._config.pop("tempdir", None)
        self._pools, self._tempdir = 0, None


_forkserver = _Forkserver()


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
            message = (
                "scoring worker exited while starting: is memory_mb too small, or does the main"
                " script create a pool outside `if __name__ == '__main__':`?"
            )
            raise RuntimeError(message) from error

    def kill(self) -> None:
        """Kill the process and release its pipe."""
        self.process.kill()
        self.process.join()
        self.conn.close()


class ScoringPool:
    """Scores (response, reference) pairs with ``rewards.math`` in sandboxed workers."""

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_mb: int = DEFAULT_MEMORY_MB,
    ):
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
        self._workers: list[_Worker] = []
        self._closed = False
        _forkserver.acquire()
        try:
            self._workers = [_Worker(self._context, memory_mb) for _ in range(workers)]
            for worker in self._workers:
                worker.wait_ready()
        except BaseException:
            self.close()
            raise

    @property
    def counters(self) -> dict[str, int]:
        """Items scored in all, and how many of them timed out or failed (and scored 0)."""
        return dict(self._counters)

    def score_batch(
        self, pairs: list[tuple[str, str]], timeout_s: float | None = None
    ) -> list[float]:
        """Scores in input order; an item that times out (after ``timeout_s``, default the
        pool's), crashes its worker or fails scores 0."""
        if not self._workers:
            raise RuntimeError("ScoringPool is closed")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
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
                    busy[worker] = (item, time.monotonic() + timeout_s)
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
        """Stop every worker; the last pool to close also stops the forkserver (``_Forkserver``)."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.kill()
        self._workers = []
        _forkserver.release()

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


_shared_lock = threading.Lock()
_shared: ScoringPool | None = None


def score_one(response: str, reference: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """Score one pair in a one-worker pool shared by this process (started on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ScoringPool(workers=1)
            # A finalizer, not atexit: multiprocessing's children exit through finalizers only.
            multiprocessing.util.Finalize(None, _close_shared, exitpriority=10)
        return _shared.score_batch([(response, reference)], timeout_s)[0]


def _close_shared() -> None:
    """Close this process's shared pool, if it started one."""
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared.close()
            _shared = None


def _forget_parent_pools() -> None:
    """After a fork, in the child: leave the parent's pools to the parent (closing the shared one
    here would kill the parent's worker); a first ``score_one`` starts the child's own."""
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()
    _forkserver.forget()


os.register_at_fork(after_in_child=_forget_parent_pools)
