"""Embodied throughput: env steps per second the trainer consumes, sync (lockstep) against async
(streaming), as the number of rollout workers grows and the simulators straggle.

Both modes run the same embodied job (``configs/babyai.yaml`` unless told otherwise) with the
latency wrapper on every env (``env.latency``, lognormal with mean 20 ms and sigma 1.0 by default:
a heavy tail, the 99th percentile is about 6x the mean), for a fixed number of trainer steps at
each worker count. Learning is not the point: the runs are a few steps long. Runs go in one
process, interleaved sync, async per worker count, and share the embedded Ray instance that the
first ``train()`` starts (``train()`` kills its actors but leaves Ray up).

For each run it reports

- ``env_steps_per_s``: ``rollout.env_steps_per_s`` of ``summary.json``, env steps trained per
  second of the RL window (actor start-up that spills into the window and the first batch's fill
  included);
- ``steady_env_steps_per_s``: env steps trained between the end of the first and of the last
  trainer step, per second (from ``metrics.jsonl``): the rate once the pipeline is full;
- ``perf.busy``: the fraction of the RL window the trainer and the inference service spent
  working, and the rollout workers' mean fraction spent inside their env (latency sleep included);
- the inference service's mean batch and p95 per-request latency (over the whole run: the
  evaluations' lockstep batches are counted too), staleness, env-step accounting.

Per worker count it derives the async / sync ratio of both rates, and a compute-free latency bound
for each mode: async ``W / mean delay`` (every worker always stepping), sync ``W / E[max of W
delays]`` (a lockstep step waits for its slowest env), estimated from the wrapper's own
distribution.

Run from the repository root::

    python benchmarks/embodied_throughput.py                         # workers 2 4 8 16, 4 steps
    python benchmarks/embodied_throughput.py --workers 2 4 --steps 2  # a quick look
    python benchmarks/embodied_throughput.py --latency-mean-ms 50 --latency-sigma 1.5

It writes ``benchmarks/results/embodied_throughput.json`` and ``.png`` (with the command line and
the machine) and prints a Markdown table for ``docs/benchmarks.md``. The run directories of the
individual trainings are temporary and deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from statistics import mean

import matplotlib

matplotlib.use("Agg")  # benchmark machines have no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import provenance, relative, save_result  # noqa: E402

from relayrl.config import load_config  # noqa: E402
from relayrl.envs.latency import DELAYS  # noqa: E402
from relayrl.job import train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = ("sync", "async")
BUSY = ("trainer", "inference_service", "rollout_workers")
NAME = "embodied_throughput"
BOUND_DRAWS = 5_000  # delay draws per worker count for the latency bound


def main(argv: list[str] | None = None) -> int:
    """Run both modes at every worker count, write the JSON and the plot, print the table."""
    args = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-") as tmp:
        try:
            for repeat in range(args.repeats):
                for workers in args.workers:
                    for mode in args.modes:
                        print(
                            f"[{NAME}] repeat {repeat + 1}/{args.repeats}: {workers} workers, "
                            f"{mode}",
                            file=sys.stderr,
                        )
                        runs.append(run_once(args, mode, workers, repeat, Path(tmp)))
        finally:
            ray.shutdown()
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {
            "config": relative(str(args.config)),
            "steps": args.steps,
            "workers": args.workers,
            "modes": list(args.modes),
            "repeats": args.repeats,
            "latency": {
                "dist": args.latency,
                "mean_ms": args.latency_mean_ms,
                "sigma": args.latency_sigma,
            },
            "overrides": [relative(item) for item in args.overrides],
        },
        "config": runs[0]["config"],
        "points": summarise(runs, args),
        "runs": [{k: v for k, v in run.items() if k != "config"} for run in runs],
    }
    save_result(args.out, NAME, result, plot, markdown_table(result))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items applied to every run."""
    parser = argparse.ArgumentParser(
        description="Embodied env steps per second, sync vs async, against the number of rollout "
        "workers, with a latency wrapper on every env.",
    )
    parser.add_argument(
        "--config", type=Path, default=REPO / "configs" / "babyai.yaml", help="configs/babyai.yaml"
    )
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[2, 4, 8, 16], help="rollout worker counts"
    )
    parser.add_argument("--steps", type=int, default=4, help="trainer steps per run")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run (both)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per point, interleaved")
    parser.add_argument(
        "--latency",
        choices=["none", *DELAYS],
        default="lognormal",
        help="env.latency of every env, both modes (lognormal)",
    )
    parser.add_argument("--latency-mean-ms", type=float, default=20.0, help="env.latency_mean_ms")
    parser.add_argument("--latency-sigma", type=float, default=1.0, help="env.latency_sigma")
    parser.add_argument(
        "--eval-episodes",
        type=int,
        default=1,
        help="env.eval_episodes (evaluation runs outside the measured window; keep it short)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks" / "results",
        help="folder for the JSON and PNG (benchmarks/results)",
    )
    parser.add_argument("overrides", nargs="*", help="a.b=value config overrides for every run")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the steady rate needs two steps), got {args.steps}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if min(args.workers) < 1:
        parser.error(f"--workers must all be >= 1, got {args.workers}")
    if args.eval_episodes < 1:
        parser.error(f"--eval-episodes must be >= 1, got {args.eval_episodes}")
    args.workers = sorted(set(args.workers))
    args.modes = [mode for mode in MODES if mode in args.modes]
    return args


