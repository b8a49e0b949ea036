"""Inference service: one copy of the VLA policy serving many rollout workers with dynamic batching.

Workers call ``act`` concurrently, one observation each. Requests wait in a queue; a batch is
flushed when ``max_batch`` requests are waiting or ``max_wait_ms`` after the oldest waiting one
arrived, and answered by one forward pass. The service is an asyncio object: as a Ray actor it is
an async actor (Ray runs its methods as coroutines on one event loop), and the forward pass runs in
a worker thread so that the loop keeps accepting requests while the policy computes.

Weight swaps drain: no forward pass ever runs on a mix of two versions, and every reply carries
the version of the weights that computed it. ``set_weights`` (weights passed in) waits for the
forward pass in flight, holds new batches, loads the weights and bumps the version: forward passes
and weight loads take turns on one lock.

``update_weights`` takes a ticket of the trainer's weight-sync publisher (see
``relayrl.weight_sync``). The receiver holds two copies of the weights: the model serves one while
the transfer fills the other (the staging slot), then a swap rebinds the model's tensors to it.
With ``early_drain`` (the default) the transfer runs in a thread of its own while forward passes
go on with the old weights; only the swap waits for the forward pass in flight and holds new ones,
and it only rebinds pointers. Without it the whole transfer happens inside the model lock, as
``set_weights`` does, so every request that arrives meanwhile waits for the transfer. Either way
the staging slot is the receiver's second copy, which it holds anyway: the early drain costs no
memory, only the CPU (or bandwidth) the transfer takes from forward passes it overlaps.

What a forward pass computes is ``batch_fn`` (``act_replies``, the policy's actions, by default):
the same batching, weight sync, tracing and books serve any model whose requests can be answered
in batches. The world-model service is this class with ``relayrl.models.world_model``'s
``world_model_replies`` (next frame and success probability per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from relayrl.channels.act_socket import node_id, serve_connection, socket_path
from relayrl.envs.embodied import Observation
from relayrl.observability.tracing import Span, Tracer
from relayrl.types import ActReply, ServiceStats
from relayrl.weight_sync import TRANSPORTS, Ticket

# Per-request latencies kept for percentiles; totals cover every request.
LATENCY_WINDOW = 10_000


class ActingPolicy(Protocol):
    """What the service needs from a policy (``relayrl.models.vla.VLAPolicy`` provides it)."""

    def act(
        self,
        images: torch.Tensor,
        instructions: list[str],
        steps: torch.Tensor,
        *,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """images uint8 [B, V, H, W, 3], steps int64 [B] -> (actions int64 [B, D],
        logprobs float32 [B, D], values float32 [B]); sampling draws from ``generator``."""
        ...


BatchFn = Callable[[torch.nn.Module, list[Any], bool, torch.Generator, int], list[Any]]
"""``batch_fn(model, requests, greedy, generator, version) -> replies``: one forward pass of
``model`` on a batch of requests, one reply per request, each carrying ``version``."""


@dataclass
class _Request:
    obs: Any  # an Observation for the policy; what batch_fn takes for another model
    future: asyncio.Future | None  # None for act_batch, which answers directly
    arrived: float  # time.monotonic()


class InferenceService:
    """Dynamic-batching inference copy of the policy; a Ray async actor in a run.

    ``policy`` is a ``torch.nn.Module`` with ``act`` (see ``ActingPolicy``); it is put in eval
    mode. ``max_batch`` is the most requests one forward pass answers; ``max_wait_ms`` is how
    long the oldest waiting request may wait for others before its batch is flushed anyway (0
    flushes whatever is waiting at once). ``version`` is the policy version of the initial weights.
    ``threads`` sets torch's intra-op threads for the forward pass (None leaves torch's setting).
    ``sync_timeout_s`` bounds a weight-sync receive (see ``open_sync``). ``early_drain`` runs
    weight-sync transfers beside forward passes, which then wait only for the swap (see above).
    ``batch_fn`` answers a batch (see ``BatchFn``); ``name`` labels its trace rows.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        max_batch: int = 16,
        max_wait_ms: float = 2.0,
        version: int = 0,
        threads: int | None = None,
        sync_timeout_s: float = 60.0,
        early_drain: bool = True,
        seed: int = 0,
        batch_fn: BatchFn | None = None,
        name: str = "inference_service",
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.policy = policy.eval()
        self.batch_fn = batch_fn or act_replies
        self.name = name
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self.version = version
        self.generator = torch.Generator().manual_seed(seed)  # action sampling; checkpointed
        self.tracer = Tracer(self.name)
        # One thread for forwards and weight loads, which never run at the same time anyway (the
        # model lock), so that torch's thread pool is not oversubscribed; weight-sync transfers
        # get their own, to overlap forwards under the early drain.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self._sync_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference-sync")
        self._pending: deque[_Request] = deque()
        self._arrived: asyncio.Event | None = None
        self._model_lock: asyncio.Lock | None = None  # forward passes and blocking weight loads
        self._weights_lock: asyncio.Lock | None = None  # one weight change at a time
        self._batcher: asyncio.Task | None = None
        self.sync_timeout_s = sync_timeout_s
        self.early_drain = early_drain
        self.receiver = None
        self.sync_receive: list[float] = []  # per received publish, in order
        self.sync_drain: list[float] = []  # of each: the swap's wait for the forward in flight
        self._reported: dict[int, int] = {}  # rollout worker id -> env steps at its last request
        self._server: asyncio.Server | None = None  # the Unix socket of act_address
        self._address: dict | None = None
        self._connections: set[asyncio.Task] = set()
        self._reset_counters()

    async def act(
        self,
        obs: Observation,
        worker: int | None = None,
        env_steps: int = 0,
        seed: int | None = None,
    ) -> ActReply:
        """Queue one observation for the next batch and return its reply (sampled actions).

        ``worker`` names the asking rollout worker and ``env_steps`` counts the env steps it has
        taken so far; both are kept (on arrival, not on reply) for ``reported``. A request that
        names no worker (a benchmark's, a test's) is not kept. A request with a ``seed`` gets a
        forward pass of its own, its actions sampled from a generator seeded with it: the same
        reply however the other workers' requests arrive (the lockstep loop's, which a resume
        replays exactly).
        """
        if worker is not None:
            self._reported[worker] = env_steps
        self._ensure_batcher()
        if seed is not None:
            own = torch.Generator().manual_seed(seed)
            request = _Request(obs, None, time.monotonic())
            return (await self._forward([request], greedy=False, generator=own))[0]
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(obs, future, time.monotonic()))
        self._arrived.set()
        return await future

    async def act_address(self) -> dict:
        """Where rollout workers on this node reach ``act`` without a Ray call per request:
        ``{"path": abstract Unix socket address or None, "node": Ray node id}`` (see
        ``relayrl.channels.act_socket``). The socket opens at the first call."""
        if self._address is None:
            path = socket_path()
            if path is not None:
                self._server = await asyncio.start_unix_server(self._connected, path=path)
            self._address = {"path": path, "node": node_id()}
        return self._address

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            await serve_connection(reader, writer, self.act)
        finally:
            self._connections.discard(task)

    async def act_batch(
        self, observations: Sequence[Observation], *, greedy: bool = False
    ) -> list[ActReply]:
        """One forward pass on exactly ``observations``, without queueing (lockstep mode).

        ``greedy`` takes the most likely action tokens (evaluation) instead of sampling.
        """
        if not observations:
            return []
        self._ensure_batcher()
        requests = [_Request(obs, None, time.monotonic()) for obs in observations]
        return await self._forward(requests, greedy=greedy)

    async def set_weights(
        self, state_dict: Mapping[str, torch.Tensor | np.ndarray], version: int
    ) -> int:
        """Load new weights (every parameter name must match) after the forward pass in flight;
        batches formed meanwhile wait and run on the new weights. Returns the new version."""
        if version < self.version:
            raise ValueError(f"version must not go backwards: got {version}, have {self.version}")
        self._ensure_batcher()
        async with self._weights_lock, self._model_lock:
            if version < self.version:
                raise ValueError(
                    f"version must not go backwards: got {version}, have {self.version}"
                )
            with self.tracer.span("set_weights", version):
                await asyncio.get_running_loop().run_in_executor(
                    self._executor, _load, self.policy, state_dict
                )
                self.version = version
        return self.version

    async def open_sync(self, addresses: list[dict], name: str = "inference_service") -> None:
        """Attach a weight-sync receiver to the publishers of every trainer rank."""
        self.receiver = TRANSPORTS[addresses[0]["kind"]].Receiver(
            self.policy, addresses, name, timeout_s=self.sync_timeout_s
        )

    async def connect_sync(self) -> None:
        """Rendezvous with the publisher (it calls its ``connect_sync`` meanwhile)."""
        await asyncio.get_running_loop().run_in_executor(self._sync_executor, self.receiver.connect)

    async def update_weights(self, *tickets: Ticket) -> int:
        """Take the published version of ``tickets`` (one per trainer rank); returns it once it
        serves it. With ``early_drain`` forward passes go on during the transfer and wait only for
        the swap; without, they wait for the whole transfer, as for ``set_weights``."""
        version = tickets[0].version
        if self.receiver is None:
            raise RuntimeError("call open_sync() before update_weights()")
        self._ensure_batcher()
        loop = asyncio.get_running_loop()
        async with self._weights_lock:
            if version < self.version:
                raise ValueError(
                    f"version must not go backwards: got {version}, have {self.version}"
                )
            if self.early_drain:
                with self.tracer.span("update_weights", version):
                    stats = await loop.run_in_executor(
                        self._sync_executor, self.receiver.receive, tickets
                    )
            else:
                async with self._model_lock:
                    with self.tracer.span("update_weights", version):
                        stats = await loop.run_in_executor(
                            self._executor, self.receiver.receive, tickets
                        )
            self.version = version
        self.sync_receive.append(stats.total_s)
        self.sync_drain.append(stats.drain_s)
        return self.version

    async def reported(self, worker: int) -> int | None:
        """The env steps rollout worker ``worker`` had taken when it last asked (or was last
        ``report``ed); None if this replica has heard nothing of it (it asked another one, or
        this replica took the place of one that died since)."""
        return self._reported.get(worker)

    async def report(self, worker: int, env_steps: int) -> None:
        """Set what ``reported`` says of ``worker``: the books a checkpoint (re)loaded it with,
        until its next request."""
        self._reported[worker] = env_steps

    async def sync_stats(self) -> dict:
        """Receiver-side seconds of every receive, in order, from ticket to serving it, and of
        each the part its swap waited for the forward pass in flight."""
        return {"receive_s": list(self.sync_receive), "drain_s": list(self.sync_drain)}

    async def stats(self) -> ServiceStats:
        """Counters since the last ``reset_stats``: requests, forwards, busy seconds, the batch-size
        histogram and per-request latency (queue wait plus forward) in milliseconds."""
        window = np.asarray(self._latencies, dtype=np.float64) * 1000.0
        requests = self._requests
        return ServiceStats(
            version=self.version,
            requests=requests,
            forwards=self._forwards,
            busy_s=self._busy_s,
            batch_sizes=dict(sorted(self._batch_sizes.items())),
            mean_batch=requests / self._forwards if self._forwards else 0.0,
            queue_ms_mean=1000.0 * self._queue_s / requests if requests else 0.0,
            latency_ms_mean=1000.0 * self._latency_s / requests if requests else 0.0,
            latency_ms_p50=float(np.percentile(window, 50)) if window.size else 0.0,
            latency_ms_p95=float(np.percentile(window, 95)) if window.size else 0.0,
            latency_ms_max=float(window.max()) if window.size else 0.0,
            waiting=len(self._pending),
        )

    async def reset_stats(self) -> None:
        """Start new counters (e.g. after warm-up)."""
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._requests = 0
        self._forwards = 0
        self._busy_s = 0.0
        self._queue_s = 0.0
        self._latency_s = 0.0
        self._batch_sizes: Counter[int] = Counter()
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)

    async def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans (forwards, weight swaps) and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits

    async def state_dict(self) -> dict:
        """The policy version and the sampling generator (weights come from the trainer; the
        workers' books come with the next request, or from the controller's ``report``)."""
        return {"version": self.version, "generator": self.generator.get_state()}

    async def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.version = state["version"]
        self.generator.set_state(state["generator"])

    async def close(self) -> None:
        """Stop batching and close the socket; requests still waiting fail with
        ``RuntimeError``."""
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            self._server = None
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
            self._batcher = None
        _fail(list(self._pending), RuntimeError("inference service closed"))
        self._pending.clear()
        self._executor.shutdown(wait=False)
        self._sync_executor.shutdown(wait=False)

    def _ensure_batcher(self) -> None:
        # Started lazily on the loop that serves the calls: a Ray actor's __init__ runs outside it.
        loop = asyncio.get_running_loop()
        if self._batcher is not None and self._batcher.get_loop() is loop:
            return
        self._arrived = asyncio.Event()
        self._model_lock = asyncio.Lock()
        self._weights_lock = asyncio.Lock()
        self._batcher = loop.create_task(self._batch_loop(), name="inference-batcher")

    async def _batch_loop(self) -> None:
        while True:
            while not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            deadline = self._pending[0].arrived + self.max_wait_s
            while len(self._pending) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._arrived.clear()
                # A timeout only ends this wait; the loop re-reads the clock, so a batch never
                # leaves before its deadline because a timer fired a little early.
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), left)
            batch = [
                self._pending.popleft() for _ in range(min(self.max_batch, len(self._pending)))
            ]
            try:
                replies = await self._forward(batch, greedy=False)
            except asyncio.CancelledError:
                _fail(batch, RuntimeError("inference service closed"))
                raise
            except Exception as err:  # the callers get the error; the service keeps serving
                _fail(batch, err)
                continue
            for request, reply in zip(batch, replies, strict=True):
                if not request.future.done():  # the caller may have been cancelled
                    request.future.set_result(reply)

    async def _forward(
        self, requests: list[_Request], *, greedy: bool, generator: torch.Generator | None = None
    ) -> list[Any]:
        async with self._model_lock:
            start, began = time.monotonic(), time.time()
            payloads = [r.obs for r in requests]
            version, replies = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._serve, payloads, greedy, generator or self.generator
            )
            end = time.monotonic()
            # Recorded once done: under the early drain its version is known only inside.
            self.tracer.record("forward", began, time.time(), version)
        self._forwards += 1
        self._busy_s += end - start
        self._batch_sizes[len(requests)] += 1
        for r in requests:
            self._requests += 1
            self._queue_s += start - r.arrived
            self._latency_s += end - r.arrived
            self._latencies.append(end - r.arrived)
        if len(replies) != len(requests):
            raise ValueError(f"batch_fn gave {len(replies)} replies to {len(requests)} requests")
        return replies

    def _serve(
        self, payloads: list[Any], greedy: bool, generator: torch.Generator
    ) -> tuple[int, list[Any]]:
        """One forward pass on weights that no swap changes meanwhile, sampling from
        ``generator``: (their version, the replies ``batch_fn`` gives)."""
        if self.receiver is None:
            version = self.version
            return version, self.batch_fn(self.policy, payloads, greedy, generator, version)
        with self.receiver.serving() as received:
            # A receive's swap sets the receiver's version with the weights, atomically;
            # set_weights and the initial weights set only ours (under the model lock, which
            # this forward holds). Versions never go backwards, so the newer is what serves.
            version = max(received, self.version)
            return version, self.batch_fn(self.policy, payloads, greedy, generator, version)


