"""A weight-sync receiver that stays in one call past ``sync.timeout_s`` misses its update: the run
replaces it as it would a dead one, the replacement serves the newest version, and the books
balance."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray
from conftest import MADE, Kept, KeptEmbodied, check_books, tiny_config
from conftest import SMALL_EMBODIED as EMBODIED
from conftest import SMALL_LLM as SMALL

from relayrl import job
from relayrl.launch import Group, WeightSync
from relayrl.observability.metrics import MetricsLog
from relayrl.weight_sync import ReceiverLost

TIMEOUT_S = 3


@ray.remote(num_cpus=0)
class Rank:
    """A trainer rank's publishing half: each publish is a ticket."""

    def publish(self) -> str:
        return "ticket"


@ray.remote(num_cpus=0)
class Receiving:
    """A receiver that takes every update (or fails it) and works as long as it is told."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.version = 0

    def update_weights(self, *tickets: str) -> int:
        if self.fail:
            raise RuntimeError("the transfer broke")
        self.version += 1
        return self.version

    def work(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.version


def _sync(fail: bool = False) -> WeightSync:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test modules: not importable
    trainer = Group("trainer", [Rank.remote()])
    return WeightSync("shm", trainer, {"r": Receiving.remote(fail)}, "127.0.0.1", timeout_s=1.0)


def test_a_call_watched_with_the_updates_before_it_runs_on_them(ray_session):
    sync = _sync()
    receiver = sync.receivers["r"]
    sync.publish()
    sync.publish()
    assert asyncio.run(sync.watched("r", receiver.work.remote(0))) == 2
    assert sync.updates["r"] == []  # both seen taken
    ray.kill(receiver)


def test_a_receiver_busy_past_the_timeout_or_whose_update_fails_is_lost(ray_session):
    busy = _sync()
    receiver = busy.receivers["r"]
    receiver.work.remote(60 * busy.timeout_s)  # one call that outlasts the timeout
    for _ in range(3):
        busy.publish()
    # Kept: the oldest (it times the receiver) and the newest (what it would serve).
    assert [u.publish for u in busy.updates["r"]] == [1, 3]
    with pytest.raises(ReceiverLost, match=r"'r' lost: missed sync.timeout_s=1: publish #1 "):
        asyncio.run(busy.watched("r", receiver.work.remote(0)))
    ray.kill(receiver)

    failing = _sync(fail=True)
    failing.publish()
    call = failing.receivers["r"].work.remote(0)
    with pytest.raises(ReceiverLost, match=r"its update failed \(RuntimeError: the transfer broke"):
        asyncio.run(failing.watched("r", call))
    ray.kill(failing.receivers["r"])


def _sleep(actor: object) -> None:
    """Stay in this call far longer than ``sync.timeout_s`` (the run must stop the actor)."""
    time.sleep(100 * TIMEOUT_S)


def _hold_weights(service: object) -> None:
    """Hold an inference replica's weight lock far longer than ``sync.timeout_s``: its updates
    wait for it while it goes on answering ``act``."""

    async def hold() -> None:
        async with service._weights_lock:
            await asyncio.sleep(100 * TIMEOUT_S)

    asyncio.run_coroutine_threadsafe(hold(), service._batcher.get_loop())


def _stall_at(monkeypatch, step: int, role: str, index: int, stall=_sleep) -> list:
    """As the run logs step ``step``, run ``stall`` in ``role[index]`` (through Ray's
    ``__ray_call__``). Returns the stalls still to come."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test modules: not importable
    todo = [(step, role, index)]

    class Stalling(MetricsLog):
        def log(self, at: int, metrics: dict) -> None:
            super().log(at, metrics)
            if todo and at >= todo[0][0]:
                _, role, index = todo.pop()
                actor = {g.role: g for g in MADE[-1].groups()}[role][index]
                actor.__ray_call__.remote(stall)
                MADE[-1].stalled = True

    monkeypatch.setattr(job, "MetricsLog", Stalling)
    return todo


