"""PPO with a critic against GRPO: the arithmetic job from one warm start, the same step budget.

One supervised warm start (as a run does it) gives the checkpoint both runs start from. Then
``configs/arith.yaml`` trains in async mode with the config's GRPO (group advantages, the
config's loss) and with PPO (``trainer.advantage=gae``: the critic's per-token GAE advantages,
``trainer.loss=ppo_clip``), with the same generator, batches and steps. Held-out accuracy (greedy,
exact answer) every ``--eval-every`` steps and at the end; the critic's explained variance.

The full command (about 15 minutes on the 2-core reference machine)::

    python experiments/ppo_vs_grpo.py

A smoke run (a minute or two)::

    python experiments/ppo_vs_grpo.py --steps 10 --eval-every 5

Other options: ``--out``, and ``a.b=value`` overrides of the shared config (``critic.lr=...``).
It writes ``experiments/results/ppo_vs_grpo.json`` and ``.png`` (held-out accuracy against RL step)
with the command line and the machine, and prints a Markdown table. Checkpoints and run
directories are temporary.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import (  # noqa: E402
    from_start,
    provenance,
    relative,
    save_result,
    train_from,
    warm_start,
)

from relayrl.config import Config, load_config

matplotlib.use("Agg")  # benchmark machines have no display

REPO = Path(__file__).resolve().parents[1]
NAME = "ppo_vs_grpo"
VARIANTS = {"grpo": [], "ppo": ["trainer.advantage=gae", "trainer.loss=ppo_clip"]}


def main(argv: list[str] | None = None) -> int:
    """Warm-start once, train GRPO and PPO from it; write JSON + plot, print the table."""
    args = parse_args(argv)
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="relayrl-ppo-") as tmp:
        tmp_dir = Path(tmp)
        print(f"[{NAME}] warm start", file=sys.stderr)
        warm = warm_start(load_config(args.config, args.overrides), tmp_dir / "start")
        runs = {}
        try:
            for name, extra in VARIANTS.items():
                print(f"[{NAME}] RL with {name}", file=sys.stderr)
                run_dir = tmp_dir / name
                runs[name] = train_from(run_config(args, extra, tmp_dir), run_dir)
                if name == "ppo":
                    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
                    runs[name]["explained_variance"] = [
                        (r["step"], r["critic/explained_variance"])
                        for r in records
                        if "critic/explained_variance" in r
                    ]
        finally:
            ray.shutdown()
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {
            "config": relative(str(args.config)),
            "steps": args.steps,
            "eval_every": args.eval_every,
            "variants": VARIANTS,
            "overrides": [relative(item) for item in args.overrides],
        },
        "warm_start": warm,
        "runs": runs,
        "wall_clock_s": time.time() - began,
    }
    save_result(args.out, NAME, result, plot, markdown(result))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items applied to both runs."""
    parser = argparse.ArgumentParser(
        description="Train the arithmetic job with GRPO and with PPO (critic, GAE) from one warm "
        "start; report held-out accuracy."
    )
    parser.add_argument(
        "--config", type=Path, default=REPO / "configs" / "arith.yaml", help="configs/arith.yaml"
    )
    parser.add_argument("--steps", type=int, default=600, help="RL steps per run (600)")
    parser.add_argument("--eval-every", type=int, default=50, help="held-out period (50)")
    parser.add_argument(
        "--out", type=Path, default=REPO / "experiments" / "results", help="experiments/results"
    )
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides for both runs")
    args = parser.parse_args(argv)
    if min(args.steps, args.eval_every) < 1:
        parser.error("--steps and --eval-every must be >= 1")
    return args


def run_config(args: argparse.Namespace, extra: list[str], tmp_dir: Path) -> Config:
    """One run's config: the shared one from the warm-start checkpoint, async, plus ``extra``."""
    return from_start(args, tmp_dir, extra)


def plot(result: dict, path: Path) -> Path:
    """Held-out accuracy against RL step, one line per variant; the critic's explained variance."""
    fig, (acc_ax, ev_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, run in result["runs"].items():
        steps, values = zip(*run["eval_curve"], strict=True)
        acc_ax.plot(steps, values, "o-", label=name)
    acc_ax.set_xlabel("RL step")
    acc_ax.set_ylabel("held-out accuracy (greedy, exact answer)")
    acc_ax.set_title("from one warm start, same batches and steps")
    acc_ax.legend()
    variance = result["runs"]["ppo"].get("explained_variance", [])
    if variance:
        steps, values = zip(*variance, strict=True)
        ev_ax.plot(steps, values, linewidth=0.8)
    ev_ax.set_xlabel("RL step")
    ev_ax.set_ylabel("critic explained variance of the GAE returns")
    ev_ax.set_ylim(-1, 1)
    m = result["machine"]
    fig.suptitle(f"relayrl PPO vs GRPO: {m['cpu_count']} CPUs, torch {m['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown(result: dict) -> str:
    """One row per variant: start, end, gain, wall clock; the command."""
    lines = [
        "| variant | held-out start | held-out end | gain (points) | wall clock |",
        "|---|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        gain = 100 * (run["final_accuracy"] - run["start_accuracy"])
        lines.append(
            f"| {name} | {100 * run['start_accuracy']:.1f} | {100 * run['final_accuracy']:.1f} "
            f"| {gain:+.1f} | {run['wall_clock_s'] / 60:.1f} min |"
        )
    m = result["machine"]
    lines += [
        "",
        f"Command: `{result['command']}`; {m['platform']}, {m['cpu_count']} CPUs, "
        f"torch {m['torch']}; {result['wall_clock_s'] / 60:.0f} min.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