def _fail(requests: list[_Request], err: Exception) -> None:
    for request in requests:
        if not request.future.done():
            request.future.set_exception(err)


def act_replies(
    policy: torch.nn.Module,
    observations: list[Observation],
    greedy: bool,
    generator: torch.Generator,
    version: int,
) -> list[ActReply]:
    """The policy's ``BatchFn``: one ``ActReply`` (actions, log-probs, value) per observation."""
    actions, logprobs, values = _run_policy(policy, observations, greedy, generator)
    return [
        ActReply(actions[i], logprobs[i], float(values[i]), version)
        for i in range(len(observations))
    ]


def _run_policy(
    policy: torch.nn.Module,
    observations: list[Observation],
    greedy: bool,
    generator: torch.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One forward pass: observations -> (actions int64 [B, D], logprobs float32 [B, D],
    values float32 [B]) as numpy arrays."""
    images = torch.from_numpy(np.stack([o.image for o in observations]))
    steps = torch.tensor([o.step for o in observations], dtype=torch.int64)
    with torch.no_grad():
        actions, logprobs, values = policy.act(
            images, [o.instruction for o in observations], steps, greedy=greedy, generator=generator
        )
    batch = len(observations)
    if actions.shape[0] != batch or logprobs.shape != actions.shape or values.shape != (batch,):
        raise ValueError(
            f"policy.act returned actions {tuple(actions.shape)}, logprobs "
            f"{tuple(logprobs.shape)}, values {tuple(values.shape)} for a batch of {batch}; "
            f"expected [{batch}, D], [{batch}, D], [{batch}]"
        )
    return (
        actions.to(torch.int64).cpu().numpy(),
        logprobs.to(torch.float32).cpu().numpy(),
        values.to(torch.float32).cpu().numpy(),
    )


def _load(policy: torch.nn.Module, state_dict: Mapping[str, torch.Tensor | np.ndarray]) -> None:
    with warnings.catch_warnings():
        # Ray hands out read-only views of the object store; load_state_dict only reads them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        state = {k: torch.as_tensor(v) for k, v in state_dict.items()}
    policy.load_state_dict(state, strict=True)
