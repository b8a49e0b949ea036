"""The socket path between rollout workers and an inference replica: every request answered once
with its own reply and the version that computed it, under concurrency and weight swaps; a worker
that dies mid-request ends only its own connection and leaves no file behind; a service that dies
raises its Ray death in the worker; a worker on another node falls back to Ray calls."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from relayrl.channels.act_socket import REQUEST, SocketServiceClient, encode_request
from relayrl.envs.embodied import ActionSpace, Observation, StepResult
from relayrl.executors.inference_service import InferenceService
from relayrl.executors.replay_buffer import ReplayBuffer
from relayrl.executors.rollout_worker import RolloutWorker
from relayrl.recovery import DEATHS


class EncodingPolicy(torch.nn.Module):
    """actions = [mean pixel, step] (the first ``dims``), logprobs = -actions / 1000,
    value = 1000 * scale + step: a reply that went to the wrong request, or was computed by other
    weights, shows."""

    def __init__(self, scale: float = 1.0, dims: int = 2):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(scale))
        self.dims = dims

    def act(self, images, instructions, steps, *, greedy=False, generator=None):
        if any(i == "fail" for i in instructions):
            raise ValueError("the policy failed")
        pixel = images.float().mean(dim=(1, 2, 3, 4)).round().long()
        actions = torch.stack([pixel, steps], dim=1)[:, : self.dims]
        return actions, -actions.float() / 1000, self.scale * 1000 + steps.float()


class CountingEnv:
    """Episodes of 7 steps; the image at step t is filled with 10 * t + ``offset``."""

    action_space = ActionSpace("discrete", 256)
    tasks = ("a",)

    def __init__(self, offset: int):
        self.offset, self.t = offset, 0

    def reset(self, *, task=None, seed=None):
        self.t = 0
        return self._obs()

    def step(self, action):
        self.t += 1
        return StepResult(self._obs(), 0.0, self.t == 7, False, self.t == 7)

    def close(self):
        pass

    def _obs(self):
        return Observation(
            np.full((1, 2, 2, 3), 10 * self.t + self.offset, np.uint8), "a", "a", self.t
        )


class Factory:
    def __init__(self, offset: int):
        self.offset = offset

    def __call__(self):
        return CountingEnv(self.offset)


def pixels(seg) -> list[int]:
    return seg.images[:, 0, 0, 0, 0].tolist()


def obs(pixel: int, step: int, instruction: str = "go") -> Observation:
    return Observation(np.full((2, 3, 4, 3), pixel, np.uint8), instruction, "task", step)


class LoopThread:
    """An event loop on a thread of its own, as a Ray async actor runs one."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def socket_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("*relayrl*")}


@pytest.mark.skipif(sys.platform != "linux", reason="abstract Unix sockets are Linux only")
def test_concurrent_workers_get_their_own_replies_with_the_version_that_computed_them():
    before = socket_files()
    loop = LoopThread()
    service = InferenceService(EncodingPolicy(), max_batch=4, max_wait_ms=2)
    address = loop.run(service.act_address())
    assert address["path"].startswith("\0")  # abstract: no file to leak
    results: dict[int, list] = {}

    def worker(w: int) -> None:
        client = SocketServiceClient(None, address)
        out = []
        for j in range(60):
            pixel, step = 4 * j + w, j
            if j % 5 == 4:  # a batched request of three observations
                many = [obs(pixel, step), obs(pixel + 1, step + 1), obs(pixel + 2, step + 2)]
                replies = client.act_many(many, w, j)
                out += [(r, pixel + k, step + k) for k, r in enumerate(replies)]
            else:
                out.append((client(obs(pixel, step), w, j), pixel, step))
        client.close()
        results[w] = out

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for version in range(1, 6):  # weight swaps while the workers ask
        state = {"scale": torch.tensor(float(version + 1))}
        loop.run(service.set_weights(state, version))
        time.sleep(0.01)
    for t in threads:
        t.join(30)
    stats = loop.run(service.stats())
    reported = [loop.run(service.reported(w)) for w in range(4)]
    loop.run(service.close())
    loop.stop()
    replies = [reply for out in results.values() for reply in out]
    assert len(replies) == 4 * (48 + 12 * 3) == stats.requests  # each answered once
    versions = []
    for reply, pixel, step in replies:
        assert reply.actions.tolist() == [pixel, step]
        np.testing.assert_allclose(reply.logprobs, [-pixel / 1000, -step / 1000], rtol=1e-6)
        # value = 1000 * scale + step, and version v serves scale v + 1
        assert reply.value == pytest.approx(1000 * (reply.version + 1) + step)
        versions.append(reply.version)
    for out in results.values():  # a worker never sees versions go backwards
        mine = [r.version for r, _, _ in out]
        assert mine == sorted(mine)
    assert set(versions) <= set(range(6)) and len(set(versions)) > 1
    assert reported == [59] * 4
    assert socket_files() == before