def run_once(args: argparse.Namespace, mode: str, workers: int, repeat: int, tmp: Path) -> dict:
    """Train one run and keep the numbers this benchmark reports."""
    cfg = load_config(
        args.config,
        [
            # Evaluation is outside the RL window; the fewest episodes and evaluators save time.
            f"env.eval_episodes={args.eval_episodes}",
            "env.eval_workers=1",
            *args.overrides,
            "workload=embodied",
            f"mode={mode}",
            f"steps={args.steps}",
            f"rollout.workers={workers}",
            f"env.latency={args.latency}",
            f"env.latency_mean_ms={args.latency_mean_ms}",
            f"env.latency_sigma={args.latency_sigma}",
            "log.every=1",  # the steady rate reads every step's row of metrics.jsonl
            "log.eval_every=0",
            "log.progress=false",
            "log.tensorboard=false",
            f"run.out_dir={tmp}",
        ],
    )
    # train() prints its summary JSON; keep stdout for the Markdown table.
    with contextlib.redirect_stdout(sys.stderr):
        summary = train(cfg, tmp / f"{mode}-{workers}-{repeat}")
    perf, rollout = summary["perf"], summary["rollout"]
    config = cfg.model_dump(mode="json", exclude={"mode", "steps"})
    config["run"]["out_dir"] = "(temporary)"
    del config["rollout"]["workers"]
    return {
        "mode": mode,
        "workers": workers,
        "repeat": repeat,
        "steps": summary["steps"],
        "env_steps_per_s": rollout["env_steps_per_s"],
        "steady_env_steps_per_s": steady_rate(Path(summary["artifacts"]["metrics"])),
        "generated_env_steps_per_s": rollout["generated_env_steps_per_s"],
        "busy": {name: perf["busy"][name] for name in BUSY},
        "inference": perf["inference"],
        "step_time_s": perf["step_time_s"],
        "rl_wall_clock_s": perf["rl_wall_clock_s"],
        "staleness": {key: summary["staleness"][key] for key in ("mean", "max", "max_staleness")},
        "samples": summary["samples"],
        "wall_clock_s": summary["wall_clock_s"],
        "config": config,
    }


