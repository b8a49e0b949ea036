"""Async vs sync RL on the default config: wall-clock per RL step, busy fractions, overlap bound.

Both controller modes run the same job (``configs/arith.yaml`` unless told otherwise) in one
process, interleaved sync, async, sync, async, ... so they share the machine state and the
embedded Ray instance that the first ``train()`` call starts. Every run warm-starts as the config
says first, so generation lengths are realistic: a barely trained model generates max-length
garbage, a warm-started one stops at EOS.

For each mode it reports

- ``perf.step_time_s``: RL wall-clock per RL step (mean over repeats, and each value);
- ``perf.busy``: the fraction of the RL wall-clock each executor spent working;
- ``perf.phase_s_per_step``: generate, score and train time per step, timed inside the executors;
- staleness mean / max and whether every generated sample is accounted for.

From the sync runs, where nothing overlaps, it derives

- the overlap bound ``(gen + score + train) / max(gen, score, train)``: the best speed-up
  overlapping the three phases can give, and the best async step time it implies,
  ``sync_step_time / bound``;
- the per-step overhead ``step_time - (gen + score + train)``, split into weight sync (the time
  the trainer spends in ``publish`` and the generator in ``update_weights``, both timed inside the
  executors) and the rest: Ray calls, serialisation and channel hops, none of which any executor
  timer sees.

The measured speed-up is ``sync_step_time / async_step_time``.

Run from the repository root::

    python benchmarks/async_vs_sync.py                        # 100 RL steps per run, 1 repeat
    python benchmarks/async_vs_sync.py --steps 30             # quick check
    python benchmarks/async_vs_sync.py --repeats 3 ray.num_cpus=4

It writes ``benchmarks/results/async_vs_sync.json`` and ``.png`` (with the command line and the
machine) and prints a Markdown table for ``docs/benchmarks.md``. The run directories of the
individual trainings are temporary and deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path
from statistics import mean

import matplotlib
import matplotlib.pyplot as plt
import ray
from common import provenance, relative, save_result

from relayrl.config import load_config
from relayrl.job import train

matplotlib.use("Agg")  # benchmark machines have no display

REPO = Path(__file__).resolve().parents[1]
MODES = ("sync", "async")
PHASES = ("generate", "score", "train")
EXECUTORS = ("generator", "rewarder", "trainer")
NAME = "async_vs_sync"


def main(argv: list[str] | None = None) -> int:
    """Run both modes, write the JSON and the plot, print the Markdown table."""
    args = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-") as tmp:
        try:
            for repeat in range(args.repeats):
                for mode in MODES:
                    print(f"[{NAME}] repeat {repeat + 1}/{args.repeats}: {mode}", file=sys.stderr)
                    runs.append(run_once(args, mode, repeat, Path(tmp)))
        finally:
            ray.shutdown()
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {
            "config": relative(str(args.config)),
            "steps": args.steps,
            "repeats": args.repeats,
            "overrides": [relative(item) for item in args.overrides],
        },
        "config": runs[0]["config"],
        **summarise(runs),
        "runs": [{k: v for k, v in run.items() if k != "config"} for run in runs],
    }
    save_result(args.out, NAME, result, plot, markdown_table(result))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items applied to both modes."""
    parser = argparse.ArgumentParser(
        description="Run sync and async RL side by side; report step time, busy fractions and "
        "the overlap bound.",
    )
    parser.add_argument(
        "--config", type=Path, default=REPO / "configs" / "arith.yaml", help="configs/arith.yaml"
    )
    parser.add_argument("--steps", type=int, default=100, help="RL steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, interleaved")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks" / "results",
        help="folder for the JSON and PNG (benchmarks/results)",
    )
    parser.add_argument("overrides", nargs="*", help="a.b=value config overrides for both modes")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    return args


