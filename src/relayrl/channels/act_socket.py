"""The per-step path between rollout workers and an inference replica on one host: a Unix socket.

In async mode every env step is one request for an action. As a Ray actor call, each request is
pickled, scheduled and handed to the replica's event loop from another thread, which costs more
CPU than the env step and the forward pass share of it together (see docs/benchmarks.md). On one
host a worker instead keeps one connection to its replica's Unix socket open and writes raw bytes
to it: a small header and each observation's image, instruction and task; the reply is the
action tokens, their log-probs, the value and the version, also raw. Ray still starts, stops,
watches and replaces the actors and carries everything else (control only).

The replica answers a socket request through the same ``act`` as a Ray call (same dynamic batch,
same version on every reply, same ``reported`` books), so both paths give the same replies. The
socket lives in Linux's abstract namespace: there is no file to remove, and it disappears with
the replica's process. A worker that dies or stops closes its connection, which ends the
replica's side of it.

A worker on another node than its replica (or a platform without abstract sockets) falls back to
Ray calls: ``SocketServiceClient`` decides at its first request.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import ray

from relayrl.envs.embodied import Observation
from relayrl.types import ActReply

# Request: worker id (-1: none), its env steps so far, number of observations; then per
# observation its header, instruction, task and image bytes.
REQUEST = struct.Struct("<qqI")
OBSERVATION = struct.Struct("<qII4I")  # episode step, instruction bytes, task bytes, image shape
# Reply: status (OK or FAILED) and payload bytes; OK: per observation REPLY, then D action tokens
# (int64) and D log-probs (float32); FAILED: the error's text.
STATUS = struct.Struct("<iI")
REPLY = struct.Struct("<qdI")  # version, value, D
OK, FAILED = 0, 1

Act = Callable[[Observation, int | None, int], Awaitable[ActReply]]


def socket_path() -> str | None:
    """A fresh abstract-namespace socket address, or None where there are none (not Linux)."""
    return f"\0relayrl-act-{uuid.uuid4().hex}" if sys.platform == "linux" else None


def encode_request(
    observations: Sequence[Observation], worker: int | None, env_steps: int
) -> bytes:
    """The bytes of one request (see the module docstring)."""
    parts = [REQUEST.pack(-1 if worker is None else worker, env_steps, len(observations))]
    for obs in observations:
        image = np.ascontiguousarray(obs.image, dtype=np.uint8)
        if image.ndim != 4:
            raise ValueError(f"an observation's image must be [V, H, W, 3], got {image.shape}")
        instruction, task = obs.instruction.encode(), obs.task.encode()
        parts += [OBSERVATION.pack(obs.step, len(instruction), len(task), *image.shape)]
        parts += [instruction, task, image.tobytes()]
    return b"".join(parts)


def encode_replies(replies: Sequence[ActReply]) -> bytes:
    """The bytes of a successful reply."""
    parts = []
    for r in replies:
        actions = np.ascontiguousarray(r.actions, dtype=np.int64)
        parts += [REPLY.pack(r.version, r.value, actions.size), actions.tobytes()]
        parts += [np.ascontiguousarray(r.logprobs, dtype=np.float32).tobytes()]
    payload = b"".join(parts)
    return STATUS.pack(OK, len(payload)) + payload


def decode_replies(payload: bytes | memoryview, count: int) -> list[ActReply]:
    """The ``count`` replies of a successful reply's payload."""
    replies, at = [], 0
    for _ in range(count):
        version, value, dims = REPLY.unpack_from(payload, at)
        at += REPLY.size
        actions = np.frombuffer(payload, np.int64, dims, at).copy()
        at += 8 * dims
        logprobs = np.frombuffer(payload, np.float32, dims, at).copy()
        at += 4 * dims
        replies.append(ActReply(actions, logprobs, value, version))
    return replies


async def serve_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, act: Act
) -> None:
    """Answer one worker's requests with ``act`` until it closes the connection. An error of
    ``act`` goes back to the worker as text; the connection stays open."""
    try:
        while True:
            worker, env_steps, count = REQUEST.unpack(await reader.readexactly(REQUEST.size))
            observations = [await _read_observation(reader) for _ in range(count)]
            who = None if worker < 0 else worker
            try:
                replies = await asyncio.gather(*(act(o, who, env_steps) for o in observations))
            except Exception as err:  # the worker raises it, as a Ray call would
                text = f"{type(err).__name__}: {err}".encode()
                writer.write(STATUS.pack(FAILED, len(text)) + text)
            else:
                writer.write(encode_replies(replies))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the worker stopped or died; its request in flight, if any, has no one to answer
    finally:
        writer.close()


async def _read_observation(reader: asyncio.StreamReader) -> Observation:
    step, n_instruction, n_task, *shape = OBSERVATION.unpack(
        await reader.readexactly(OBSERVATION.size)
    )
    instruction = (await reader.readexactly(n_instruction)).decode()
    task = (await reader.readexactly(n_task)).decode()
    data = await reader.readexactly(int(np.prod(shape)))
    return Observation(np.frombuffer(data, np.uint8).reshape(shape), instruction, task, step)


class SocketServiceClient:
    """What a rollout worker calls for an action: an inference replica through its Unix socket
    when both are on one node, through Ray calls otherwise.

    ``service`` is the replica's actor handle. ``address`` is what its ``act_address`` returns
    (None: asked at the first request, from the worker's process). Picklable: the connection is
    opened in the process that calls, at its first request.
    """

    def __init__(self, service: Any, address: dict | None = None):
        self.service = service
        self.address = address
        self._sock: socket.socket | None = None
        self._local: bool | None = None

    def __getstate__(self) -> dict:
        return {"service": self.service, "address": self.address}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["service"], state["address"])

    @property
    def local(self) -> bool:
        """Whether requests go through the socket (decided at the first request)."""
        if self._local is None:
            if self.address is None:
                self.address = ray.get(self.service.act_address.remote())
            here = node_id()
            self._local = self.address["path"] is not None and self.address["node"] == here
        return self._local

    def __call__(self, obs: Observation, worker: int | None, env_steps: int) -> ActReply:
        """The replica's reply to one observation (see ``InferenceService.act``)."""
        return self.act_many([obs], worker, env_steps)[0]

    def act_many(
        self, observations: Sequence[Observation], worker: int | None, env_steps: int
    ) -> list[ActReply]:
        """The replica's replies to ``observations``, in order, all queued at once."""
        if not self.local:
            calls = [self.service.act.remote(o, worker, env_steps) for o in observations]
            return ray.get(calls)
        request = encode_request(observations, worker, env_steps)
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.connect(self.address["path"])
            self._sock.sendall(request)
            status, size = STATUS.unpack(_receive(self._sock, STATUS.size))
            payload = _receive(self._sock, size)
        except OSError as err:
            self.close()
            # A dead replica raises its Ray death here, which the run's recovery knows.
            ray.get(self.service.__ray_ready__.remote())
            raise ConnectionError(f"inference replica's socket failed: {err}") from err
        if status != OK:
            raise RuntimeError(f"inference replica: {bytes(payload).decode()}")
        return decode_replies(payload, len(observations))

    def close(self) -> None:
        """Close the connection (the next request opens a new one)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def node_id() -> str | None:
    """The Ray node this process runs on; None outside Ray (an in-process service or client)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _receive(sock: socket.socket, size: int) -> memoryview:
    buf = memoryview(bytearray(size))
    got = 0
    while got < size:
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionResetError("the inference replica closed the connection")
        got += n
    return buf
