"""A whole training job around one of the controller's loops: ``train``.

It claims nothing itself (the CLI claims the run directory); it saves the config, starts or joins
Ray, builds the workload and places its role table, connects weight sync, prepares the policy (or
resumes from a run checkpoint), runs ``controller.LOOPS[family, mode]`` (the loop family the
workload feeds), and writes the final checkpoint, trace, learning curve, report and
``summary.json``. Failures and interrupts end as ``failed`` / ``interrupted`` with what was
counted, at any phase. It touches a workload only through ``relayrl.workloads.Workload``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import ray

from relayrl.checkpoint import Checkpointer, merge_spans, resumes
from relayrl.config import Config, save_config
from relayrl.controller import LOOPS
from relayrl.envs.embodied import EmbodiedEnv
from relayrl.launch import connect_weight_sync, start_ray
from relayrl.observability.metrics import EssWatch, MetricsLog, RunTally, say
from relayrl.observability.plots import plot_learning_curve
from relayrl.observability.report import write_report
from relayrl.observability.tracing import busy_seconds, collect_spans, save_trace
from relayrl.recovery import ExecutorFailed, Recovery, dead_executor, first_line, is_death
from relayrl.workloads import WORKLOADS, Workload


def train(
    cfg: Config,
    run_dir: Path,
    make_env: Callable[[int], EmbodiedEnv] | None = None,
    *,
    resume: bool = False,
    workload: Workload | None = None,
) -> dict:
    """Run a whole job in ``run_dir`` and return its summary (also written to summary.json).

    ``make_env`` (seed -> env) replaces the env that ``cfg.env`` describes in an embodied run.
    ``resume`` continues the run in ``run_dir`` from its newest valid checkpoint instead of
    starting one: no warm start, metrics and trace go on from the checkpoint's step.
    ``workload`` runs instead of the one ``cfg.workload`` names (``relayrl.pipeline.Pipeline``
    builds one with executors of your own).
    """
    started = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    if workload is None:
        workload = WORKLOADS[cfg.workload](cfg, make_env)
    workload.run_dir = run_dir
    tally = RunTally(
        cfg.steps, cfg.log.progress, EssWatch(cfg.log.ess_warn_below, cfg.log.ess_warn_steps)
    )
    Checkpointer.clear_stop()
    ckpt = Checkpointer(cfg, run_dir, workload, tally, None)
    parts = ckpt.resume() if resume else None
    save_config(cfg, run_dir / "config.yaml")
    head = {"workload": cfg.workload, "mode": cfg.mode, "run_dir": str(run_dir)}
    head["resumes"] = resumes(run_dir)
    _write_summary(run_dir, head | {"status": "running", "steps": tally.steps})
    log = ckpt.log = MetricsLog(
        run_dir,
        cfg.log.tensorboard,
        cfg.log.wandb_project,
        cfg.log.wandb_mode,
        cfg.model_dump(mode="json"),
    )
    clock = {"rl_start": time.time(), "rl_end": time.time()}
    try:
        say("starting Ray" if cfg.ray.address is None else f"joining Ray at {cfg.ray.address}")
        start_ray(cfg)
        say(f"placing executors ({cfg.placement})")
        workload.place()
        placed = workload.placed.topology()
        say(f"placed on {placed['nodes']} node(s); connecting weight sync")
        sync = connect_weight_sync(cfg, workload.trainer, workload.placed.receivers())
        # From here a dead replica is replaced, in the loops and in evaluations alike.
        workload.recovery = Recovery(workload.placed, sync, tally)
        if parts is None:
            ckpt.context = {"sections": workload.prepare(log), "origin": started}
        else:
            ckpt.restore(parts)
        sections = dict(ckpt.context["sections"])
        say(f"RL: steps {tally.steps + 1}..{cfg.steps}, mode={cfg.mode}")
        tally.start()
        clock["rl_start"] = ckpt.rl_start = time.time()
        with ckpt.looping():
            run_loop = LOOPS[workload.family, cfg.mode]
            loop = asyncio.run(run_loop(cfg, workload, sync, tally, log, ckpt))
        clock["rl_end"] = time.time()
        tally.close()
        rl_wall = ckpt.context.get("rl_wall_s", 0.0) + clock["rl_end"] - clock["rl_start"]
        for key, value in workload.finish(tally, loop, rl_wall).items():
            sections[key] = sections.get(key, {}) | value
        end = sections["eval"]["end"]
        log.log(tally.steps, {f"eval/{k}": v for k, v in end.items() if k != "per_task"})
        checkpoint = ray.get(
            [rank.save_pretrained.remote(str(run_dir / "checkpoint")) for rank in workload.trainer]
        )[0]
        sync_summary = sync.summary()
        trace_start = time.time()
        spans = merge_spans(ckpt.spans, collect_spans(workload.placed.traced(), tally.idle))
        trace_s = time.time() - trace_start
    except BaseException as err:
        tally.close()
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        partial = {
            "status": status,
            "error": repr(err),
            "steps": tally.steps,
            "staleness": tally.staleness(),
            "samples": tally.books().section(),
            "failures": tally.failure_summary(),
        }
        try:  # where generation is counted (embodied: the workers); the executors may be gone
            partial |= {name: b.section() for name, b in workload.partial_books(tally).items()}
        except Exception as books_err:
            partial["samples"]["counted_by"] = f"controller ({first_line(books_err)})"
        if isinstance(err, ExecutorFailed):
            partial["failed_executor"] = err.name
        elif is_death(err):
            partial["failed_executor"] = dead_executor(err, workload.placed.all())
        if ckpt.written:
            partial["resume"] = f"relayrl train --resume {run_dir}"
            say(f"{status}; continue with: {partial['resume']}")
        _write_summary(run_dir, head | partial)
        window = (clock["rl_start"], time.time())
        with contextlib.suppress(Exception):  # best effort: the executors may be gone
            traced = workload.placed.traced()
            save_trace(run_dir, collect_spans(traced, tally.idle), started, window, 0)
        if cfg.log.report:
            with contextlib.suppress(Exception):
                write_report(run_dir)
        raise
    finally:
        log.close()
        if ray.is_initialized():
            workload.placed.stop()
    rl_start, rl_end = clock["rl_start"], clock["rl_end"]
    session_wall = rl_end - rl_start
    busy = {
        name: busy_seconds(b, rl_start, rl_end) / session_wall for name, (b, _) in spans.items()
    }
    trace_start = time.time()
    origin = ckpt.context["origin"]
    trace, timeline = save_trace(run_dir, spans, origin, (rl_start, rl_end), tally.steps)
    trace_s += time.time() - trace_start
    plot = plot_learning_curve(log.path, run_dir / "learning_curve.png", **workload.legend)
    perf = sections.pop("perf")
    summary = head | {
        "status": "finished",
        "wall_clock_s": time.time() - started,
        "steps": tally.steps,
        "updates": tally.updates,
        "skipped_nonfinite": tally.skipped_nonfinite,
        "failures": tally.failure_summary(),
        "topology": placed,
        **sections,
        "sync": sync_summary,
        "perf": {
            "step_time_s": rl_wall / tally.steps,
            "rl_wall_clock_s": rl_wall,
            **perf,
            "busy": busy | perf.get("busy", {}),
            "trace_write_s": trace_s,
        },
        "artifacts": {
            "checkpoint": checkpoint,
            "run_checkpoints": [str(p) for p in sorted((run_dir / "checkpoints").glob("step-*"))],
            "metrics": str(log.path),
            "learning_curve": str(plot),
            "trace": str(trace),
            "timeline": str(timeline),
            "report": str(run_dir / "report.md") if cfg.log.report else None,
            "config": str(run_dir / "config.yaml"),
        },
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
    }
    _write_summary(run_dir, summary)
    if cfg.log.report:
        write_report(run_dir)
    return summary


def _write_summary(run_dir: Path, summary: dict) -> None:
    text = json.dumps(summary, indent=2)
    (run_dir / "summary.json").write_text(text + "\n")
    print(text, flush=True)
