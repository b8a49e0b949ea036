"""The single controller: evaluate, RL in sync or async mode, evaluate, save; for both workloads.

LLM: the loops drive three executors by name — ``generator.generate``, ``rewarder.score``,
``trainer.train_step``, ``trainer.publish`` and ``generator.update_weights`` — and pass Ray object
references between them, so rollout tensors move executor to executor and never through here.

Embodied: rollout workers step one env each and get actions from the inference service; segments
reach ``trainer.train_step`` (sync: collected here in lockstep; async: streamed through the replay
buffer, which the trainer pulls from), and ``trainer.publish`` feeds
``inference_service.update_weights``. Both workloads share ``train()``: the run directory,
metrics, progress bar, trace, plots, report, summary and failure handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import platform
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import ray

from relayrl.algorithms.curriculum import Curriculum
from relayrl.algorithms.dwr import DynamicWeightedResampler
from relayrl.channels.local import Channel
from relayrl.config import Config, save_config
from relayrl.envs.embodied import EmbodiedEnv
from relayrl.launch import (
    BufferSink,
    EmbodiedExecutors,
    Executors,
    ServiceClient,
    build_env,
    connect_weight_sync,
    place_embodied,
    place_executors,
    set_task_weights,
    start_ray,
    stop_executors,
)
from relayrl.observability.metrics import MetricsLog, RunTally
from relayrl.observability.plots import plot_learning_curve, plot_timeline
from relayrl.observability.report import write_report
from relayrl.observability.tracing import Span, busy_seconds, chrome_trace, write_trace
from relayrl.types import Segment, StepResult


async def run_sync(cfg: Config, ex: Executors, tally: RunTally, log: MetricsLog) -> int:
    """generate -> score -> train -> publish, one after the other; returns samples in flight.

    A step's five calls are submitted at once as a chain of object references: Ray runs each when
    its input is ready and passes data executor to executor, so the controller waits once per step
    rather than once per call. Ray runs an actor's calls in submission order, so the next
    ``generate`` always comes after this step's ``update_weights``: strictly on-policy.
    """
    while tally.steps < cfg.steps:
        meta_ref, batch_ref = ex.generator.generate.options(num_returns=2).remote()
        score_ref, scored_ref = ex.rewarder.score.options(num_returns=2).remote(batch_ref)
        result_ref = ex.trainer.train_step.remote(scored_ref)
        ex.generator.update_weights.remote(ex.trainer.publish.remote())
        meta, score, result = await asyncio.gather(meta_ref, score_ref, result_ref)
        tally.on_generated(meta.samples, meta.busy_s)
        tally.on_scored(score["busy_s"], score["errors"], score["timeouts"])
        if meta.samples:
            await _log_step(cfg, tally, log, result, functools.partial(_evaluate, ex))
    return 0


async def run_async(cfg: Config, ex: Executors, tally: RunTally, log: MetricsLog) -> int:
    """Generation, scoring and training overlap, joined by bounded channels.

    The rollout loop starts batch ``i`` only once the trainer has consumed batch
    ``i - max_staleness`` (and queued its weights to the generator); each batch bumps the version
    at most once, so a batch reaches the trainer at most ``max_staleness`` versions old. The
    trainer still checks every token and drops (and counts) any group that is older.
    Returns the number of samples generated but not trained when the last step finished.
    """
    idle = tally.idle
    generated: Channel = Channel(
        cfg.channels.capacity, "generated", idle["generator"], idle["rewarder"]
    )
    scored: Channel = Channel(cfg.channels.capacity, "scored", idle["rewarder"], idle["trainer"])
    published = asyncio.Condition()
    scoring = {"samples": 0}

    async def rollout_loop() -> None:
        batches = 0

        def may_start() -> bool:
            return tally.steps >= batches - cfg.max_staleness

        while True:
            start = time.time()
            async with published:
                await published.wait_for(may_start)
            idle["generator"].wait("staleness gate", start, time.time())
            meta_ref, batch_ref = ex.generator.generate.options(num_returns=2).remote()
            meta = await meta_ref
            tally.on_generated(meta.samples, meta.busy_s)
            if meta.samples:
                batches += 1
                await generated.put((meta.samples, batch_ref))

    async def score_loop() -> None:
        while True:
            samples, batch_ref = await generated.get()
            scoring["samples"] = samples
            score_ref, scored_ref = ex.rewarder.score.options(num_returns=2).remote(batch_ref)
            score = await score_ref
            tally.on_scored(score["busy_s"], score["errors"], score["timeouts"])
            await scored.put((samples, scored_ref))
            scoring["samples"] = 0

    workers = [asyncio.create_task(rollout_loop()), asyncio.create_task(score_loop())]
    try:
        while tally.steps < cfg.steps:
            _, scored_ref = await _get_or_raise(scored, workers)
            result = await ex.trainer.train_step.remote(scored_ref)
            if result.stepped:
                ex.generator.update_weights.remote(ex.trainer.publish.remote())
            await _log_step(cfg, tally, log, result, functools.partial(_evaluate, ex))
            async with published:
                published.notify_all()
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    left = generated.close() + scored.close()
    return scoring["samples"] + sum(samples for samples, _ in left)


LOOPS = {"sync": run_sync, "async": run_async}


def _sync_summary(transport: str, trainer: dict, generator: dict) -> dict:
    """Weight-sync time per publish: the trainer's stall plus the generator's receive.

    The controller pairs every publish with one receive, so the two lists line up in order.
    """
    stall, receive = trainer["stall_s"], generator["receive_s"]
    total = [s + r for s, r in zip(stall, receive, strict=False)]
    return {
        "transport": transport,
        "publishes": len(total),
        "mean_s": sum(total) / max(len(total), 1),
        "max_s": max(total, default=0.0),
        "stall_mean_s": sum(stall) / max(len(stall), 1),
        "receive_mean_s": sum(receive) / max(len(receive), 1),
        "lost": trainer["lost"],
    }


async def run_lockstep(
    cfg: Config,
    ex: EmbodiedExecutors,
    tally: RunTally,
    log: MetricsLog,
    choice: TaskChoice,
) -> dict:
    """Embodied sync: collect in lockstep, train, publish, one after the other; no overlap.

    A round steps every worker with one batched forward pass for all observations until each has
    closed one segment (L steps or the end of its episode); rounds repeat until the super-batch
    holds ``replay.batch_steps`` env steps. No segment is left open between rounds, so every step
    trained was chosen by the current weights: every lag is 0.
    """
    while tally.steps < cfg.steps:
        start, segments = time.time(), []
        while sum(len(s) for s in segments) < cfg.replay.batch_steps:
            segments += await _lockstep(ex.workers, ex.inference_service, [1] * len(ex.workers))
        tally.on_generated(sum(len(s) for s in segments), time.time() - start)
        result = await ex.trainer.train_step.remote(segments)
        await ex.inference_service.update_weights.remote(ex.trainer.publish.remote())
        result.metrics |= await _episode_feedback(cfg, ex, choice, tally.steps + 1)
        await _log_step(cfg, tally, log, result, functools.partial(_evaluate_embodied, cfg, ex))
    return {"prefetched": 0, "occupancy": []}


async def run_streaming(
    cfg: Config,
    ex: EmbodiedExecutors,
    tally: RunTally,
    log: MetricsLog,
    choice: TaskChoice,
) -> dict:
    """Embodied async: workers, inference service and trainer each run their own loop.

    Every worker loops observe -> ``inference_service.act`` (dynamically batched with the other
    workers' requests) -> step, and puts each closed segment into the replay buffer. The trainer
    prefetches super-batches from the buffer, which drops segments more than ``max_staleness``
    versions old (the trainer checks again); after each step here the new weights go to the
    inference service, which drains its forward pass in flight before swapping them in.
    Returns the env steps of the super-batch prefetched but not trained, and the buffer occupancy
    after each step.
    """
    await ex.trainer.attach_buffer.remote(ex.replay_buffer, cfg.replay.batch_steps)
    service, sink = ServiceClient(ex.inference_service), BufferSink(ex.replay_buffer)
    runs = [asyncio.ensure_future(w.run.remote(service, sink)) for w in ex.workers]
    occupancy = []
    while tally.steps < cfg.steps:
        result = await _first_or_raise(ex.trainer.train_next.remote(), runs)
        if result.stepped:
            ex.inference_service.update_weights.remote(ex.trainer.publish.remote())
        result.metrics |= await _episode_feedback(cfg, ex, choice, tally.steps + 1)
        occupancy.append((await ex.replay_buffer.stats.remote())["occupancy"])
        result.metrics["replay/occupancy"] = occupancy[-1]
        await _log_step(cfg, tally, log, result, functools.partial(_evaluate_embodied, cfg, ex))
    await asyncio.gather(*(w.stop.remote() for w in ex.workers))
    await asyncio.gather(*runs)  # each run returns after its last put
    # No more puts: closing the buffer ends a fetch still waiting, so what the trainer holds is
    # exact.
    await ex.replay_buffer.close.remote()
    return {"prefetched": await ex.trainer.stop_prefetch.remote(), "occupancy": occupancy}


EMBODIED_LOOPS = {"sync": run_lockstep, "async": run_streaming}


def train(cfg: Config, run_dir: Path, make_env: Callable[[int], EmbodiedEnv] | None = None) -> dict:
    """Run a whole job in ``run_dir`` and return its summary (also written to summary.json).

    ``make_env`` (seed -> env) replaces the env that ``cfg.env`` describes in an embodied run.
    """
    started = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    summary: dict = {
        "workload": cfg.workload,
        "mode": cfg.mode,
        "status": "running",
        "run_dir": str(run_dir),
        "steps": 0,
    }
    _write_summary(run_dir, summary)
    start_ray(cfg)
    if cfg.workload == "llm":
        ex = place_executors(cfg)
    else:
        ex = place_embodied(cfg, make_env or functools.partial(build_env, cfg.env))
    log = MetricsLog(
        run_dir,
        cfg.log.tensorboard,
        cfg.log.wandb_project,
        cfg.log.wandb_mode,
        cfg.model_dump(mode="json"),
    )
    tally = RunTally(cfg.steps, cfg.log.progress)
    clock = {"rl_start": time.time(), "rl_end": time.time()}
    try:
        sections = JOBS[cfg.workload](cfg, ex, tally, log, clock)
        trace_start = time.time()
        spans = _collect_spans(ex, tally)
        trace_s = time.time() - trace_start
    except BaseException as err:
        tally.close()
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        partial = {
            "status": status,
            "error": repr(err),
            "steps": tally.steps,
            "staleness": tally.staleness(),
            "samples": {
                "generated": tally.generated,
                "trained": tally.trained,
                "dropped_stale": tally.dropped_stale,
            },
        }
        _write_summary(run_dir, summary | partial)
        window = (clock["rl_start"], time.time())
        with contextlib.suppress(Exception):  # best effort: the executors may be gone
            _save_trace(run_dir, _collect_spans(ex, tally), started, window, 0)
        with contextlib.suppress(Exception):
            write_report(run_dir)
        raise
    finally:
        log.close()
        stop_executors(ex)
    rl_start, rl_end = clock["rl_start"], clock["rl_end"]
    rl_wall = rl_end - rl_start
    busy = {name: busy_seconds(b, rl_start, rl_end) / rl_wall for name, (b, _) in spans.items()}
    trace_start = time.time()
    trace, timeline = _save_trace(run_dir, spans, started, (rl_start, rl_end), tally.steps)
    trace_s += time.time() - trace_start
    legend = {}
    if cfg.workload == "embodied":
        legend["eval_label"] = (
            f"evaluation success ({'greedy' if cfg.env.eval_greedy else 'sampled'})"
        )
    plot = plot_learning_curve(log.path, run_dir / "learning_curve.png", **legend)
    perf, checkpoint = sections.pop("perf"), sections.pop("checkpoint")
    summary = {
        "workload": cfg.workload,
        "mode": cfg.mode,
        "status": "finished",
        "run_dir": str(run_dir),
        "wall_clock_s": time.time() - started,
        "steps": tally.steps,
        "updates": tally.updates,
        **sections,
        "perf": {
            "step_time_s": rl_wall / tally.steps,
            "rl_wall_clock_s": rl_wall,
            **perf,
            "busy": busy | perf.get("busy", {}),
            "trace_write_s": trace_s,
        },
        "artifacts": {
            "checkpoint": checkpoint,
            "metrics": str(log.path),
            "learning_curve": str(plot),
            "trace": str(trace),
            "timeline": str(timeline),
            "report": str(run_dir / "report.md"),
            "config": str(run_dir / "config.yaml"),
        },
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
    }
    _write_summary(run_dir, summary)
    write_report(run_dir)
    return summary


def _llm_job(
    cfg: Config, ex: Executors, tally: RunTally, log: MetricsLog, clock: dict[str, float]
) -> dict:
    """Warm start, evaluate, RL, evaluate, checkpoint; returns the LLM sections of the summary."""
    transport = connect_weight_sync(cfg, ex)
    warm = _warm_start(cfg, ex)
    eval_start = asyncio.run(_evaluate(ex))
    log.log(0, {**{f"eval/{k}": v for k, v in eval_start.items()}, **warm})
    tally.start()
    clock["rl_start"] = time.time()
    in_flight = asyncio.run(LOOPS[cfg.mode](cfg, ex, tally, log))
    clock["rl_end"] = time.time()
    tally.close()
    eval_end = asyncio.run(_evaluate(ex))
    log.log(tally.steps, {f"eval/{k}": v for k, v in eval_end.items()})
    checkpoint = ray.get(ex.trainer.save_pretrained.remote(str(log.path.parent / "checkpoint")))
    pending = ray.get(ex.generator.stats.remote())["pending"]
    sync = _sync_summary(
        transport, *ray.get([ex.trainer.sync_stats.remote(), ex.generator.sync_stats.remote()])
    )
    per_step = {name: sum(times) / tally.steps for name, times in _phase_times(tally).items()}
    return {
        "warm_start": warm,
        "eval": {"start": eval_start, "end": eval_end},
        "perf": {
            "phase_s_per_step": per_step,
            "overlap_bound": sum(per_step.values()) / max(per_step.values()),
        },
        "staleness": tally.staleness() | {"max_staleness": cfg.max_staleness},
        "sync": sync,
        "samples": {
            "generated": tally.generated,
            "trained": tally.trained,
            "dropped_stale": tally.dropped_stale,
            "in_flight": in_flight,
            "accounted": tally.generated == tally.trained + tally.dropped_stale + in_flight,
            "unfinished_partials": pending,
            "score_errors": tally.score_errors,
            "score_timeouts": tally.score_timeouts,
        },
        "checkpoint": checkpoint,
    }


def _embodied_job(
    cfg: Config, ex: EmbodiedExecutors, tally: RunTally, log: MetricsLog, clock: dict[str, float]
) -> dict:
    """Publish version 0, evaluate, RL, evaluate, checkpoint; returns the embodied sections.

    Samples are env steps: every step a worker took is trained, dropped (stale, evicted from a
    full buffer, or lost with a crashed env's unfinished segment) or still in flight (resident in
    the buffer, prefetched by the trainer, or in a worker's open segment).
    """
    transport = connect_weight_sync(cfg, ex)
    ray.get(ex.inference_service.update_weights.remote(ex.trainer.publish.remote()))
    if cfg.env.eval_tasks is not None:
        unknown = sorted(set(cfg.env.eval_tasks) - set(ex.tasks))
        if unknown or not cfg.env.eval_tasks:
            raise ValueError(
                f"env.eval_tasks={cfg.env.eval_tasks} must be a non-empty subset of the env's "
                f"tasks {list(ex.tasks)}; unknown: {unknown}"
            )
        weights = [float(t in cfg.env.eval_tasks) for t in ex.tasks]
        ray.get([w.__ray_call__.remote(set_task_weights, weights) for w in ex.evaluators])
    eval_start = asyncio.run(_evaluate_embodied(cfg, ex))
    log.log(0, {f"eval/{k}": v for k, v in eval_start.items() if k != "per_task"})
    choice = TaskChoice(cfg, ex.tasks)
    ray.get([w.__ray_call__.remote(set_task_weights, choice.weights()) for w in ex.workers])
    tally.start()
    clock["rl_start"] = time.time()
    loop = asyncio.run(EMBODIED_LOOPS[cfg.mode](cfg, ex, tally, log, choice))
    clock["rl_end"] = time.time()
    tally.close()
    rl_wall = clock["rl_end"] - clock["rl_start"]
    eval_end = asyncio.run(_evaluate_embodied(cfg, ex))
    log.log(tally.steps, {f"eval/{k}": v for k, v in eval_end.items() if k != "per_task"})
    checkpoint = ray.get(ex.trainer.save_pretrained.remote(str(log.path.parent / "checkpoint")))
    workers = ray.get([w.stats.remote() for w in ex.workers])
    trainer, service, buffer = ray.get(
        [
            ex.trainer.stats.remote(),
            ex.inference_service.stats.remote(),
            ex.replay_buffer.stats.remote(),
        ]
    )
    sync = _sync_summary(
        transport,
        *ray.get([ex.trainer.sync_stats.remote(), ex.inference_service.sync_stats.remote()]),
    )
    generated = sum(w["env_steps"] for w in workers)
    dropped = {
        "dropped_stale": trainer["dropped_stale"] + buffer["dropped_stale_steps"],
        "dropped_overflow": buffer["dropped_overflow_steps"],
        "dropped_error": sum(w["dropped_error_steps"] for w in workers),
    }
    in_flight = {
        "resident": buffer["resident_steps"],
        "prefetched": loop["prefetched"],
        "open": sum(w["open_steps"] for w in workers),
    }
    tasks: dict[str, dict[str, float]] = {}
    for w in workers:
        for task, counts in w["tasks"].items():
            mine = tasks.setdefault(task, {"episodes": 0, "successes": 0})
            mine["episodes"] += counts["episodes"]
            mine["successes"] += counts["successes"]
    episodes = sum(t["episodes"] for t in tasks.values())
    occupancy = loop["occupancy"]
    return {
        "eval": {"start": eval_start, "end": eval_end},
        "rollout": {
            "env_steps_per_s": trainer["trained"] / rl_wall,
            "generated_env_steps_per_s": generated / rl_wall,
            "episodes": episodes,
            "success_rate": {
                "overall": sum(t["successes"] for t in tasks.values()) / max(episodes, 1),
                "per_task": {k: t["successes"] / max(t["episodes"], 1) for k, t in tasks.items()},
            },
            "env_errors": sum(w["env_errors"] for w in workers),
            "last_errors": [e for w in workers for e in w["last_errors"]][-5:],
            "workers": len(workers),
        },
        "perf": {
            "busy": {"rollout_workers": sum(w["busy_s"] for w in workers) / len(workers) / rl_wall},
            "inference": {
                k: service[k]
                for k in ("requests", "forwards", "mean_batch", "latency_ms_p50", "latency_ms_p95")
            },
        },
        "staleness": tally.staleness() | {"max_staleness": cfg.max_staleness},
        "replay": {
            "capacity_steps": cfg.replay.capacity_steps,
            "occupancy_mean": sum(occupancy) / max(len(occupancy), 1),
            "occupancy_end": buffer["occupancy"],
            "reader_wait_s": buffer["reader_wait_s"],
        },
        "dwr": {"enabled": cfg.rollout.dwr, "weights": choice.dwr.weights()},
        "curriculum": choice.summary(),
        "sync": sync,
        "samples": {
            "unit": "env_steps",
            "generated": generated,
            "trained": trainer["trained"],
            **dropped,
            "in_flight": sum(in_flight.values()),
            **{f"in_flight_{k}": v for k, v in in_flight.items()},
            "accounted": generated
            == trainer["trained"] + sum(dropped.values()) + sum(in_flight.values()),
        },
        "checkpoint": checkpoint,
    }


JOBS = {"llm": _llm_job, "embodied": _embodied_job}


async def _lockstep(
    workers: list, service, quotas: list[int], *, greedy: bool = False
) -> list[Segment]:
    """Step workers in lockstep, one batched forward pass per step for all of them, until worker
    ``i`` has closed ``quotas[i]`` segments; returns the closed segments."""
    closed: list[Segment] = []
    left = list(quotas)
    while any(n > 0 for n in left):
        active = [i for i, n in enumerate(left) if n > 0]
        observations = await asyncio.gather(*(workers[i].observe.remote() for i in active))
        replies = await service.act_batch.remote(observations, greedy=greedy)
        steps = [
            workers[i].step.remote(r.actions, r.logprobs, r.value, r.version)
            for i, r in zip(active, replies, strict=True)
        ]
        for i, segments in zip(active, await asyncio.gather(*steps), strict=True):
            closed += segments
            left[i] -= len(segments)
    return closed


async def _evaluate_embodied(cfg: Config, ex: EmbodiedExecutors) -> dict:
    """Success rate of the inference service's policy on ``env.eval_episodes`` fresh episodes,
    played in lockstep by the evaluators (whose episodes are never trained on)."""
    start = time.time()
    version = (await ex.inference_service.stats.remote())["version"]
    workers = ex.evaluators
    n, k = cfg.env.eval_episodes, len(workers)
    quotas = [n // k + (i < n % k) for i in range(k)]
    await _lockstep(workers, ex.inference_service, quotas, greedy=cfg.env.eval_greedy)
    results = [
        r for rs in await asyncio.gather(*(w.episode_results.remote() for w in workers)) for r in rs
    ]
    per_task: dict[str, list[bool]] = {}
    for r in results:
        per_task.setdefault(r.task, []).append(r.success)
    rate = sum(r.success for r in results) / max(len(results), 1)
    return {
        "accuracy": rate,  # the name the report and learning curve read
        "success_rate": rate,
        "n": len(results),
        "episode_len": sum(r.length for r in results) / max(len(results), 1),
        "version": version,
        "time_s": time.time() - start,
        "per_task": {task: sum(s) / len(s) for task, s in per_task.items()},
    }


class TaskChoice:
    """How each new training episode's task is drawn: DWR's weights (uniform when DWR is off),
    with the stages the curriculum has not opened yet masked out."""

    def __init__(self, cfg: Config, tasks: tuple[str, ...]):
        r = cfg.rollout
        self.use_dwr = r.dwr
        self.dwr = DynamicWeightedResampler(
            tasks, window=r.dwr_window, alpha=r.dwr_alpha, seed=cfg.run.seed
        )
        self.curriculum = (
            Curriculum(
                tasks,
                promote_at=r.curriculum_promote_at,
                window=r.curriculum_window,
                max_steps_per_stage=r.curriculum_max_steps,
                review=r.curriculum_review,
            )
            if r.curriculum
            else None
        )

    def record(self, task: str, success: bool) -> None:
        """One finished training episode."""
        self.dwr.record(task, success)
        if self.curriculum is not None:
            self.curriculum.record(task, success)

    def weights(self) -> list[float]:
        """The task weights the workers draw with, in the env's task order."""
        base = self.dwr.weights() if self.use_dwr else dict.fromkeys(self.dwr.tasks, 1.0)
        if self.curriculum is not None:
            return self.curriculum.apply(base)
        total = sum(base.values())
        return [w / total for w in base.values()]

    def summary(self) -> dict:
        """The curriculum's section of summary.json."""
        c = self.curriculum
        if c is None:
            return {"enabled": False}
        return {
            "enabled": True,
            "stages": list(c.stages),
            "stage": c.current,
            "opened_at_step": dict(zip(c.stages, c.opened_at, strict=False)),
            "stage_success_rate": c.success_rate(),
        }


async def _episode_feedback(
    cfg: Config, ex: EmbodiedExecutors, choice: TaskChoice, step: int
) -> dict[str, float]:
    """Drain the workers' finished episodes into DWR and the curriculum, push the new task
    weights to the workers' samplers, and return the rollout success rate of those episodes."""
    drained = await asyncio.gather(*(w.episode_results.remote() for w in ex.workers))
    results = [r for rs in drained for r in rs]
    for r in results:
        choice.record(r.task, r.success)
    opened = choice.curriculum.advance(step) if choice.curriculum is not None else None
    if opened is not None or (cfg.rollout.dwr and results):
        weights = choice.weights()
        for worker in ex.workers:
            worker.__ray_call__.remote(set_task_weights, weights)
    out = {"rollout/episodes": float(len(results))}
    if results:
        out["rollout/success_rate"] = sum(r.success for r in results) / len(results)
    if choice.curriculum is not None:
        out["curriculum/stage"] = float(choice.curriculum.stage)
    return out


async def _first_or_raise(ref: ray.ObjectRef, workers: list[asyncio.Future]):
    """``await ref``, but re-raise at once if a worker loop died instead of waiting forever."""
    main = asyncio.ensure_future(ref)
    done, _ = await asyncio.wait({main, *workers}, return_when=asyncio.FIRST_COMPLETED)
    for task in workers:
        if task in done:
            main.cancel()
            task.result()
            raise RuntimeError("a rollout worker's run loop returned before it was stopped")
    return main.result()


def _warm_start(cfg: Config, ex: Executors) -> dict:
    """Supervised slices until the probe accuracy reaches the target; publishes version 0."""
    ws, steps, probe = cfg.warm_start, 0, 0.0
    metrics: dict = {}
    while steps < ws.max_steps:
        metrics = ray.get(ex.trainer.warm_start.remote(min(ws.check_every, ws.max_steps - steps)))
        steps += min(ws.check_every, ws.max_steps - steps)
        if ws.target_accuracy > 0:
            ray.get(ex.generator.update_weights.remote(ex.trainer.publish.remote()))
            probe = asyncio.run(_evaluate(ex, "probe"))["accuracy"]
            if probe >= ws.target_accuracy:
                break
    ray.get(ex.generator.update_weights.remote(ex.trainer.publish.remote()))
    return metrics | {"warm_start/steps": steps, "warm_start/probe_accuracy": probe}


async def _log_step(
    cfg: Config,
    tally: RunTally,
    log: MetricsLog,
    result: StepResult,
    evaluate: Callable[[], Awaitable[dict]],
) -> None:
    """Log a finished train step; every ``log.eval_every`` steps also ``evaluate()``."""
    out = tally.on_trained(result)
    if tally.steps % cfg.log.every == 0 or tally.steps == cfg.steps:
        log.log(tally.steps, out)
    if cfg.log.eval_every and tally.steps % cfg.log.eval_every == 0 and tally.steps < cfg.steps:
        result = await evaluate()
        log.log(tally.steps, {f"eval/{k}": v for k, v in result.items() if k != "per_task"})


async def _get_or_raise(channel: Channel, workers: list[asyncio.Task]):
    """``channel.get()``, but re-raise at once if a worker loop died instead of waiting forever."""
    get = asyncio.ensure_future(channel.get())
    done, _ = await asyncio.wait({get, *workers}, return_when=asyncio.FIRST_COMPLETED)
    for task in workers:
        if task in done:
            get.cancel()
            task.result()
    return get.result()


async def _evaluate(ex: Executors, split: str = "heldout") -> dict:
    """Greedy accuracy of the generator's current policy on a split, and what it cost."""
    start = time.time()
    batch_ref = ex.generator.evaluate.remote(split)
    score_ref, _ = ex.rewarder.score.options(num_returns=2).remote(batch_ref)
    score = await score_ref
    version = (await ex.generator.stats.remote())["version"]
    return {
        "accuracy": score["reward_mean"],
        "n": score["samples"],
        "version": version,
        "time_s": time.time() - start,
    }


def _collect_spans(
    ex: Executors | EmbodiedExecutors, tally: RunTally
) -> dict[str, tuple[list[Span], list[Span]]]:
    """Each executor's busy spans, and its waits: its own plus those the controller saw."""
    traced = ex.traced()
    traces = ray.get([handle.trace.remote() for handle in traced.values()], timeout=60)
    seen = {name: idle.waits for name, idle in tally.idle.items()}
    return {
        name: (busy, sorted(waits + seen.get(name, []), key=lambda s: s.start))
        for name, (busy, waits) in zip(traced, traces, strict=True)
    }


def _save_trace(
    run_dir: Path, spans: dict, origin: float, window: tuple[float, float], steps: int
) -> tuple[Path, Path]:
    """trace.json (all spans, RL window and busy fractions in ``otherData``) and timeline.png."""
    start, end = window
    trace = chrome_trace(spans, origin)
    trace["otherData"] = {
        "rl_window_us": [(start - origin) * 1e6, (end - origin) * 1e6],
        "busy": {
            n: busy_seconds(b, start, end) / max(end - start, 1e-9) for n, (b, _) in spans.items()
        },
    }
    step = (end - start) / max(steps, 1)
    middle = (start + end) / 2
    shown = (max(start, middle - 4 * step), min(end, middle + 4 * step))
    return (
        write_trace(run_dir / "trace.json", trace),
        plot_timeline(spans, run_dir / "timeline.png", shown, trace["otherData"]["busy"]),
    )


def _phase_times(tally: RunTally) -> dict[str, list[float]]:
    return {"generate": tally.gen_s, "score": tally.score_s, "train": tally.train_s}


def _write_summary(run_dir: Path, summary: dict) -> None:
    text = json.dumps(summary, indent=2)
    (run_dir / "summary.json").write_text(text + "\n")
    print(text, flush=True)
