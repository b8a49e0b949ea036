"""A pool of worker processes that run a scorer under a time and a memory limit.

A scorer is a function ``(response, reference) -> float`` named ``"module:function"``: the math
scorer, or a rule of the user's. Scoring can run model output through a parser (sympy can be made
to hang on ``9^{9^{9^{9}}}``, to eat memory or to recurse without end) and a rule can loop
forever. ``ScoringPool`` keeps that out of the calling process: each worker has its own socket
and ``RLIMIT_AS``; it is given one item at a time, and a worker that overruns ``timeout_s`` or dies
is killed and replaced while the rest of the batch goes on. Such an item scores 0 and is counted.

How workers start. Each pool starts one server: a fresh interpreter (``python -c``, with the
caller's ``sys.path``) that imports the scorer once, then forks a worker whenever the pool asks
for one, so a replacement starts in milliseconds. Nothing re-runs the caller's main module, as
multiprocessing's spawn and forkserver do (which breaks scripts without the ``if __name__ ==
"__main__":`` guard and code piped to ``python -``), and the caller itself is never forked (it may
hold torch threads or Ray state). The server kills and reaps a worker only when the pool asks, so
the pid the pool kills is never another process's. When the pool closes, or the process that
opened it dies (a killed Ray actor), the server reads end-of-file, kills its workers and exits.
No temporary file or directory is made.

Messages are JSON in both directions, so nothing the workers send back is unpickled here.
``concurrent.futures.ProcessPoolExecutor`` is not used because it cannot kill one hung worker.

``score_one`` backs public entries such as ``rewards.math.score``: a one-worker pool per scorer
shared by the process, started on first use and closed at exit.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import multiprocessing.util
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe, wait
from types import TracebackType

DEFAULT_TIMEOUT_S = 5.0  # per item; math answers take 0.1-70 ms, hostile ones minutes or more
DEFAULT_MEMORY_MB = 1024  # address space per worker, sympy included
_START_TIMEOUT_S = 120.0  # a fresh server imports sympy: seconds on a loaded 2-core machine
_STOP_TIMEOUT_S = 10.0  # a server stops in milliseconds once it reads end-of-file
_SCORER_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
# The server's program. It skips the interpreter's teardown (0.4 s with sympy loaded) when done.
_BOOT = (
    "import json, os, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from relayrl.rewards.sandbox import _server; _server(*sys.argv[2:]); os._exit(0)"
)


def check_scorer(scorer: str) -> None:
    """Raise ValueError naming ``scorer`` unless it reads "module:function" and the module is
    found; the module is not run here (the pool's server imports it)."""
    if not _SCORER_NAME.fullmatch(scorer):
        raise ValueError(f"scorer {scorer!r}: expected 'module:function', e.g. 'my_rules:score'")
    module = scorer.partition(":")[0]
    if module == "__main__":
        raise ValueError(f"scorer {scorer!r}: workers cannot import the main script; use a module")
    try:
        found = importlib.util.find_spec(module) is not None  # runs its parent packages only
    except Exception as error:
        raise ValueError(f"scorer {scorer!r}: {error}") from error
    if not found:
        raise ValueError(f"scorer {scorer!r}: no module named {module!r}")


def _load(scorer: str) -> Callable[[str, str], float]:
    """The function ``scorer`` names; ValueError naming it if it does not import or is not
    callable."""
    module, _, name = scorer.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"scorer {scorer!r}: {error}") from error
    except Exception as error:
        raise ValueError(
            f"scorer {scorer!r}: importing {module} raised {type(error).__name__}: {error}"
        ) from error
    if not callable(function):
        raise ValueError(f"scorer {scorer!r}: {name} is a {type(function).__name__}, not callable")
    return function


def _send_line(sock: socket.socket, message: dict, fd: int | None = None) -> None:
    """One JSON line on the server's control socket, with a file descriptor if given."""
    line = json.dumps(message).encode() + b"\n"
    if fd is None:
        sock.sendall(line)
    else:
        socket.send_fds(sock, [line], [fd])


