"""What one version of lag costs PPO on BabyAI, and what centring the trust region buys back.

Runs ``babyai_reference.py`` (one process, no Ray: the same rollouts and the same policy as the
pipeline's) in four arms on one level, several seeds each, two processes at a time:

- ``reference``: the file's own PPO update, the acting policy the trained one (lag 0);
- ``relayrl``: relayrl's ``VLATrainer.train_step`` on the same rollouts, lag 0;
- ``relayrl_lag1``: the same, the acting policy one update behind (as a pipeline's workers are);
- ``relayrl_lag1_proximal``: lag 1 with ``trainer.proximal=current``.

    python experiments/lag_study.py --seeds 0 1 2 --max-steps 100000

It writes ``experiments/results/lag_study.json`` and ``.png``: rollout success over the last 200
episodes against env steps, per arm (mean over seeds, each seed thin), with the command line and
machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import provenance, read_result, relative, save_result  # noqa: E402

NAME = "lag_study"
HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent / "benchmarks"
ARMS: dict[str, list[str]] = {
    "reference": [],
    "relayrl": ["--trainer", "relayrl"],
    "relayrl_lag1": ["--trainer", "relayrl", "--lag", "1"],
    "relayrl_lag1_proximal": [
        *("--trainer", "relayrl", "--lag", "1"),
        *("--trainer-set", "trainer.proximal=current"),
    ],
}


def main(argv: list[str] | None = None) -> int:
    """Run every arm and seed, then write the result files."""
    args = parse_args(argv)
    arms = {name: ARMS[name] for name in args.arms}
    jobs = [(arm, seed) for seed in args.seeds for arm in arms]
    start = time.time()
    with (
        tempfile.TemporaryDirectory(prefix="relayrl-lag-") as tmp,
        ThreadPoolExecutor(args.parallel) as pool,
    ):
        runs = list(pool.map(lambda job: run_one(*job, arms, args, Path(tmp)), jobs))
    grid = np.arange(args.every, args.max_steps + 1, args.every)
    per_arm = {}
    for arm in arms:
        curves = [r["curve"] for r in runs if r["arm"] == arm]
        at = np.array([[success_at(c, args.level, x) for x in grid] for c in curves])
        per_arm[arm] = {
            "seeds": [r["seed"] for r in runs if r["arm"] == arm],
            "success": at.tolist(),
            "mean": np.nanmean(at, axis=0).tolist(),
            "env_steps_per_s": [r["env_steps_per_s"] for r in runs if r["arm"] == arm],
        }
    result = {
        "benchmark": NAME,
        **provenance(),
        "args": vars(args) | {"out": relative(str(args.out))},
        "wall_s": time.time() - start,
        "env_steps": grid.tolist(),
        "arms": per_arm,
    }
    save_result(args.out, args.name, result, plot, table(result))
    return 0


def run_one(arm: str, seed: int, arms: dict, args: argparse.Namespace, tmp: Path) -> dict:
    """One ``babyai_reference.py`` run; its result JSON with the arm and seed."""
    name = f"{arm}_s{seed}"
    command = [
        sys.executable,
        str(BENCHMARKS / "babyai_reference.py"),
        *("--stages", args.level, "--summary-only", "--seed", str(seed)),
        *("--max-steps", str(args.max_steps), "--minutes", "120"),
        *("--name", name, "--out", str(tmp)),
        *arms[arm],
    ]
    print(f"{time.strftime('%H:%M:%S')} start {name}", flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    found = read_result(tmp / "steps" / f"{name}.json.gz")  # every point of the curve
    print(f"{time.strftime('%H:%M:%S')} done {name}", flush=True)
    return {"arm": arm, "seed": seed, **found}


def success_at(curve: list[dict], level: str, env_steps: int) -> float:
    """The rollout success of the curve's last point at or before ``env_steps`` (nan before)."""
    before = [c[level] for c in curve if c["env_steps"] <= env_steps and c[level] is not None]
    return before[-1] if before else float("nan")


def plot(result: dict, out_png: Path) -> Path:
    """Mean success per arm against env steps, each seed thin."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = result["env_steps"]
    for i, (arm, found) in enumerate(result["arms"].items()):
        color = f"C{i}"
        for seed_curve in found["success"]:
            ax.plot(x, seed_curve, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(x, found["mean"], color=color, linewidth=2, label=f"{arm} ({len(found['seeds'])})")
    ax.set_xlabel("env steps")
    ax.set_ylabel("rollout success (last 200 episodes)")
    ax.set_ylim(0, 1)
    ax.set_title(result["command"], fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def table(result: dict) -> str:
    """Mean (and per-seed) success of each arm at a few env-step marks."""
    x = result["env_steps"]
    marks = [i for i in range(len(x)) if (i + 1) % max(len(x) // 4, 1) == 0][-4:]
    head = " | ".join(f"{x[i] // 1000}k" for i in marks)
    rows = [f"| arm | {head} |", "|---|" + "---|" * len(marks)]
    for arm, found in result["arms"].items():
        cells = []
        for i in marks:
            seeds = "/".join(f"{s[i]:.2f}" for s in found["success"])
            cells.append(f"{found['mean'][i]:.2f} ({seeds})")
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", default="BabyAI-GoToLocalS5N2-v0")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=100_000, help="env steps per run")
    parser.add_argument("--every", type=int, default=4096, help="env steps between curve points")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--name", default=NAME, help="result file name")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
