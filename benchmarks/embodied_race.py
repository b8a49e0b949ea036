"""Time to S7N4 success: the single-process reference against the pipeline, in one run.

The reference (``benchmarks/babyai_reference.py --summary-only``: the same policy and curriculum,
one process, one thread, PPO-clip, nothing stale; its stages open on success only, where the
config's also open after ``rollout.curriculum_max_steps``) runs first and stops once its rollout
success on the last stage, over its last 200 episodes, reaches ``--target``. Then ``relayrl train
configs/babyai.yaml`` with ``overrides`` runs for ``--steps`` trainer steps. Both are judged by
the same measure: the pipeline's time to target is the wall clock from the start of the job
(start-up and the evaluation before RL included) to the end of the first trainer step after which
the curriculum's window (the last stage's last 200 training episodes,
``curriculum/stage_success``) is full and at or above ``--target``; it is also given from the start
of RL. ``--eval-every N`` adds an evaluation of ``env.eval_episodes`` sampled S7N4 episodes every
N steps and reports the first at or above target as well (evaluations are work the reference does
not do: they stop the trainer while they run). The evaluation at the end of the run checks the
window's verdict on fresh episodes.

Reported side by side: time to target and its ratio (pipeline / reference), env steps per second
(pipeline: trained, over the RL window; reference: all) and their ratio, the pipeline's trainer
busy fraction, and the env steps each needed; the pipeline's per-step series (step, time, env
steps trained, train seconds, stage, window success) is kept in the JSON. Ray's workers run at
nice 0 like the reference (``RAY_worker_niceness``).

    python benchmarks/embodied_race.py
    python benchmarks/embodied_race.py --target 0.8 --steps 300 rollout.workers=2

It writes ``benchmarks/results/embodied_race.json`` and ``.png`` and prints a Markdown table; the
JSON keeps at most 200 evenly spaced points of each success curve and 100 of the series, and every
point goes to ``steps/embodied_race.json.gz`` under ``--out`` (not in git).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from babyai_reference import WINDOW  # noqa: E402  (episodes both runs judge success over)
from common import coarse, provenance, read_result, relative, save_result, write_steps  # noqa: E402

from relayrl.config import load_config  # noqa: E402
from relayrl.job import train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NAME = "embodied_race"
WORKER_NICENESS = "RAY_worker_niceness"  # Ray's own spelling
STAGES = ["BabyAI-GoToLocalS5N2-v0", "BabyAI-GoToLocalS6N3-v0", "BabyAI-GoToLocalS7N4-v0"]
CURVE_POINTS, SERIES_POINTS = 200, 100  # of each per-step curve and series the JSON keeps


def main(argv: list[str] | None = None) -> int:
    """Run the reference, then the pipeline; write the JSON and plot, print the table."""
    args = parse_args(argv)
    os.environ[WORKER_NICENESS] = "0"
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {
            "config": relative(str(args.config)),
            "target": args.target,
            "steps": args.steps,
            "eval_every": args.eval_every,
            "eval_episodes": args.eval_episodes,
            "reference_minutes": args.reference_minutes,
            "overrides": args.overrides,
        },
    }
    with tempfile.TemporaryDirectory(prefix="relayrl-race-") as tmp:
        load = os.getloadavg()[0]
        result["reference"] = run_reference(args, Path(tmp)) | {"load_1min_at_start": load}
        load = os.getloadavg()[0]
        result["pipeline"] = run_pipeline(args, Path(tmp)) | {"load_1min_at_start": load}
    ref, pipe = result["reference"], result["pipeline"]
    result["ratios"] = {
        "time_to_target": _ratio(pipe["time_to_target_s"], ref["time_to_target_s"]),
        "rl_time_to_target": _ratio(pipe["rl_time_to_target_s"], ref["time_to_target_s"]),
        "env_steps_per_s": pipe["env_steps_per_s"] / ref["env_steps_per_s"],
    }
    write_steps(args.out, NAME, result)
    save_result(args.out, NAME, summary(result), plot, markdown_table(result))
    return 0


def summary(result: dict) -> dict:
    """What ``embodied_race.json`` keeps: ``result`` with its curves and series coarsened."""
    ref, pipe = result["reference"], result["pipeline"]
    return result | {
        "reference": ref | {"curve": coarse(ref["curve"], CURVE_POINTS)},
        "pipeline": pipe
        | {
            "curve": coarse(pipe["curve"], CURVE_POINTS),
            "series": coarse(pipe["series"], SERIES_POINTS),
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items for the pipeline run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "babyai.yaml")
    parser.add_argument("--target", type=float, default=0.9, help="S7N4 success to reach (0.9)")
    parser.add_argument("--steps", type=int, default=450, help="most pipeline trainer steps")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="pipeline steps per eval (0: start and end only)"
    )
    parser.add_argument("--eval-episodes", type=int, default=100, help="episodes per eval")
    parser.add_argument(
        "--reference-minutes", type=float, default=20.0, help="most minutes of the reference"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("overrides", nargs="*", help="a.b=value items for the pipeline run")
    args = parser.parse_args(argv)
    if not 0 < args.target <= 1 or min(args.steps, args.eval_episodes) < 1 or args.eval_every < 0:
        parser.error("--target must be in (0, 1]; --steps, --eval-episodes >= 1; --eval-every >= 0")
    return args


def run_reference(args: argparse.Namespace, tmp: Path) -> dict:
    """The single-process reference until ``--target`` (or ``--reference-minutes``)."""
    print(f"[{NAME}] reference", file=sys.stderr, flush=True)
    command = [sys.executable, str(REPO / "benchmarks" / "babyai_reference.py"), "--stages"]
    command += [*STAGES, "--summary-only", "--minutes", str(args.reference_minutes)]
    command += ["--stop-at", str(args.target), "--name", "reference", "--out", str(tmp)]
    start = time.time()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.time() - start
    found = read_result(tmp / "steps" / "reference.json.gz")  # every point of the curve
    last = STAGES[-1]
    reached = next(
        (c for c in found["curve"] if c.get(last) is not None and c[last] >= args.target), None
    )
    return {
        "wall_clock_s": wall,
        "env_steps": found["env_steps"],
        "env_steps_per_s": found["env_steps_per_s"],
        "time_to_target_s": None if reached is None else reached["wall_s"],
        "env_steps_to_target": None if reached is None else reached["env_steps"],
        "curve": [(c["wall_s"], c["env_steps"], c.get(last)) for c in found["curve"]],
    }


def run_pipeline(args: argparse.Namespace, tmp: Path) -> dict:
    """One ``relayrl train`` run of ``--steps`` steps, evaluated every ``--eval-every``."""
    print(f"[{NAME}] pipeline", file=sys.stderr, flush=True)
    cfg = load_config(
        args.config,
        [
            *args.overrides,
            f"steps={args.steps}",
            f"log.eval_every={args.eval_every}",
            f"env.eval_episodes={args.eval_episodes}",
            "log.progress=false",
            "log.tensorboard=false",
            f"run.out_dir={tmp}",
        ],
    )
    start = time.time()
    with contextlib.redirect_stdout(sys.stderr):
        summary = train(cfg, tmp / "pipeline")
    wall = time.time() - start
    lines = Path(summary["artifacts"]["metrics"]).read_text().splitlines()
    records = [json.loads(x) for x in lines]
    steps = [r for r in records if "samples/trained_total" in r]
    rl_start = next(r["time"] for r in records if r["step"] == 0)
    last_stage = float(len(STAGES) - 1)
    window = [
        (r["time"], r["samples/trained_total"], r["curriculum/stage_success"])
        for r in steps
        if r.get("curriculum/stage") == last_stage and r["curriculum/stage_episodes"] >= WINDOW
    ]
    trained = {r["step"]: r["samples/trained_total"] for r in steps}
    evals = [
        (r["time"], trained.get(r["step"], 0.0), r["eval/success_rate"])
        for r in records
        if "eval/success_rate" in r and r["step"] > 0
    ]
    end = summary["eval"]["end"]["success_rate"]
    evals.append((start + wall, float(summary["samples"]["trained"]), end))
    reached = next((w for w in window if w[2] >= args.target), None)
    by_eval = next((e for e in evals if e[2] >= args.target), None)
    perf = summary["perf"]
    return {
        "wall_clock_s": wall,
        "rl_wall_clock_s": perf["rl_wall_clock_s"],
        "env_steps": summary["samples"]["trained"],
        "env_steps_per_s": summary["rollout"]["env_steps_per_s"],
        "trainer_busy": perf["busy"]["trainer"],
        "inference_busy": perf["busy"]["inference_service"],
        "time_to_target_s": None if reached is None else reached[0] - start,
        "rl_time_to_target_s": None if reached is None else reached[0] - rl_start,
        "env_steps_to_target": None if reached is None else reached[1],
        "eval_time_to_target_s": None if by_eval is None else by_eval[0] - start,
        "eval_env_steps_to_target": None if by_eval is None else by_eval[1],
        "final_success": end,
        "stale_drops": summary["samples"]["dropped_stale"],
        "accounted": summary["samples"]["accounted"],
        "curve": [(t - start, n, success) for t, n, success in window],
        "eval_curve": [(t - start, n, success) for t, n, success in evals],
        "series": [
            {
                "step": r["step"],
                "t": r["time"] - start,
                "env_steps": r["samples/trained_total"],
                "train_s": r["perf/train_s"],
                "stage": r.get("curriculum/stage"),
                "stage_success": r.get("curriculum/stage_success"),
            }
            for r in steps
        ],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def plot(result: dict, path: Path) -> Path:
    """S7N4 success against wall clock and against env steps, both runs."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ref = [(t, s, v) for t, s, v in result["reference"]["curve"] if v is not None]
    runs = {
        "reference (rollouts, last 200)": ref,
        "pipeline (rollouts, last 200)": result["pipeline"]["curve"],
        "pipeline (evaluation)": result["pipeline"]["eval_curve"],
    }
    for label, curve in runs.items():
        if curve:
            t, steps, success = zip(*curve, strict=True)
            left.plot([x / 60 for x in t], success, marker=".", label=label)
            right.plot([x / 1000 for x in steps], success, marker=".", label=label)
    for ax, xlabel in ((left, "wall clock (minutes)"), (right, "env steps (thousands)")):
        ax.axhline(result["settings"]["target"], color="0.6", linestyle=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("S7N4 success")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(result["command"], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown_table(result: dict) -> str:
    """Both runs side by side, then the ratios."""
    ref, pipe, r = result["reference"], result["pipeline"], result["ratios"]

    def minutes(s: float | None) -> str:
        return "not reached" if s is None else f"{s / 60:.1f} min"

    def steps(n: float | None) -> str:
        return "-" if n is None else f"{n / 1000:.0f}k"

    rows = [
        "| run | time to target | env steps to target | env steps/s | trainer busy "
        "| load at start |",
        "|---|---|---|---|---|---|",
        f"| reference, 1 process | {minutes(ref['time_to_target_s'])} "
        f"| {steps(ref['env_steps_to_target'])} | {ref['env_steps_per_s']:.0f} | - "
        f"| {ref['load_1min_at_start']:.1f} |",
        f"| pipeline | {minutes(pipe['time_to_target_s'])} (RL "
        f"{minutes(pipe['rl_time_to_target_s'])}) | {steps(pipe['env_steps_to_target'])} "
        f"| {pipe['env_steps_per_s']:.0f} | {pipe['trainer_busy']:.2f} "
        f"| {pipe['load_1min_at_start']:.1f} |",
        "",
        "Ratios (pipeline / reference): time to target "
        + ("-" if r["time_to_target"] is None else f"{r['time_to_target']:.2f}x")
        + ", RL time to target "
        + ("-" if r["rl_time_to_target"] is None else f"{r['rl_time_to_target']:.2f}x")
        + f", env steps/s {r['env_steps_per_s']:.2f}x. Both judged on the last stage's last "
        f"{WINDOW} training episodes. Pipeline by evaluation: "
        f"{minutes(pipe['eval_time_to_target_s'])}; its evaluation at the end "
        f"{pipe['final_success']:.2f}; stale drops {pipe['stale_drops']}; books balance: "
        f"{pipe['accounted']}.",
        "",
        f"Command: `{result['command']}`.",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
