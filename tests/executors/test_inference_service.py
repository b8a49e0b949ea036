"""Inference service: dynamic batching answers every request with its own result, flushes a lone
request after max_wait, and swaps weights only between forward passes. Concurrent callers from
other Ray actors: tests/executors/test_rollout_worker.py."""

from __future__ import annotations

import asyncio
import copy
import random
import threading

import numpy as np
import pytest
import torch

from relayrl.envs.embodied import Observation
from relayrl.executors.inference_service import InferenceService


class EncodingPolicy(torch.nn.Module):
    """A fake policy whose output encodes its input and its weights, so a mix-up shows:
    actions = [mean pixel, step], logprobs = -actions / 1000, value = 1000 * scale + step."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(scale))
        self.log: list[tuple] = []

    def act(self, images, instructions, steps, *, greedy=False, generator=None):
        self.log.append(("start", float(self.scale), len(steps), greedy))
        self.wait_inside()
        pixel = images.float().mean(dim=(1, 2, 3, 4)).round().long()
        actions = torch.stack([pixel, steps], dim=1)
        values = self.scale * 1000 + steps.float()
        self.log.append(("end", float(self.scale)))
        return actions, -actions.float() / 1000, values

    def wait_inside(self) -> None:
        """Hook for a slow or gated forward pass."""

    def load_state_dict(self, state_dict, strict=True, assign=False):
        self.log.append(("load", float(state_dict["scale"])))
        return super().load_state_dict(state_dict, strict, assign)


class GatedPolicy(EncodingPolicy):
    """Each forward pass blocks until the test releases it."""

    def __init__(self):
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()

    def wait_inside(self) -> None:
        self.started.set()
        assert self.release.wait(10), "the test never released the forward pass"


class SlowPolicy(EncodingPolicy):
    def wait_inside(self) -> None:
        threading.Event().wait(0.003)


def obs(pixel: int, step: int) -> Observation:
    return Observation(np.full((2, 4, 4, 3), pixel, np.uint8), f"go to {pixel}", "t", step)


async def until(condition, turns: int = 1000) -> None:
    """Give the event loop turns until ``condition()`` holds (fails after ``turns``)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


def check(reply, pixel: int, step: int, scale: float = 1.0) -> None:
    assert reply.actions.tolist() == [pixel, step]
    np.testing.assert_allclose(reply.logprobs, [-pixel / 1000, -step / 1000], rtol=1e-6)
    assert reply.value == pytest.approx(1000 * scale + step)


def test_concurrent_callers_get_their_own_answers_in_batches_of_at_most_max_batch():
    async def main():
        service = InferenceService(EncodingPolicy(), max_batch=4, max_wait_ms=50)

        async def caller(c: int) -> list:
            return [(await service.act(obs(10 * c + j, c)), 10 * c + j, c) for j in range(3)]

        results = await asyncio.gather(*(caller(c) for c in range(10)))
        return results, await service.stats()

    results, stats = asyncio.run(main())
    for reply, pixel, step in (r for rs in results for r in rs):
        check(reply, pixel, step)
        assert reply.version == 0
    sizes = stats.batch_sizes
    assert sum(size * count for size, count in sizes.items()) == stats.requests == 30
    assert sum(sizes.values()) == stats.forwards
    assert max(sizes) == 4  # ten callers arrive together: the first batch is full
    assert all(1 <= size <= 4 for size in sizes)


def test_a_lone_request_is_flushed_after_max_wait():
    async def main():
        service = InferenceService(EncodingPolicy(), max_batch=8, max_wait_ms=30)
        reply = await asyncio.wait_for(service.act(obs(7, 2)), timeout=10)
        return reply, await service.stats()

    reply, stats = asyncio.run(main())
    check(reply, 7, 2)
    assert stats.batch_sizes == {1: 1}
    assert stats.queue_ms_mean >= 30  # it waited for company until the deadline, then went