@pytest.mark.skipif(sys.platform != "linux", reason="abstract Unix sockets are Linux only")
def test_a_worker_that_dies_mid_request_ends_only_its_connection():
    loop = LoopThread()
    service = InferenceService(EncodingPolicy(), max_batch=4, max_wait_ms=1)
    address = loop.run(service.act_address())
    # Dies halfway through writing a request, then one dies with its request in flight.
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.connect(address["path"])
    half.sendall(encode_request([obs(1, 1)], 7, 1)[: REQUEST.size + 5])
    whole = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    whole.connect(address["path"])
    whole.sendall(encode_request([obs(2, 2)], 8, 2))
    half.close()
    whole.close()
    client = SocketServiceClient(None, address)
    reply = client(obs(3, 3), 9, 3)
    assert reply.actions.tolist() == [3, 3] and reply.version == 0

    async def connections() -> int:
        for _ in range(100):
            if len(service._connections) == 1:  # only the live client's is left
                break
            await asyncio.sleep(0.01)
        return len(service._connections)

    assert loop.run(connections()) == 1
    client.close()
    loop.run(service.close())
    assert not service._connections
    loop.stop()


@pytest.mark.skipif(sys.platform != "linux", reason="abstract Unix sockets are Linux only")
def test_an_error_of_the_policy_reaches_the_worker_and_the_connection_goes_on():
    loop = LoopThread()
    service = InferenceService(EncodingPolicy(), max_batch=1, max_wait_ms=0)
    client = SocketServiceClient(None, loop.run(service.act_address()))
    with pytest.raises(RuntimeError, match="the policy failed"):
        client(obs(1, 1, instruction="fail"), 0, 0)
    assert client(obs(2, 2), 0, 1).actions.tolist() == [2, 2]
    client.close()
    loop.run(service.close())
    loop.stop()


def test_ray_actors_stream_over_the_socket_or_ray_calls_across_nodes_and_see_a_death(ray_session):
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(num_cpus=0)
    policy = EncodingPolicy(dims=1)
    service = actor(InferenceService).remote(policy, max_batch=2, max_wait_ms=20)
    buffer = actor(ReplayBuffer).options(max_concurrency=4).remote(10_000, max_staleness=None)
    workers = [
        actor(RolloutWorker)
        .options(max_concurrency=2)
        .remote(i, Factory(5 * i), segment_len=3, seed=i)
        for i in range(2)
    ]
    runs = [w.run.remote(SocketServiceClient(service), RemoteSink(buffer)) for w in workers]
    segments = ray.get(buffer.get.remote(30, trainer_version=0, timeout_s=60), timeout=90)

    def left(s):
        return len(s._connections)

    def connections_within(wanted: int, seconds: float) -> int:
        deadline = time.monotonic() + seconds
        while (found := ray.get(service.__ray_call__.remote(left))) != wanted:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return found

    # Both workers ask through the socket, not Ray calls (one may start after the other has
    # filled the buffer's 30 segments alone).
    assert connections_within(2, 30) == 2
    ray.kill(workers[1])  # a worker dies: its connection ends with it
    ray.get(workers[0].stop.remote(), timeout=30)
    emitted = ray.get(runs[0], timeout=30)
    assert connections_within(0, 30) == 0
    for seg in segments:  # a reply sent to the wrong worker would break these
        assert seg.values.tolist() == [1000 + s for s in seg.steps[:-1].tolist()]
        assert seg.actions[:, 0].tolist() == pixels(seg)[:-1]
        assert all(p % 10 == 5 * seg.worker for p in pixels(seg))
    assert emitted > 0
    requests = ray.get(service.stats.remote()).requests
    assert requests >= sum(len(s) for s in segments)
    # A worker on another node falls back to Ray calls; one on this node takes the socket.
    address = ray.get(service.act_address.remote())
    elsewhere = SocketServiceClient(service, {**address, "node": "another-node"})
    reply = elsewhere(obs(4, 2), 3, 9)
    assert reply.actions.tolist() == [4] and not elsewhere.local
    assert ray.get(service.__ray_call__.remote(left)) == 0
    assert ray.get(service.reported.remote(3)) == 9
    here = SocketServiceClient(service)
    assert here(obs(5, 1), 3, 10).actions.tolist() == [5] and here.local
    here.close()
    # The service dies: the next request raises its Ray death, which recovery replaces.
    client = SocketServiceClient(service)
    client(obs(1, 1), 0, 0)
    ray.kill(service)
    with pytest.raises(DEATHS):  # ray.kill returns before the process is gone: wait for it
        ray.get(service.stats.remote(), timeout=30)
    with pytest.raises(DEATHS):
        client(obs(1, 2), 0, 1)
    for handle in (buffer, workers[0]):
        ray.kill(handle)


class RemoteSink:
    def __init__(self, handle):
        self.handle = handle

    def __call__(self, segment) -> None:
        import ray

        ray.get(self.handle.put.remote(segment))