def run_once(args: argparse.Namespace, mode: str, repeat: int, tmp: Path) -> dict:
    """Train one run of ``mode`` and keep the numbers this benchmark reports."""
    cfg = load_config(
        args.config,
        [
            *args.overrides,
            f"mode={mode}",
            f"steps={args.steps}",
            "log.progress=false",
            "log.tensorboard=false",
            f"run.out_dir={tmp}",
        ],
    )
    # train() prints its summary JSON; keep stdout for the Markdown table.
    with contextlib.redirect_stdout(sys.stderr):
        summary = train(cfg, tmp / f"{mode}-{repeat}")
    if repeat == 0:  # the timeline of each mode's first run, for docs/benchmarks.md
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(summary["artifacts"]["timeline"], args.out / f"timeline_{mode}.png")
    perf = summary["perf"]
    config = cfg.model_dump(mode="json", exclude={"mode", "steps"})
    config["run"]["out_dir"] = "(temporary)"
    for key in ("path", "tokenizer"):
        if isinstance(config["model"][key], str):
            config["model"][key] = relative(config["model"][key])
    return {
        "mode": mode,
        "repeat": repeat,
        "steps": summary["steps"],
        "step_time_s": perf["step_time_s"],
        "rl_wall_clock_s": perf["rl_wall_clock_s"],
        "busy": perf["busy"],
        "phase_s_per_step": perf["phase_s_per_step"],
        "staleness": {key: summary["staleness"][key] for key in ("mean", "max", "max_staleness")},
        "samples": summary["samples"],
        "eval_accuracy": {when: summary["eval"][when]["accuracy"] for when in ("start", "end")},
        "wall_clock_s": summary["wall_clock_s"],
        "config": config,
    }


def summarise(runs: list[dict]) -> dict:
    """Per-mode means over repeats, the overlap bound, the speed-up and the sync overhead."""
    modes = {}
    for mode in MODES:
        mine = [run for run in runs if run["mode"] == mode]
        step_times = [run["step_time_s"] for run in mine]
        modes[mode] = {
            "step_time_s": {"mean": mean(step_times), "values": step_times},
            "busy": {name: mean(run["busy"][name] for run in mine) for name in EXECUTORS},
            "phase_s_per_step": {
                phase: mean(run["phase_s_per_step"][phase] for run in mine) for phase in PHASES
            },
            "staleness": {
                "mean": mean(run["staleness"]["mean"] for run in mine),
                "max": max(run["staleness"]["max"] for run in mine),
            },
            "samples_accounted": all(run["samples"]["accounted"] for run in mine),
            "eval_accuracy_end": mean(run["eval_accuracy"]["end"] for run in mine),
        }
    sync, asyn = modes["sync"], modes["async"]
    phases = sync["phase_s_per_step"]
    bound = sum(phases.values()) / max(phases.values())
    sync_step, async_step = sync["step_time_s"]["mean"], asyn["step_time_s"]["mean"]
    best_step = sync_step / bound
    return {
        "modes": modes,
        "overlap_bound": bound,
        "best_async_step_time_s": best_step,
        "speedup": sync_step / async_step,
        # Of the step time overlap could save at best, the share async actually saves.
        "saving_realised": (sync_step - async_step) / (sync_step - best_step),
        "sync_overhead": sync_overhead(sync),
    }


def sync_overhead(sync: dict) -> dict:
    """Split the sync step time not spent in generate, score or train.

    Executor busy time per step is ``busy * step_time``; what the generator and the trainer are
    busy with beyond generate and train is ``update_weights`` and ``publish``: weight sync. The
    rest is time no executor is working: Ray calls, serialisation, channel hops and the
    controller's own event loop. In sync mode nothing overlaps, so the split is exact.
    """
    step = sync["step_time_s"]["mean"]
    phases = sync["phase_s_per_step"]
    total = step - sum(phases.values())
    weight_sync = max(0.0, sync["busy"]["generator"] * step - phases["generate"]) + max(
        0.0, sync["busy"]["trainer"] * step - phases["train"]
    )
    return {
        "total_s_per_step": total,
        "weight_sync_s_per_step": weight_sync,
        "ray_and_controller_s_per_step": total - weight_sync,
        "fraction_of_step": total / step,
    }


