"""Executors killed mid-run (``ray.kill`` and ``os.kill`` of the actor's process): the run replaces
them, reconnects weight sync, reports the failures and what was lost, and keeps its books."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import ray
from conftest import IMAGINING, Kept, KeptEmbodied, check_books, tiny_config
from conftest import SMALL_EMBODIED as EMBODIED
from conftest import SMALL_LLM as SMALL
from conftest import kill_at as _kill_at

from relayrl import job
from relayrl.checkpoint import Checkpointer
from relayrl.config import EnvConfig
from relayrl.executors.worker_side import build_env
from relayrl.observability.metrics import MetricsLog
from relayrl.recovery import ExecutorFailed
from relayrl.workloads import EmbodiedWorkload


# async unforced: two lost batches exceed max_staleness; sync forced: older batches train meanwhile.
@pytest.mark.parametrize(("mode", "lag"), [("async", 0), ("sync", 2)])
def test_killed_generators_and_rewarders_are_replaced_and_the_books_balance(
    ray_session, tmp_path, monkeypatch, mode, lag
):
    monkeypatch.setitem(job.WORKLOADS, "llm", Kept)
    # With a forced lag the trainer trains on older batches while the lost ones are generated.
    forced = [f"generator.min_lag={lag}", "channels.capacity=2"] if lag else []
    cfg = tiny_config(
        *SMALL,
        f"mode={mode}",
        "steps=8",
        f"max_staleness={max(lag, 1)}",
        "generator.replicas=2",
        "sync.timeout_s=5",
        *forced,
    )
    run_dir = tmp_path / "run"
    # Each role is killed both ways over the two modes. Two batches lost with rewarders are one
    # more than max_staleness: the staleness gate must not count them as still in flight.
    how = ("ray.kill", "os.kill") if mode == "async" else ("os.kill", "ray.kill")
    kills = [(2, "generator", 0, how[0]), (4, "rewarder", 0, how[1]), (6, "rewarder", 0, how[0])]
    todo = _kill_at(monkeypatch, kills)
    summary = job.train(cfg, run_dir)
    assert todo == []

    assert summary["status"] == "finished" and summary["steps"] == 8
    failures = summary["failures"]
    assert [f["name"] for f in failures["generator"]] == ["generator_0"]
    assert [f["name"] for f in failures["rewarder"]] == ["rewarder", "rewarder"]
    assert all(f["reason"] and f["time"] > 0 for fs in failures.values() for f in fs)
    samples = summary["samples"]
    assert samples["accounted"]
    assert samples["lost"] == sum(f["lost"] for fs in failures.values() for f in fs)
    assert samples["lost_unfinished"] >= 16  # the generator's batch in progress
    # Every replica, the replacements included, serves the trainer's last version at the end.
    versions = [r["version"] for r in summary["generation"]["replicas"].values()]
    assert versions == [summary["eval"]["end"]["version"]] * 2
    assert summary["staleness"]["max"] <= cfg.max_staleness


def test_a_dead_world_model_trainer_fails_the_run_which_resumes(ray_session, tmp_path, monkeypatch):
    """The world-model trainer is not replaced (its B_wm and rounds would be lost): its death
    fails the run, naming it, and the run resumes from its last checkpoint with both books."""
    monkeypatch.setitem(job.WORKLOADS, "embodied", KeptEmbodied)
    cfg = tiny_config(*EMBODIED, *IMAGINING, "steps=5", "run.checkpoint_every=2")
    run_dir = tmp_path / "run"
    todo = _kill_at(monkeypatch, [(3, "world_model_trainer", 0, "os.kill")])
    with pytest.raises(ExecutorFailed, match="world_model_trainer died"):
        job.train(cfg, run_dir)
    assert todo == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_executor"] == "world_model_trainer"
    assert summary["resume"] == f"relayrl train --resume {run_dir}"
    imagined = summary["imagined_samples"]  # asked of the buffers and ranks, which live on
    assert imagined["unit"] == "imagined_env_steps" and "counted_by" not in summary["samples"]
    assert imagined["generated"] >= imagined["trained"] > 0
    monkeypatch.undo()
    resumed = job.train(cfg, run_dir, resume=True)
    assert resumed["status"] == "finished" and resumed["steps"] == 5
    assert resumed["resumes"][0]["step"] == 2
    check_books(resumed)
    assert resumed["imagined_samples"]["accounted"]


def test_a_dead_world_model_replica_fails_the_run_instead_of_restarting_workers_forever(
    ray_session, tmp_path, monkeypatch
):
    """Imagining workers call the world-model replica: its death ends their runs while they and
    their inference replica live. Nothing replaces it yet, so the run fails naming it (it used
    to restart the workers' runs, which failed again at once, for ever)."""
    monkeypatch.setitem(job.WORKLOADS, "embodied", KeptEmbodied)
    cfg = tiny_config(*EMBODIED, *IMAGINING, "steps=5")
    todo = _kill_at(monkeypatch, [(2, "world_model_service", 0, "os.kill")])
    with pytest.raises(ExecutorFailed, match="world_model_service died"):
        job.train(cfg, tmp_path / "run")
    assert todo == []
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_executor"] == "world_model_service"


def test_a_dead_trainer_rank_fails_the_run_which_resumes_keeping_the_books_and_staleness_bound(
    ray_session, tmp_path, monkeypatch
):
    """A trainer rank is not replaced: its death fails the run, naming it, and the async run
    resumes from its last checkpoint with its books and the staleness bound."""
    monkeypatch.setitem(job.WORKLOADS, "llm", Kept)
    cfg = tiny_config(*SMALL, "mode=async", "steps=7", "max_staleness=1", "run.checkpoint_every=3")
    run_dir = tmp_path / "run"
    todo = _kill_at(monkeypatch, [(4, "trainer", 0, "os.kill")])
    with pytest.raises(ExecutorFailed, match="trainer died"):
        job.train(cfg, run_dir)
    assert todo == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_executor"] == "trainer"
    assert summary["resume"] == f"relayrl train --resume {run_dir}"
    monkeypatch.undo()
    resumed = job.train(cfg, run_dir, resume=True)
    samples = resumed["samples"]
    assert samples["accounted"]
    assert resumed["steps"] == 7 and resumed["resumes"][0]["step"] == 3
    assert resumed["resumes"][0]["dropped_resume"] == samples["dropped_resume"]
    assert resumed["staleness"]["max"] <= 1


# A covering set of loop and transport: async with the socket, sync with Ray.
@pytest.mark.parametrize(("mode", "transport"), [("async", "socket"), ("sync", "ray")])
def test_killed_inference_replicas_and_rollout_workers_are_replaced_and_the_books_balance(
    ray_session, tmp_path, monkeypatch, mode, transport
):
    monkeypatch.setitem(job.WORKLOADS, "embodied", KeptEmbodied)
    cfg = tiny_config(
        *EMBODIED,
        *(
            f"mode={mode}",
            "steps=5",
            f"experiment.inference_transport={transport}",
            "env.eval_workers=2",
        ),
    )
    run_dir = tmp_path / "run"
    how = ("ray.kill", "os.kill") if mode == "async" else ("os.kill", "ray.kill")
    kills = [(1, "inference_service", 0, how[0]), (3, "rollout_worker", 1, how[1])]
    kills.append((4, "evaluator", 1, how[0]))  # found by the final evaluation
    todo = _kill_at(monkeypatch, kills)
    summary = job.train(cfg, run_dir)
    assert todo == []

    assert summary["status"] == "finished" and summary["steps"] == 5
    failures = summary["failures"]
    assert [f["name"] for f in failures["inference_service"]] == ["inference_service"]
    assert [f["name"] for f in failures["rollout_worker"]] == ["rollout_worker_1"]
    assert [f["name"] for f in failures["evaluator"]] == ["evaluator_1"]
    assert summary["eval"]["end"]["n"] == cfg.env.eval_episodes
    samples = check_books(summary)
    assert samples["lost"] == 0  # nothing counted died: the buffer and the trainer live
    # A replica's requests in flight and an evaluator's episodes are in no books.
    others = failures["inference_service"] + failures["evaluator"]
    assert [f["unfinished"] for f in others] == [0, 0]
    (unfinished,) = [f["unfinished"] for f in failures["rollout_worker"]]
    if mode == "sync":  # killed between two rounds, whose last step closed each worker's segment
        assert unfinished == 0
    else:  # killed anywhere in its loop: the steps of its open segment (no env errors here)
        assert 0 <= unfinished < cfg.rollout.segment_len
    assert samples["lost_unfinished"] == unfinished
    # The replacement replica serves the trainer's last version.
    assert summary["perf"]["inference"]["versions"] == [summary["eval"]["end"]["version"]]


REPORTS: list = []  # by Reloaded: (what its replica says of it, its env steps) of each worker


def _reports(w: EmbodiedWorkload) -> list:
    return [
        (w.service_of(i).reported.remote(worker_id), worker.stats.remote())
        for i, (worker, worker_id) in enumerate(zip(w.workers, w.retired.ids, strict=True))
    ]


class Reloaded(KeptEmbodied):
    """Records ``REPORTS`` after each checkpoint reloads the rollout workers (``realign``) and
    each resume loads them."""

    async def realign(self, parts):
        await super().realign(parts)
        REPORTS.append([(await told, (await stats).env_steps) for told, stats in _reports(self)])

    def restore(self, parts):
        super().restore(parts)
        REPORTS.append([(ray.get(told), ray.get(s).env_steps) for told, s in _reports(self)])


def test_checkpoints_and_resumes_tell_the_replicas_the_books_they_load_the_workers_with(
    ray_session, tmp_path, monkeypatch
):
    """A reload drops a worker's open segment from its books; its replica heard the old count (a
    fresh one heard nothing) and would count those steps if it died before its next request.
    The run is stopped as by Ctrl-C (or SIGTERM) after step 2: summary.json's books come from
    the rollout workers, where an embodied run counts generation, and balance; its async
    resume keeps the books and the staleness bound."""

    class Stopping(MetricsLog):
        def log(self, step: int, metrics: dict) -> None:
            super().log(step, metrics)
            if step == 2:
                Checkpointer.request_stop()

    monkeypatch.setitem(job.WORKLOADS, "embodied", Reloaded)
    monkeypatch.setattr(job, "MetricsLog", Stopping)
    REPORTS.clear()
    run = ("mode=async", "max_staleness=1", "run.checkpoint_every=1")
    with pytest.raises(KeyboardInterrupt):
        job.train(tiny_config(*EMBODIED, *run, "steps=30"), tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] == 2
    samples = check_books(summary)
    assert samples["trained"] > 0 and "counted_by" not in samples
    monkeypatch.setattr(job, "MetricsLog", MetricsLog)
    resumed = job.train(tiny_config(*EMBODIED, *run, "steps=4"), tmp_path / "run", resume=True)
    # After step 1; after step 2 (the stop's); the resume from it; after step 3 (a run's last
    # step is not checkpointed).
    assert len(REPORTS) == 4
    for workers in REPORTS:
        assert [told for told, _ in workers] == [env_steps for _, env_steps in workers]
    # An async resume keeps the books and the staleness bound.
    samples = check_books(resumed)
    assert resumed["steps"] == 4 and resumed["resumes"][0]["step"] == 2
    assert resumed["resumes"][0]["dropped_resume"] == samples["dropped_resume"]
    assert resumed["staleness"]["max"] <= 1


class Doomed:
    """``seed -> env`` (BabyAI): the env of ``victim``'s seed crashes one step when the worker's
    open segment holds 2 steps (the worker drops them), and in the env the worker builds next,
    the step after the third of its open segment kills the worker's process. Its last closed
    segment is then 2 + 3 = 5 steps behind it. The plan starts again when an episode ends
    (closing a segment) between the two. Every step keeps to the worker's rule: a segment closes
    when its episode ends or it holds ``segment_len`` steps. ``killed`` is a file written just
    before the kill: the replacement worker (same seed) then gets a plain env, however many
    steps it takes before the run ends. Each time the plan starts again after a crash it adds a
    character to the file ``restarts`` beside it."""

    def __init__(self, ec: EnvConfig, victim: int, segment_len: int, killed: Path):
        self.ec, self.victim, self.segment_len, self.killed = ec, victim, segment_len, killed
        self.open = 0  # steps in the worker's open segment
        self.crashed = False  # since the worker's last closed segment

    def __call__(self, seed: int):
        env = build_env(self.ec, seed)
        doomed = seed == self.victim and not self.killed.exists()
        return _DoomedEnv(env, self) if doomed else env


class _DoomedEnv:
    def __init__(self, env, plan: Doomed):
        self.env, self.plan = env, plan
        self.action_space, self.tasks = env.action_space, env.tasks

    def reset(self, *, task=None, seed=None):
        return self.env.reset(task=task, seed=seed)

    def step(self, action):
        plan = self.plan
        if not plan.crashed and plan.open == 2:
            plan.crashed, plan.open = True, 0
            raise RuntimeError("simulator crashed")
        if plan.crashed and plan.open == 3:
            plan.killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        result = self.env.step(action)
        plan.open += 1
        if result.terminated or result.truncated or plan.open == plan.segment_len:
            if plan.crashed:  # a segment closed after the crash: the books hear of its 2 steps
                with plan.killed.with_name("restarts").open("a") as restarts:
                    restarts.write("1")
            plan.open, plan.crashed = 0, False
        return result

    def close(self):
        self.env.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_dead_rollout_workers_steps_after_its_last_segment_are_lost_unfinished(
    ray_session, tmp_path, mode
):
    # The env factory lives in this module, which Ray's workers cannot import.
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = tiny_config(*EMBODIED, f"mode={mode}")
    victim = cfg.run.seed + 1 + 1000  # rollout worker 0's env (EmbodiedWorkload._worker)
    doomed = Doomed(cfg.env, victim, cfg.rollout.segment_len, tmp_path / "killed")
    summary = job.train(cfg, tmp_path / "run", make_env=doomed)

    assert summary["status"] == "finished" and summary["steps"] == cfg.steps
    (failure,) = summary["failures"]["rollout_worker"]
    assert failure["name"] == "rollout_worker_0"
    # 2 steps an env error dropped and 3 open, all after its last closed segment. Not 6 (step
    # calls answered: the crashed one took no env step) nor 7 (actions served: the last one was
    # never taken).
    assert failure["unfinished"] == 5
    samples = check_books(summary)
    # Only crashes whose steps a later closed segment reported are dropped_error (2 each).
    restarts = tmp_path / "restarts"
    reported = len(restarts.read_text()) if restarts.exists() else 0
    assert samples["lost_unfinished"] == 5 and samples["dropped_error"] == 2 * reported
