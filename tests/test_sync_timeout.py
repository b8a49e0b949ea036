"""A weight-sync receiver that stays in one call past ``sync.timeout_s`` misses its update: the run
replaces it as it would a dead one, the replacement serves the newest version, and the books
balance."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray
from conftest import tiny_config
from test_controller import SMALL
from test_embodied import SMALL as EMBODIED
from test_embodied import check_books
from test_recovery import MADE, Kept, KeptEmbodied

from relayrl import job
from relayrl.observability.metrics import MetricsLog

TIMEOUT_S = 3


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

    monkeypatch.setattr(job, "MetricsLog", Stalling)
    return todo


# async: the other replica keeps the trainer publishing; sync: a forced lag of 1 lets the trainer
# train and publish while the stalled replica's batch is still due.
@pytest.mark.parametrize(("mode", "options"), [("async", []), ("sync", ["generator.min_lag=1"])])
def test_a_generator_that_misses_the_sync_timeout_is_replaced_and_serves_the_newest_version(
    ray_session, tmp_path, monkeypatch, mode, options
):
    monkeypatch.setitem(job.WORKLOADS, "llm", Kept)
    cfg = tiny_config(
        *SMALL,
        f"mode={mode}",
        "steps=30",
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
    assert failure["name"] == "generator_0"
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
    cfg = tiny_config(*EMBODIED, "mode=async", "steps=12", f"sync.timeout_s={TIMEOUT_S}")
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