def plot(result: dict, path: Path) -> Path:
    """Step time per mode (sync stacked by phase) and busy fraction per executor per mode."""
    modes = result["modes"]
    sync = modes["sync"]
    overhead = result["sync_overhead"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5))

    parts = {
        **{phase: sync["phase_s_per_step"][phase] for phase in PHASES},
        "weight sync": overhead["weight_sync_s_per_step"],
        "Ray + controller": overhead["ray_and_controller_s_per_step"],
    }
    bottom = 0.0
    for (label, height), color in zip(parts.items(), plt.cm.tab10.colors, strict=False):
        left.bar(0, height, bottom=bottom, color=color, label=f"sync: {label}")
        bottom += height
    left.bar(1, modes["async"]["step_time_s"]["mean"], color="0.55", label="async (overlapped)")
    for x, mode in enumerate(MODES):
        values = modes[mode]["step_time_s"]["values"]
        left.scatter([x] * len(values), values, color="black", s=12, zorder=3)
    left.axhline(
        result["best_async_step_time_s"],
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"sync / bound ({result['overlap_bound']:.2f}x)",
    )
    left.set_xticks(range(len(MODES)), MODES)
    left.set_ylabel("wall-clock per RL step (s)")
    left.set_title(f"step time (speed-up sync / async: {result['speedup']:.2f}x)")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)

    width = 0.38
    for offset, mode in enumerate(MODES):
        xs = [i + (offset - 0.5) * width for i in range(len(EXECUTORS))]
        busy = [modes[mode]["busy"][name] for name in EXECUTORS]
        right.bar(xs, busy, width, label=mode, color=("tab:blue", "tab:orange")[offset])
    right.set_xticks(range(len(EXECUTORS)), EXECUTORS)
    right.set_ylim(0, 1.05)
    right.set_ylabel("busy fraction of RL wall-clock")
    right.set_title("executor busy fraction")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)

    fig.suptitle(f"relayrl async vs sync ({result['settings']['steps']} steps)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown_table(result: dict) -> str:
    """A table and two summary lines to paste into docs/benchmarks.md."""
    modes = result["modes"]
    overhead = result["sync_overhead"]
    lines = [
        "| mode | step time (s) | generate (s) | score (s) | train (s) | overhead (s) "
        "| busy gen / rew / train | staleness mean / max | samples accounted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        m = modes[mode]
        phases = m["phase_s_per_step"]
        extra = f"{overhead['total_s_per_step']:.4f}" if mode == "sync" else "overlapped"
        busy = " / ".join(f"{m['busy'][name]:.2f}" for name in EXECUTORS)
        lines.append(
            f"| {mode} | {m['step_time_s']['mean']:.4f} | {phases['generate']:.4f} "
            f"| {phases['score']:.4f} | {phases['train']:.4f} | {extra} | {busy} "
            f"| {m['staleness']['mean']:.2f} / {m['staleness']['max']} "
            f"| {'yes' if m['samples_accounted'] else 'NO'} |"
        )
    lines += [
        "",
        f"Overlap bound from the sync phases: {result['overlap_bound']:.2f}x "
        f"(best async step {result['best_async_step_time_s']:.4f} s); measured speed-up "
        f"{result['speedup']:.2f}x (async realises {100 * result['saving_realised']:.0f}% of the "
        "step time overlap could save).",
        f"Sync overhead per step: {overhead['total_s_per_step'] * 1e3:.1f} ms "
        f"({100 * overhead['fraction_of_step']:.1f}% of the step) = weight sync "
        f"{overhead['weight_sync_s_per_step'] * 1e3:.1f} ms + Ray calls, serialisation and "
        f"channel hops {overhead['ray_and_controller_s_per_step'] * 1e3:.1f} ms.",
        f"Command: `{result['command']}`; {result['machine']['platform']}, "
        f"{result['machine']['cpu_count']} CPUs, torch {result['machine']['torch']}, "
        f"ray {result['machine']['ray']}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