def test_weight_swap_waits_for_the_forward_in_flight_and_holds_new_batches():
    policy = GatedPolicy()

    async def main():
        service = InferenceService(policy, max_batch=3, max_wait_ms=20)
        first = [asyncio.create_task(service.act(obs(p, p))) for p in (1, 2, 3)]
        assert await asyncio.to_thread(policy.started.wait, 10)
        swap = asyncio.create_task(service.set_weights({"scale": torch.tensor(2.0)}, version=1))
        later = [asyncio.create_task(service.act(obs(p, p))) for p in (4, 5)]
        # The swap has begun (it holds the weights lock) and both later requests are queued.
        await until(lambda: service._weights_lock.locked() and len(service._pending) == 2)
        assert not swap.done()  # the first forward pass is still running
        assert policy.log == [("start", 1.0, 3, False)]
        policy.release.set()
        return await asyncio.gather(*first), await swap, await asyncio.gather(*later)

    first, version, later = asyncio.run(main())
    assert version == 1
    for reply, p in zip(first, (1, 2, 3), strict=True):
        check(reply, p, p, scale=1.0)
        assert reply.version == 0
    for reply, p in zip(later, (4, 5), strict=True):
        check(reply, p, p, scale=2.0)
        assert reply.version == 1
    assert policy.log == [
        ("start", 1.0, 3, False),
        ("end", 1.0),
        ("load", 2.0),
        ("start", 2.0, 2, False),
        ("end", 2.0),
    ]


def test_every_reply_carries_the_version_of_the_weights_that_computed_it():
    policy = SlowPolicy()

    async def main():
        service = InferenceService(policy, max_batch=4, max_wait_ms=1)
        rng = random.Random(0)

        async def caller(c: int) -> list:
            out = []
            for j in range(6):
                await asyncio.sleep(rng.random() * 0.004)
                out.append((await service.act(obs(c, j)), c, j))
            return out

        async def trainer() -> None:
            for version in (1, 2, 3):
                await asyncio.sleep(0.01)
                await service.set_weights({"scale": torch.tensor(version + 1.0)}, version)

        *results, _ = await asyncio.gather(*(caller(c) for c in range(8)), trainer())
        return [r for rs in results for r in rs]

    replies = asyncio.run(main())
    for reply, pixel, step in replies:
        check(reply, pixel, step, scale=reply.version + 1.0)
    loads = [i for i, e in enumerate(policy.log) if e[0] == "load"]
    assert len(loads) == 3
    for i in loads:  # a load never lands inside a forward pass
        assert policy.log[i - 1][0] == "end" and policy.log[i + 1][0] == "start"


def test_act_batch_is_one_forward_on_the_given_list():
    policy = EncodingPolicy()

    async def main():
        service = InferenceService(policy, max_batch=2, max_wait_ms=1000)
        return await service.act_batch([obs(p, 0) for p in range(5)], greedy=True)

    replies = asyncio.run(main())
    for p, reply in enumerate(replies):
        check(reply, p, 0)
    assert policy.log == [("start", 1.0, 5, True), ("end", 1.0)]


def test_a_failing_forward_fails_its_requests_and_the_service_keeps_serving():
    class Flaky(EncodingPolicy):
        def wait_inside(self) -> None:
            if len(self.log) == 1:
                raise RuntimeError("boom")

    async def main():
        service = InferenceService(Flaky(), max_batch=2, max_wait_ms=1)
        with pytest.raises(RuntimeError, match="boom"):
            await service.act(obs(1, 1))
        return await service.act(obs(2, 2))

    check(asyncio.run(main()), 2, 2)


def test_close_fails_the_request_in_flight_and_the_waiting_ones():
    policy = GatedPolicy()

    async def main():
        service = InferenceService(policy, max_batch=1, max_wait_ms=0)
        calls = [asyncio.create_task(service.act(obs(p, 0))) for p in (1, 2)]
        assert await asyncio.to_thread(policy.started.wait, 10)
        await service.close()
        policy.release.set()
        return await asyncio.gather(*calls, return_exceptions=True)

    for result in asyncio.run(main()):
        assert isinstance(result, RuntimeError) and str(result) == "inference service closed"