def _receive_line(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """The next JSON line and the descriptors sent with it; None at end-of-file."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, more, _, _ = socket.recv_fds(sock, 4096, 1)
        fds += more
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        data += chunk
    return json.loads(data), fds


def _serve(conn: Connection, scorer: Callable[[str, str], float], memory_mb: int) -> None:
    """Worker loop: receive [response, reference], reply {"score": x} or {"error": name}."""
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            response, reference = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            reply = {"score": float(scorer(response, reference))}
        except BaseException as error:  # MemoryError, RecursionError, ...: the pool replaces us
            reply = {"error": type(error).__name__}
        conn.send_bytes(json.dumps(reply).encode())


def _kill(pid: int) -> None:
    """Kill and reap one worker (a dead one is a zombie until reaped, so the pid is still its)."""
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _server(control_fd: str, scorer: str, memory_mb: str) -> None:
    """A pool's server process: import the scorer, then serve {"fork"} (with the worker's socket)
    and {"kill": pid} requests until end-of-file, when it kills its workers and returns."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's, who closes the pool
    control = socket.socket(fileno=int(control_fd))
    try:
        function = _load(scorer)
    except ValueError as error:
        _send_line(control, {"error": str(error)})
        return
    _send_line(control, {"ready": True})
    workers: set[int] = set()
    try:
        while True:
            request, fds = _receive_line(control)
            if request is None:
                return
            if "kill" in request:
                _kill(request["kill"])
                workers.discard(request["kill"])
                _send_line(control, {"killed": request["kill"]})
                continue
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    control.close()
                    _serve(Connection(fds[0]), function, int(memory_mb))
                    code = 0
                finally:
                    os._exit(code)  # never back into this loop, whatever happened
            os.close(fds[0])
            workers.add(pid)
            _send_line(control, {"pid": pid})
    finally:
        for pid in workers:
            _kill(pid)


class _Worker:
    """One worker process: its pid and the pool's end of its socket."""

    def __init__(self, pid: int, conn: Connection):
        self.pid = pid
        self.conn = conn


_open_pools: weakref.WeakSet[ScoringPool] = weakref.WeakSet()