class KeptUntilReplaced(Kept):
    """Kept; once a replica is stalled, an evaluation waits until it is replaced, so that the
    other replica cannot finish the run first."""

    stalled = False

    async def evaluate(self, split: str = "heldout") -> dict:
        while self.stalled and not self.recovery.tally.failures:
            await asyncio.sleep(0.1)
        return await super().evaluate(split)


# async: the other replica keeps the trainer publishing, and the evaluation at step 5 waits for
# the replacement; sync: a forced lag of 1 lets the trainer train and publish while the stalled
# replica's batch is still due, and the next step waits for that batch.
@pytest.mark.parametrize(
    ("mode", "options"),
    [("async", ["log.eval_every=5"]), ("sync", ["generator.min_lag=1"])],
)
def test_a_generator_that_misses_the_sync_timeout_is_replaced_and_serves_the_newest_version(
    ray_session, tmp_path, monkeypatch, mode, options
):
    monkeypatch.setitem(job.WORKLOADS, "llm", KeptUntilReplaced)
    cfg = tiny_config(
        *SMALL,
        f"mode={mode}",
        "steps=8",
        "max_staleness=1",
        "generator.replicas=2",
        f"sync.timeout_s={TIMEOUT_S}",
        *options,
    )
    todo = _stall_at(monkeypatch, 2, "generator", 0)
    summary = job.train(cfg, tmp_path / "run")
    assert todo == []

    assert summary["status"] == "finished" and summary["steps"] == cfg.steps
    (failure,) = summary["failures"]["generator"]
    assert failure["name"] == "generator_0" and failure["step"] < cfg.steps  # replaced mid-run
    assert f"missed sync.timeout_s={TIMEOUT_S}" in failure["reason"]
    assert set(summary["failures"]) == {"generator"}  # nothing else was replaced
    # Every replica, the replacement included, serves the trainer's last version.
    versions = [r["version"] for r in summary["generation"]["replicas"].values()]
    assert versions == [summary["updates"]] * 2
    assert summary["eval"]["end"]["version"] == summary["updates"]
    samples = summary["samples"]
    assert samples["generated"] == (
        samples["trained"]
        + samples["dropped_stale"]
        + samples["dropped_resume"]
        + samples["lost"]
        + samples["in_flight"]
    )
    assert samples["accounted"] and samples["trained"] > 0
    assert samples["lost"] == failure["lost"]
    # The stalled replica's batch in progress was never counted as generated.
    assert failure["unfinished"] >= cfg.generator.prompts_per_step * cfg.generator.group_size


def test_an_inference_replica_that_misses_the_sync_timeout_is_replaced_and_serves_the_newest(
    ray_session, tmp_path, monkeypatch
):
    monkeypatch.setitem(job.WORKLOADS, "embodied", KeptEmbodied)
    cfg = tiny_config(*EMBODIED, "mode=async", "steps=6", f"sync.timeout_s={TIMEOUT_S}")
    todo = _stall_at(monkeypatch, 1, "inference_service", 0, _hold_weights)
    summary = job.train(cfg, tmp_path / "run")
    assert todo == []

    assert summary["status"] == "finished" and summary["steps"] == cfg.steps
    (failure,) = summary["failures"]["inference_service"]
    assert f"missed sync.timeout_s={TIMEOUT_S}" in failure["reason"]
    assert set(summary["failures"]) == {"inference_service"}  # the workers were restarted
    assert failure["lost"] == failure["unfinished"] == 0  # a worker keeps its open segment
    # The replacement serves the trainer's last version.
    assert summary["perf"]["inference"]["versions"] == [summary["updates"]]
    assert summary["eval"]["end"]["version"] == summary["updates"]
    samples = check_books(summary)
    assert samples["lost"] == 0 and samples["trained"] > 0