def test_the_service_keeps_each_workers_latest_env_steps_from_its_requests():
    policy = GatedPolicy()

    async def main():
        service = InferenceService(policy, max_batch=8, max_wait_ms=0)
        waiting = asyncio.create_task(service.act(obs(1, 0), 3, 40))
        assert await asyncio.to_thread(policy.started.wait, 10)
        # Kept on arrival: a worker that dies waiting for its reply has reported its steps.
        on_arrival = await service.reported(3)
        policy.release.set()
        await waiting
        for env_steps in (41, 42):
            await service.act(obs(1, 0), 3, env_steps)
        await service.act(obs(2, 0), 5, 7)
        await service.act(obs(9, 0))  # a request that names no worker (a benchmark's)
        await service.act_batch([obs(4, 0)])  # lockstep and evaluators: the controller counts
        before = {w: await service.reported(w) for w in (3, 5, 0)}
        await service.report(5, 6)  # a checkpoint reloaded worker 5 without its open segment
        after = await service.reported(5)
        replacement = InferenceService(EncodingPolicy())
        await replacement.load_state_dict(await service.state_dict())
        return on_arrival, before, after, await replacement.reported(3)

    on_arrival, before, after, replaced = asyncio.run(main())
    assert on_arrival == 40
    assert before == {3: 42, 5: 7, 0: None}
    assert after == 6
    assert replaced is None  # a replica that takes over knows only what the next request says


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        InferenceService(EncodingPolicy(), max_batch=0)
    service = InferenceService(EncodingPolicy(), version=3)
    with pytest.raises(ValueError, match="version must not go backwards: got 2, have 3"):
        asyncio.run(service.set_weights({"scale": torch.tensor(1.0)}, 2))


def test_the_vla_policy_plugs_in():
    from relayrl.models.vla import VLAConfig, VLAPolicy

    cfg = VLAConfig(image_size=16, views=2, d_model=16, layers=1, heads=2, channels=8)
    torch.manual_seed(0)
    policy, other = VLAPolicy(cfg), VLAPolicy(cfg)
    original = copy.deepcopy(policy)  # the service loads other's weights into policy
    rng = np.random.default_rng(0)
    observations = [
        Observation(rng.integers(0, 256, (2, 16, 16, 3), np.uint8), "go to the red ball", "t", s)
        for s in range(5)
    ]

    def direct(model: VLAPolicy) -> tuple:
        images = torch.from_numpy(np.stack([o.image for o in observations]))
        steps = torch.arange(5)
        return model.act(images, [o.instruction for o in observations], steps, greedy=True)

    async def main():
        service = InferenceService(policy, max_batch=4, max_wait_ms=5)
        sampled = await asyncio.gather(*(service.act(o) for o in observations))
        before = await service.act_batch(observations, greedy=True)
        await service.set_weights(other.state_dict(), version=1)
        return sampled, before, await service.act_batch(observations, greedy=True)

    sampled, before, after = asyncio.run(main())
    assert all(r.actions.shape == (1,) and r.logprobs[0] <= 0 for r in sampled)
    for replies, model, version in ((before, original, 0), (after, other, 1)):
        actions, logprobs, values = direct(model)
        assert [r.version for r in replies] == [version] * 5
        assert np.array_equal(np.stack([r.actions for r in replies]), actions.numpy())
        np.testing.assert_allclose([r.value for r in replies], values.numpy(), atol=1e-5)