class ScoringPool:
    """Scores (response, reference) pairs with ``scorer`` ("module:function") in sandboxed
    workers; raises ValueError naming the scorer if it does not import or is not callable."""

    def __init__(
        self,
        scorer: str,
        workers: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_mb: int = DEFAULT_MEMORY_MB,
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        check_scorer(scorer)
        self.scorer = scorer
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._counters = {"timeouts": 0, "errors": 0, "scored": 0}
        self._workers: list[_Worker] = []
        self._closed = False
        self._control, server_end = socket.socketpair()
        try:
            command = [sys.executable, "-c", _BOOT, json.dumps(sys.path)]
            self._server = subprocess.Popen(
                [*command, str(server_end.fileno()), scorer, str(memory_mb)],
                pass_fds=[server_end.fileno()],
                stdin=subprocess.DEVNULL,
            )
        finally:
            server_end.close()  # so that a dead server reads as end-of-file here
        _open_pools.add(self)
        try:
            self._control.settimeout(_START_TIMEOUT_S)
            reply = self._read("starting")
            if "error" in reply:
                raise ValueError(reply["error"])
            self._workers = [self._start_worker() for _ in range(workers)]
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
        if self._closed:
            raise RuntimeError("ScoringPool is closed (or was opened before this process forked)")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        scores = [0.0] * len(pairs)
        todo = deque(range(len(pairs)))
        idle = list(self._workers)
        busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (item, deadline)
        while todo or busy:
            while todo and idle:
                item, worker = todo.popleft(), idle.pop()
                if worker.conn.poll():  # an idle worker says nothing: it died, e.g. OOM-killed
                    worker = self._replace(worker)
                if self._send(worker, pairs[item]):
                    busy[worker] = (item, time.monotonic() + timeout_s)
                else:
                    self._counters["errors"] += 1
                    idle.append(self._replace(worker))
            if not busy:
                continue
            first_deadline = min(deadline for _, deadline in busy.values())
            # A worker that dies closes its socket, so a reply and a death both wake this up.
            timeout = max(0.0, first_deadline - time.monotonic())
            ready = wait([w.conn for w in busy], timeout=timeout)
            for worker in [w for w in busy if w.conn in ready]:
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

    def _read(self, doing: str) -> dict:
        """The server's reply; RuntimeError if it has exited or does not answer."""
        try:
            reply, _ = _receive_line(self._control)
        except TimeoutError:
            message = f"scorer {self.scorer!r}: its server did not answer {doing} within"
            raise RuntimeError(f"{message} {_START_TIMEOUT_S:.0f} s") from None
        if reply is None:
            code = self._server.wait()
            raise RuntimeError(f"scorer {self.scorer!r}: its server exited {doing} (code {code})")
        return reply

    def _start_worker(self) -> _Worker:
        """Have the server fork a worker; block until it is ready."""
        conn, child_conn = Pipe()
        try:
            _send_line(self._control, {"fork": True}, child_conn.fileno())
        finally:
            child_conn.close()  # so that a dead worker reads as end-of-file here
        worker = _Worker(self._read("forking a worker")["pid"], conn)
        if not conn.poll(_START_TIMEOUT_S):
            self._kill(worker)
            raise RuntimeError(f"scoring worker did not start within {_START_TIMEOUT_S:.0f} s")
        try:
            conn.recv_bytes()
        except EOFError as error:
            self._kill(worker)
            message = f"scoring worker exited while starting: is memory_mb={self.memory_mb} enough?"
            raise RuntimeError(message) from error
        return worker

    def _kill(self, worker: _Worker) -> None:
        """Have the server kill and reap a worker; release its socket."""
        _send_line(self._control, {"kill": worker.pid})
        self._read("killing a worker")
        worker.conn.close()

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
        self._kill(worker)
        fresh = self._start_worker()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        """Stop the server and every worker; they are gone when this returns."""
        if self._closed:
            return
        self._closed = True
        _open_pools.discard(self)
        self._control.close()  # the server reads end-of-file, kills and reaps its workers, exits
        for worker in self._workers:
            worker.conn.close()
        self._workers = []
        try:
            self._server.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # still importing the scorer: it reads nothing
            self._server.kill()
            self._server.wait()

    def _forget(self) -> None:
        """In a forked child: close this process's copies of the sockets, leave the processes
        to the parent."""
        self._closed = True
        self._control.close()
        for worker in self._workers:
            worker.conn.close()
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


_shared_lock = threading.Lock()
_shared: dict[str, ScoringPool] = {}


def score_one(
    scorer: str, response: str, reference: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> float:
    """Score one pair in a one-worker pool for ``scorer`` shared by this process (started on
    first use)."""
    with _shared_lock:
        if scorer not in _shared:
            _shared[scorer] = ScoringPool(scorer, workers=1)
        return _shared[scorer].score_batch([(response, reference)], timeout_s)[0]


def _close_shared() -> None:
    """Close this process's shared pools."""
    with _shared_lock:
        for pool in _shared.values():
            pool.close()
        _shared.clear()


def _forget_parent_pools() -> None:
    """After a fork, in the child: the parent's pools stay the parent's (closing them here would
    kill its workers); a first ``score_one`` starts the child's own."""
    global _shared_lock
    _shared_lock = threading.Lock()  # another thread may have held it at the fork
    for pool in list(_open_pools):
        pool._forget()
    _open_pools.clear()
    _shared.clear()


# A finalizer, not atexit: multiprocessing's children exit through finalizers only.
multiprocessing.util.Finalize(None, _close_shared, exitpriority=10)
os.register_at_fork(after_in_child=_forget_parent_pools)
