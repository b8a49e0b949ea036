"""The single controller: warm start, evaluate, RL in sync or async mode, evaluate, save.

Both modes drive the same three executors by name — ``generator.generate``, ``rewarder.score``,
``trainer.train_step``, ``trainer.publish`` and ``generator.update_weights`` — and pass Ray object
references between them, so rollout tensors move executor to executor and never through here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import platform
import time
from pathlib import Path

import ray

from relayrl.channels.local import Channel
from relayrl.config import Config, save_config
from relayrl.launch import (
    Executors,
    connect_weight_sync,
    place_executors,
    start_ray,
    stop_executors,
)
from relayrl.observability.metrics import MetricsLog, RunTally
from relayrl.observability.plots import plot_learning_curve, plot_timeline
from relayrl.observability.report import write_report
from relayrl.observability.tracing import Span, busy_seconds, chrome_trace, write_trace


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
        metrics_ref = ex.trainer.train_step.remote(scored_ref)
        ex.generator.update_weights.remote(ex.trainer.publish.remote())
        meta, score, metrics = await asyncio.gather(meta_ref, score_ref, metrics_ref)
        tally.on_generated(meta.samples, meta.busy_s)
        tally.on_scored(score["busy_s"], score["errors"], score["timeouts"])
        if meta.samples:
            await _log_step(cfg, ex, tally, log, metrics)
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
            metrics = await ex.trainer.train_step.remote(scored_ref)
            if metrics["stepped"]:
                ex.generator.update_weights.remote(ex.trainer.publish.remote())
            await _log_step(cfg, ex, tally, log, metrics)
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


def train(cfg: Config, run_dir: Path) -> dict:
    """Run a whole LLM job in ``run_dir`` and return its summary (also written to summary.json)."""
    started = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    summary: dict = {"mode": cfg.mode, "status": "running", "run_dir": str(run_dir), "steps": 0}
    _write_summary(run_dir, summary)
    start_ray(cfg)
    ex = place_executors(cfg)
    transport = connect_weight_sync(cfg, ex)
    log = MetricsLog(
        run_dir,
        cfg.log.tensorboard,
        cfg.log.wandb_project,
        cfg.log.wandb_mode,
        cfg.model_dump(mode="json"),
    )
    tally = RunTally(cfg.steps, cfg.log.progress)
    rl_start = rl_end = time.time()
    try:
        warm = _warm_start(cfg, ex)
        eval_start = asyncio.run(_evaluate(ex))
        log.log(0, {**{f"eval/{k}": v for k, v in eval_start.items()}, **warm})
        tally.start()
        rl_start = time.time()
        in_flight = asyncio.run(LOOPS[cfg.mode](cfg, ex, tally, log))
        rl_end = time.time()
        tally.close()
        trace_start = time.time()
        spans = _collect_spans(ex, tally)
        trace_s = time.time() - trace_start
        eval_end = asyncio.run(_evaluate(ex))
        log.log(tally.steps, {f"eval/{k}": v for k, v in eval_end.items()})
        checkpoint = ray.get(ex.trainer.save_pretrained.remote(str(run_dir / "checkpoint")))
        pending = ray.get(ex.generator.stats.remote())["pending"]
        sync = _sync_summary(
            transport, *ray.get([ex.trainer.sync_stats.remote(), ex.generator.sync_stats.remote()])
        )
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
        with contextlib.suppress(Exception):  # best effort: the executors may be gone
            _save_trace(run_dir, _collect_spans(ex, tally), started, (rl_start, time.time()), 0)
        with contextlib.suppress(Exception):
            write_report(run_dir)
        raise
    finally:
        log.close()
        stop_executors(ex)
    rl_wall = rl_end - rl_start
    busy = {name: busy_seconds(b, rl_start, rl_end) / rl_wall for name, (b, _) in spans.items()}
    trace_start = time.time()
    trace, timeline = _save_trace(run_dir, spans, started, (rl_start, rl_end), tally.steps)
    trace_s += time.time() - trace_start
    plot = plot_learning_curve(log.path, run_dir / "learning_curve.png")
    per_step = {name: sum(times) / tally.steps for name, times in _phase_times(tally).items()}
    summary = {
        "mode": cfg.mode,
        "status": "finished",
        "run_dir": str(run_dir),
        "wall_clock_s": time.time() - started,
        "steps": tally.steps,
        "updates": tally.updates,
        "warm_start": warm,
        "eval": {"start": eval_start, "end": eval_end},
        "perf": {
            "step_time_s": rl_wall / tally.steps,
            "rl_wall_clock_s": rl_wall,
            "busy": busy,
            "phase_s_per_step": per_step,
            "overlap_bound": sum(per_step.values()) / max(per_step.values()),
            "trace_write_s": trace_s,
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
    cfg: Config, ex: Executors, tally: RunTally, log: MetricsLog, metrics: dict
) -> None:
    """Log a finished train step; every ``log.eval_every`` steps also evaluate held-out."""
    out = tally.on_trained(metrics)
    if tally.steps % cfg.log.every == 0 or tally.steps == cfg.steps:
        log.log(tally.steps, out)
    if cfg.log.eval_every and tally.steps % cfg.log.eval_every == 0 and tally.steps < cfg.steps:
        result = await _evaluate(ex)
        log.log(tally.steps, {f"eval/{k}": v for k, v in result.items()})


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


def _collect_spans(ex: Executors, tally: RunTally) -> dict[str, tuple[list[Span], list[Span]]]:
    """Each executor's busy spans, and its waits: its own plus those the controller saw."""
    traces = ray.get([handle.trace.remote() for handle in ex.all().values()], timeout=60)
    return {
        name: (busy, sorted(waits + tally.idle[name].waits, key=lambda s: s.start))
        for name, (busy, waits) in zip(ex.all(), traces, strict=True)
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