def steady_rate(metrics: Path) -> float:
    """Env steps trained per second between the first and the last trainer step's log rows."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [row for row in rows if "samples/trained_total" in row]
    first, last = steps[0], steps[-1]
    return (last["samples/trained_total"] - first["samples/trained_total"]) / (
        last["time"] - first["time"]
    )


def latency_bound(dist: str, mean_ms: float, sigma: float, workers: int) -> dict[str, float]:
    """Env steps per second if the env delay were the only cost: async ``W / mean delay``, sync
    ``W / E[max of W delays]`` (Monte Carlo); None for both without a latency wrapper."""
    if dist == "none":
        return {"sync": None, "async": None}
    rng = np.random.default_rng(0)
    draws = np.array(
        [DELAYS[dist](rng, mean_ms, sigma) for _ in range(BOUND_DRAWS * workers)]
    ).reshape(BOUND_DRAWS, workers)
    return {
        "sync": workers * 1000.0 / float(draws.max(axis=1).mean()),
        "async": workers * 1000.0 / mean_ms,
    }


def summarise(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    """Per worker count: each mode's means over repeats, the latency bounds, the async/sync
    ratios."""
    points = []
    for workers in args.workers:
        point: dict = {
            "workers": workers,
            "latency_bound_env_steps_per_s": latency_bound(
                args.latency, args.latency_mean_ms, args.latency_sigma, workers
            ),
        }
        for mode in args.modes:
            mine = [run for run in runs if run["mode"] == mode and run["workers"] == workers]
            rates = [run["env_steps_per_s"] for run in mine]
            point[mode] = {
                "env_steps_per_s": {"mean": mean(rates), "values": rates},
                "steady_env_steps_per_s": mean(run["steady_env_steps_per_s"] for run in mine),
                "busy": {name: mean(run["busy"][name] for run in mine) for name in BUSY},
                "mean_batch": mean(run["inference"]["mean_batch"] for run in mine),
                "latency_ms_p95": mean(run["inference"]["latency_ms_p95"] for run in mine),
                "staleness_mean": mean(run["staleness"]["mean"] for run in mine),
                "samples_accounted": all(run["samples"]["accounted"] for run in mine),
            }
        if len(args.modes) == 2:
            sync, asyn = point["sync"], point["async"]
            point["ratio"] = {
                "env_steps_per_s": asyn["env_steps_per_s"]["mean"]
                / sync["env_steps_per_s"]["mean"],
                "steady_env_steps_per_s": asyn["steady_env_steps_per_s"]
                / sync["steady_env_steps_per_s"],
            }
        points.append(point)
    return points


def plot(result: dict, path: Path) -> Path:
    """Throughput against workers per mode (with the latency bounds), and busy fractions."""
    points = result["points"]
    modes = result["settings"]["modes"]
    workers = [p["workers"] for p in points]
    colors = {"sync": "tab:blue", "async": "tab:orange"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))

    for mode in modes:
        color = colors[mode]
        left.plot(
            workers,
            [p[mode]["env_steps_per_s"]["mean"] for p in points],
            "o-",
            color=color,
            label=f"{mode}: RL window",
        )
        left.plot(
            workers,
            [p[mode]["steady_env_steps_per_s"] for p in points],
            "s--",
            color=color,
            label=f"{mode}: steady (after step 1)",
        )
        bound = [p["latency_bound_env_steps_per_s"][mode] for p in points]
        if None not in bound:
            left.plot(workers, bound, "x:", color=color, label=f"{mode}: latency bound")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(workers, [str(w) for w in workers])
    left.set_xlabel("rollout workers")
    left.set_ylabel("env steps trained per second")
    left.set_title("throughput")
    left.legend(fontsize=7)

    styles = {"trainer": "o-", "inference_service": "s--"}
    for mode in modes:
        for name, style in styles.items():
            right.plot(
                workers,
                [p[mode]["busy"][name] for p in points],
                style,
                color=colors[mode],
                label=f"{mode}: {name}",
            )
    right.set_xscale("log", base=2)
    right.set_xticks(workers, [str(w) for w in workers])
    right.set_ylim(0, 1.05)
    right.set_xlabel("rollout workers")
    right.set_ylabel("busy fraction of the RL window")
    right.set_title("trainer and inference-service busy fraction")
    right.legend(fontsize=7)

    latency = result["settings"]["latency"]
    fig.suptitle(
        f"relayrl embodied throughput, {result['settings']['steps']} trainer steps per run, env "
        f"latency {latency['dist']} mean {latency['mean_ms']:g} ms sigma {latency['sigma']:g}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown_table(result: dict) -> str:
    """A table and a footer line to paste into docs/benchmarks.md."""
    modes = result["settings"]["modes"]
    both = len(modes) == 2
    head = ["workers"]
    for mode in modes:
        head += [
            f"{mode} env steps/s (window / steady)",
            f"{mode} busy trainer / inference",
            f"{mode} mean batch",
        ]
    if both:
        head += ["async / sync (window / steady)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in result["points"]:
        cells = [str(p["workers"])]
        for mode in modes:
            m = p[mode]
            accounted = "" if m["samples_accounted"] else " (NOT accounted)"
            cells += [
                f"{m['env_steps_per_s']['mean']:.0f} / {m['steady_env_steps_per_s']:.0f}"
                + accounted,
                f"{m['busy']['trainer']:.2f} / {m['busy']['inference_service']:.2f}",
                f"{m['mean_batch']:.1f}",
            ]
        if both:
            ratio = p["ratio"]
            cells.append(
                f"{ratio['env_steps_per_s']:.2f}x / {ratio['steady_env_steps_per_s']:.2f}x"
            )
        lines.append("| " + " | ".join(cells) + " |")
    latency = result["settings"]["latency"]
    lines += [
        "",
        f"Env latency {latency['dist']} mean {latency['mean_ms']:g} ms sigma "
        f"{latency['sigma']:g}; {result['settings']['steps']} trainer steps per run. "
        f"Command: `{result['command']}`; {result['machine']['platform']}, "
        f"{result['machine']['cpu_count']} CPUs, torch {result['machine']['torch']}, "
        f"ray {result['machine']['ray']}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