class GatedTransfer:
    """A disk weight-sync publisher whose receives block until the test releases them, to stand
    for a slow transfer through the service's real receiver path."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, policy: torch.nn.Module):
        from relayrl.weight_sync import disk

        self.publisher = disk.Publisher(policy.state_dict(), ["service"], durable=False)
        self.started, self.release = threading.Event(), threading.Event()
        load_file = disk.load_file

        def gated(path: str) -> dict:
            self.started.set()
            assert self.release.wait(10), "the test never released the transfer"
            return load_file(path)

        monkeypatch.setattr(disk, "load_file", gated)

    async def attach(self, service: InferenceService) -> None:
        await service.open_sync([self.publisher.address], "service")
        await service.connect_sync()

    def publish(self, version: int, scale: float):
        return self.publisher.publish(version, {"scale": torch.tensor(scale)})


def test_early_drain_serves_the_old_weights_during_a_slow_transfer_then_the_new(monkeypatch):
    policy = EncodingPolicy()
    transfer = GatedTransfer(monkeypatch, policy)

    async def main():
        service = InferenceService(policy, max_batch=2, max_wait_ms=0, early_drain=True)
        await transfer.attach(service)
        update = asyncio.create_task(service.update_weights(transfer.publish(1, 2.0)))
        assert await asyncio.to_thread(transfer.started.wait, 10)
        # The transfer is blocked: these are answered before it ends, by the old weights.
        during = [await asyncio.wait_for(service.act(obs(p, p)), 10) for p in (1, 2, 3)]
        assert not update.done()
        transfer.release.set()
        version = await update
        return during, version, [await service.act(obs(p, p)) for p in (4, 5)]

    during, version, after = asyncio.run(main())
    assert version == 1
    for reply, p in zip(during, (1, 2, 3), strict=True):
        check(reply, p, p, scale=1.0)
        assert reply.version == 0
    for reply, p in zip(after, (4, 5), strict=True):
        check(reply, p, p, scale=2.0)
        assert reply.version == 1


def test_without_early_drain_requests_wait_for_the_whole_transfer(monkeypatch):
    policy = EncodingPolicy()
    transfer = GatedTransfer(monkeypatch, policy)

    async def main():
        service = InferenceService(policy, max_batch=2, max_wait_ms=0, early_drain=False)
        await transfer.attach(service)
        update = asyncio.create_task(service.update_weights(transfer.publish(1, 2.0)))
        assert await asyncio.to_thread(transfer.started.wait, 10)
        during = [asyncio.create_task(service.act(obs(p, p))) for p in (1, 2, 3)]
        await until(lambda: len(service._pending) == 1)  # a batch of two formed, one left over
        assert policy.log == []  # no forward pass while the transfer holds the model
        transfer.release.set()
        return await asyncio.gather(*during), await update

    during, version = asyncio.run(main())
    assert version == 1
    for reply, p in zip(during, (1, 2, 3), strict=True):  # asked before the swap, served after
        check(reply, p, p, scale=2.0)
        assert reply.version == 1


def test_early_drain_swaps_after_the_forward_in_flight_and_holds_new_batches(monkeypatch):
    policy = GatedPolicy()
    transfer = GatedTransfer(monkeypatch, policy)
    transfer.release.set()  # only the forward pass is gated

    async def main():
        service = InferenceService(policy, max_batch=3, max_wait_ms=20, early_drain=True)
        await transfer.attach(service)
        first = [asyncio.create_task(service.act(obs(p, p))) for p in (1, 2, 3)]
        assert await asyncio.to_thread(policy.started.wait, 10)
        update = asyncio.create_task(service.update_weights(transfer.publish(1, 2.0)))
        later = [asyncio.create_task(service.act(obs(p, p))) for p in (4, 5)]
        await until(lambda: transfer.started.is_set() and len(service._pending) == 2)
        assert not update.done()  # the transfer is under way; the swap waits for the forward
        policy.release.set()
        return await asyncio.gather(*first), await update, await asyncio.gather(*later)

    first, version, later = asyncio.run(main())
    assert version == 1
    for reply, p in zip(first, (1, 2, 3), strict=True):
        check(reply, p, p, scale=1.0)
        assert reply.version == 0
    for reply, p in zip(later, (4, 5), strict=True):
        check(reply, p, p, scale=2.0)
        assert reply.version == 1
    assert policy.log == [
        ("start", 1.0, 3, False),
        ("end", 1.0),
        ("start", 2.0, 2, False),
        ("end", 2.0),
    ]


@pytest.mark.parametrize("early_drain", [True, False])
def test_every_reply_carries_the_version_of_the_weights_received(monkeypatch, early_drain):
    policy = SlowPolicy()
    transfer = GatedTransfer(monkeypatch, policy)
    transfer.release.set()

    async def main():
        service = InferenceService(policy, max_batch=4, max_wait_ms=1, early_drain=early_drain)
        await transfer.attach(service)
        rng = random.Random(0)

        async def caller(c: int) -> list:
            out = []
            for j in range(6):
                await asyncio.sleep(rng.random() * 0.004)
                out.append((await service.act(obs(c, j)), c, j))
            return out

        async def trainer() -> None:
            for version in (1, 2, 3):
                await asyncio.sleep(0.01)
                await service.update_weights(transfer.publish(version, version + 1.0))
            await service.set_weights({"scale": torch.tensor(5.0)}, 4)

        *results, _ = await asyncio.gather(*(caller(c) for c in range(8)), trainer())
        last = await service.act(obs(1, 1))
        return [r for rs in results for r in rs], last

    replies, last = asyncio.run(main())
    for reply, pixel, step in replies:
        check(reply, pixel, step, scale=reply.version + 1.0)
    check(last, 1, 1, scale=5.0)
    assert last.version == 4
    # no forward pass ran on a mix: each one's start and end saw the same weights
    starts = [e[1] for e in policy.log if e[0] == "start"]
    assert starts == [e[1] for e in policy.log if e[0] == "end"]
