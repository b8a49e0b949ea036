"""Staleness without collapse: held-out accuracy of each off-policy correction under a forced lag.

One supervised warm start (stopped at ``warm_start.target_accuracy`` on the probe, as a run stops
it) gives one checkpoint. From it, every pair of a loss and a lag K trains the default arithmetic
job (``configs/arith.yaml``) in async mode with ``generator.min_lag = max_staleness = K``: every
sample is trained exactly K versions old, whatever the machine's timing (the first K steps fill
the pipeline on version 0, see docs/architecture.md). K = 0 is on-policy (the staleness gate then
admits one batch at a time). The losses are the corrections of ``relayrl.algorithms.losses``:
``pg`` (none), ``aipo``, ``ppo_clip``, ``gipo``, ``tis_seq``, ``mis_seq``, ``m2po``, ``ess_aipo``,
each with the config's hyper-parameters, and ``ess_lr``: ``aipo`` under VCPO's step rule
(``trainer.ess_lr``, the learning rate times sqrt(ESS of the sequence weights)).

Per run it reports

- the held-out accuracy (greedy, the config's held-out split) at the start, every
  ``--eval-every`` steps and at the end, and the final one;
- the collapse step: the first evaluation at which held-out accuracy has fallen
  ``--collapse-drop`` (20 points) below its best so far, or null;
- the ESS trace: ``loss/ess`` (normalised effective sample size of the token importance weights)
  of every step, and its mean over the steps at lag K (after the first K);
- the traces of the other health metrics (``loss/kl_mu_pi``, ``loss/log_ratio_p99``,
  ``loss/log_ratio_max``, ``loss/clip_frac``, ``loss/grad_norm``, and ``ess_lr``'s
  ``loss/ess_lr_scale``), to see which one moved before a collapse;
- the trainer's staleness mean and max (K once the pipeline is full) and the books.

The default grid is 9 corrections x 5 lags = 45 runs of 400 steps each. The full command (about
1.5-2 hours on the 2-core reference machine, a few minutes of which are the warm start)::

    python benchmarks/staleness.py

A smoke run (2 losses x 2 lags, 30 steps; a few minutes)::

    python benchmarks/staleness.py --steps 30 --eval-every 10 --losses pg aipo --lags 0 4

Other options: ``--losses`` (corrections), ``--lags``, ``--steps``, ``--eval-every``,
``--collapse-drop``, ``--out``, and ``a.b=value`` overrides of the shared config (e.g.
``task.heldout_size=500``).
It writes ``benchmarks/results/staleness.json`` and ``.png`` (accuracy against lag, one line per
loss; the mean ESS against lag; the ESS per step at the largest lag) with the command line and
the machine, and prints Markdown tables. The JSON is a summary (every run's numbers, its held-out
curve, its ESS at about 100 steps, the early-warning table); the per-step ESS and health traces go
to ``benchmarks/results/steps/staleness.json.gz``, outside git, which ``--from-json`` also reads.
After each run it rewrites ``staleness.partial.json`` with the runs so far, so a grid stopped
part-way keeps what it measured. The checkpoint and the run directories are temporary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

import matplotlib
import matplotlib.pyplot as plt
import ray
from common import coarse, provenance, read_result, relative, save_result, warm_start, write_steps

from relayrl.algorithms.losses import LOSSES
from relayrl.config import Config, load_config
from relayrl.job import train

matplotlib.use("Agg")  # benchmark machines have no display

REPO = Path(__file__).resolve().parents[1]
NAME = "staleness"
# A correction is a loss, or a loss with a step rule: its config overrides.
CORRECTIONS = {loss: [f"trainer.loss={loss}"] for loss in LOSSES} | {
    "ess_lr": ["trainer.loss=aipo", "trainer.ess_lr=true"],
}
DEFAULT = ("pg", "aipo", "ppo_clip", "gipo", "tis_seq", "mis_seq", "m2po", "ess_aipo", "ess_lr")
LAGS = (0, 1, 4, 16, 64)
HEALTH = ("kl_mu_pi", "log_ratio_p99", "log_ratio_max", "clip_frac", "grad_norm", "ess_lr_scale")


def main(argv: list[str] | None = None) -> int:
    """Warm-start once, train every (loss, lag) pair from it, write JSON + plot, print tables."""
    args = parse_args(argv)
    if args.from_json is not None:  # tables and plot again, from a finished run's JSON
        result = summarise(read_result(args.from_json))
        save_result(args.out, NAME, result, plot, markdown_tables(result))
        return 0
    runs = []
    with tempfile.TemporaryDirectory(prefix="relayrl-staleness-") as tmp:
        tmp_dir = Path(tmp)
        start_dir = tmp_dir / "start"
        print(f"[{NAME}] warm start", file=sys.stderr)
        warm = warm_start(load_config(args.config, args.overrides), start_dir)
        print(f"[{NAME}] warm start: {json.dumps(warm)}", file=sys.stderr)
        grid = [(lag, loss) for lag in args.lags for loss in args.losses]
        began = time.time()
        try:
            for i, (lag, loss) in enumerate(grid):
                left = (time.time() - began) / i * (len(grid) - i) if i else float("nan")
                print(
                    f"[{NAME}] run {i + 1}/{len(grid)}: loss={loss} lag={lag} "
                    f"(about {left / 60:.0f} min left)",
                    file=sys.stderr,
                )
                cfg = run_config(args, loss, lag, start_dir, tmp_dir)
                runs.append(run_once(cfg, args, tmp_dir / f"{loss}-{lag}") | {"loss": loss})
                partial = {"settings": vars(args) | {"config": str(args.config)}, "runs": runs}
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{NAME}.partial.json").write_text(
                    json.dumps(partial, indent=1, default=str)
                )
        finally:
            ray.shutdown()
    config = cfg.model_dump(mode="json", exclude={"max_staleness"})
    config["run"]["out_dir"] = "(temporary)"
    config["model"]["path"] = "(temporary warm-start checkpoint)"
    config["trainer"]["loss"] = config["trainer"]["ess_lr"] = "(per run)"
    config["generator"]["min_lag"] = "(per run)"
    config["channels"]["capacity"] = "(max of the config's and the run's lag)"
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {
            "config": relative(str(args.config)),
            "steps": args.steps,
            "eval_every": args.eval_every,
            "collapse_drop": args.collapse_drop,
            "losses": args.losses,
            "lags": args.lags,
            "overrides": [relative(item) for item in args.overrides],
        },
        "config": config,
        "warm_start": warm,
        "wall_clock_s": time.time() - began,
        "runs": runs,
    }
    write_steps(args.out, NAME, result)
    summary = summarise(result)
    save_result(args.out, NAME, summary, plot, markdown_tables(summary))
    return 0


def summarise(result: dict) -> dict:
    """What ``staleness.json`` keeps: ``result`` with each run's ESS trace coarsened (4 digits) and
    its health traces left out, and the early-warning table, which needs them, computed first. A
    summary passes through unchanged."""
    warnings = result["early_warnings"] if "early_warnings" in result else early_warnings(result)
    runs = [
        {key: value for key, value in run.items() if key != "health"}
        | {"ess": [[step, round(value, 4)] for step, value in coarse(run["ess"])]}
        for run in result["runs"]
    ]
    return result | {"runs": runs, "early_warnings": warnings}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items applied to every run."""
    parser = argparse.ArgumentParser(
        description="Train the arithmetic job under a forced lag with each off-policy correction; "
        "report held-out accuracy, the collapse step and the ESS.",
    )
    parser.add_argument(
        "--config", type=Path, default=REPO / "configs" / "arith.yaml", help="configs/arith.yaml"
    )
    parser.add_argument("--steps", type=int, default=400, help="RL steps per run (400)")
    parser.add_argument(
        "--eval-every", type=int, default=25, help="held-out evaluation period in steps (25)"
    )
    parser.add_argument(
        "--losses",
        nargs="+",
        choices=sorted(CORRECTIONS),
        default=list(DEFAULT),
        help="corrections to compare: a loss, or ess_lr (aipo with trainer.ess_lr) ("
        + " ".join(DEFAULT)
        + ")",
    )
    parser.add_argument(
        "--lags",
        nargs="+",
        type=int,
        default=list(LAGS),
        help="forced lags K (" + " ".join(map(str, LAGS)) + ")",
    )
    parser.add_argument(
        "--collapse-drop",
        type=float,
        default=0.2,
        help="a run collapses at the first evaluation this far below its best so far (0.2)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks" / "results",
        help="folder for the JSON and PNG (benchmarks/results)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="write the plot and tables again from this staleness.json, without training",
    )
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides for every run")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1 or min(args.lags) < 0:
        parser.error("--steps and --eval-every must be >= 1, --lags >= 0")
    return args


def run_config(
    args: argparse.Namespace, loss: str, lag: int, start_dir: Path, tmp_dir: Path
) -> Config:
    """The config of one run: the shared one from the warm-start checkpoint, async, lag forced."""
    base = load_config(args.config, args.overrides)
    return load_config(
        args.config,
        [
            *args.overrides,
            "mode=async",
            f"steps={args.steps}",
            *CORRECTIONS[loss],
            f"max_staleness={lag}",
            f"generator.min_lag={lag}",
            f"channels.capacity={max(lag, base.channels.capacity)}",
            f"model.path={start_dir}",
            "warm_start.max_steps=0",
            "log.every=1",  # the ESS of every step
            f"log.eval_every={args.eval_every}",
            "log.progress=false",
            "log.tensorboard=false",
            "run.checkpoint_every=0",
            f"run.out_dir={tmp_dir}",
        ],
    )


def run_once(cfg: Config, args: argparse.Namespace, run_dir: Path) -> dict:
    """Train one run and keep what this benchmark reports of it."""
    with contextlib.redirect_stdout(sys.stderr):  # train() prints its summary; keep stdout
        summary = train(cfg, run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    curve = sorted({r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}.items())
    ess = [(r["step"], r["loss/ess"]) for r in records if "loss/ess" in r]
    health = {
        name: [(r["step"], round(r[f"loss/{name}"], 6)) for r in records if f"loss/{name}" in r]
        for name in HEALTH
    }
    lag = cfg.generator.min_lag
    at_lag = [value for step, value in ess if step > lag]  # step k + 1 trains at lag min(k, K)
    staleness = summary["staleness"]
    return {
        "lag": lag,
        "final_accuracy": summary["eval"]["end"]["accuracy"],
        "start_accuracy": summary["eval"]["start"]["accuracy"],
        "best_accuracy": max(acc for _, acc in curve),
        "collapse_step": collapse_step(curve, args.collapse_drop),
        "eval_curve": curve,
        "ess": ess,
        "health": health,
        "ess_mean_at_lag": mean(at_lag) if at_lag else None,
        "ess_min": min((value for _, value in ess), default=None),
        "ess_warnings": staleness["ess_warnings"],
        "staleness": {key: staleness[key] for key in ("mean", "max", "hist")},
        "steps": summary["steps"],
        "updates": summary["updates"],
        "samples_accounted": summary["samples"]["accounted"],
        "wall_clock_s": summary["wall_clock_s"],
        "rl_wall_clock_s": summary["perf"]["rl_wall_clock_s"],
    }


def collapse_step(curve: list[tuple[int, float]], drop: float) -> int | None:
    """The first step of ``curve`` ((step, accuracy), in step order) at which accuracy is at
    least ``drop`` below the best accuracy of that step and the ones before, or None."""
    best = -1.0
    for step, accuracy in curve:
        best = max(best, accuracy)
        if best - accuracy >= drop - 1e-9:
            return step
    return None


def early_warnings(result: dict, window: int = 5) -> list[dict]:
    """For each collapsed run, how many steps before its collapse each health metric left the
    band of the healthy runs (no collapse) at the same lag: below their 5th percentile of the ESS,
    or above their 95th percentile of the others, as a ``window``-step moving mean. None where it
    did not leave the band before the collapse, or where no run at that lag stayed healthy."""
    runs = result["runs"]
    out = []
    for run in (r for r in runs if r["collapse_step"] is not None):
        healthy = [r for r in runs if r["lag"] == run["lag"] and r["collapse_step"] is None]
        leads = {}
        for name in ["ess", *HEALTH[:-1]]:
            trace = run["ess"] if name == "ess" else run.get("health", {}).get(name, [])
            pool = [
                v
                for r in healthy
                for step, v in (r["ess"] if name == "ess" else r.get("health", {}).get(name, []))
                if step > run["lag"]
            ]
            leads[name] = None
            if len(pool) < 20 or len(trace) < window:
                continue
            pool.sort()
            low = name == "ess"
            edge = pool[int(0.05 * len(pool))] if low else pool[int(0.95 * len(pool)) - 1]
            steps = [step for step, _ in trace]
            values = [v for _, v in trace]
            for i in range(window - 1, len(values)):
                if steps[i] <= run["lag"]:
                    continue
                smooth = mean(values[i - window + 1 : i + 1])
                if (smooth < edge) if low else (smooth > edge):
                    if steps[i] < run["collapse_step"]:
                        leads[name] = run["collapse_step"] - steps[i]
                    break
        out.append(
            {
                "loss": run["loss"],
                "lag": run["lag"],
                "collapse_step": run["collapse_step"],
                "lead": leads,
            }
        )
    return out


def plot(result: dict, path: Path) -> Path:
    """Final accuracy against lag (collapsed runs marked), mean ESS at lag against lag, and the
    ESS per step at the largest lag; one line per loss."""
    runs, lags = result["runs"], result["settings"]["lags"]
    losses = result["settings"]["losses"]
    fig, (acc_ax, ess_ax, trace_ax) = plt.subplots(1, 3, figsize=(16, 5))
    colors = dict(zip(losses, plt.cm.tab10.colors, strict=False))
    x = {lag: i for i, lag in enumerate(lags)}  # lags 0, 1, 4, 16, 64: evenly spaced
    for loss in losses:
        mine = sorted((r for r in runs if r["loss"] == loss), key=lambda r: r["lag"])
        xs = [x[r["lag"]] for r in mine]
        acc_ax.plot(xs, [r["final_accuracy"] for r in mine], "o-", color=colors[loss], label=loss)
        fell = [r for r in mine if r["collapse_step"] is not None]
        acc_ax.scatter(
            [x[r["lag"]] for r in fell],
            [r["final_accuracy"] for r in fell],
            marker="x",
            s=90,
            color=colors[loss],
            zorder=3,
        )
        with_ess = [r for r in mine if r["ess_mean_at_lag"] is not None]
        ess_ax.plot(
            [x[r["lag"]] for r in with_ess],
            [r["ess_mean_at_lag"] for r in with_ess],
            "o-",
            color=colors[loss],
            label=loss,
        )
        for r in mine:
            if r["lag"] == max(lags):
                steps, values = zip(*r["ess"], strict=True) if r["ess"] else ((), ())
                trace_ax.plot(steps, values, color=colors[loss], linewidth=0.8, label=loss)
    start = mean(r["start_accuracy"] for r in runs)
    acc_ax.axhline(start, color="0.5", linestyle="--", linewidth=1, label="start of RL")
    for ax in (acc_ax, ess_ax):
        ax.set_xticks(range(len(lags)), [str(lag) for lag in lags])
        ax.set_xlabel("forced lag K (policy versions)")
    acc_ax.set_ylabel("held-out accuracy at the end (greedy)")
    drop = result["settings"]["collapse_drop"]
    acc_ax.set_title(f"final accuracy (x: collapsed, a {drop:.0%} drop from the best)")
    ess_ax.set_ylabel("mean loss/ess over the steps at lag K")
    ess_ax.set_ylim(0, 1.05)
    ess_ax.set_title("effective sample size")
    trace_ax.axvline(max(lags), color="0.5", linestyle=":", linewidth=1)
    trace_ax.set_xlabel("RL step")
    trace_ax.set_ylabel("loss/ess")
    trace_ax.set_ylim(0, 1.05)
    trace_ax.set_title(f"ESS per step at K = {max(lags)} (dotted: pipeline full)")
    acc_ax.legend(fontsize=7)
    settings, m = result["settings"], result["machine"]
    fig.suptitle(
        f"relayrl staleness: {settings['steps']} steps per run, "
        f"{m['cpu_count']} CPUs, torch {m['torch']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_tables(result: dict) -> str:
    """Final accuracy (collapse step) and mean ESS, loss by lag, and the command."""
    runs, lags = result["runs"], result["settings"]["lags"]
    by = {(r["loss"], r["lag"]): r for r in runs}
    head = "| loss | " + " | ".join(f"K = {lag}" for lag in lags) + " |"
    rule = "|---|" + "---|" * len(lags)

    def accuracy(r: dict) -> str:
        fell = "" if r["collapse_step"] is None else f" (collapsed at {r['collapse_step']})"
        return f"{100 * r['final_accuracy']:.1f}{fell}"

    def ess(r: dict) -> str:
        return "-" if r["ess_mean_at_lag"] is None else f"{r['ess_mean_at_lag']:.3f}"

    lines = ["Final held-out accuracy (%), and the collapse step:", "", head, rule]
    for loss in result["settings"]["losses"]:
        lines.append(f"| {loss} | " + " | ".join(accuracy(by[loss, lag]) for lag in lags) + " |")
    lines += ["", "Mean loss/ess over the steps at lag K:", "", head, rule]
    for loss in result["settings"]["losses"]:
        lines.append(f"| {loss} | " + " | ".join(ess(by[loss, lag]) for lag in lags) + " |")
    warnings = result["early_warnings"] if "early_warnings" in result else early_warnings(result)
    if warnings:
        names = ["ess", *HEALTH[:-1]]
        lines += [
            "",
            "Collapsed runs: the steps by which each health metric left the band of the runs that "
            "did not collapse before the collapse (a positive lead saw it coming; - never left "
            "it before the collapse):",
            "",
            "| loss | K | collapse step | " + " | ".join(names) + " |",
            "|---|---|---|" + "---|" * len(names),
        ]
        for w in warnings:
            leads = ["-" if w["lead"][n] is None else str(w["lead"][n]) for n in names]
            lines.append(
                f"| {w['loss']} | {w['lag']} | {w['collapse_step']} | " + " | ".join(leads) + " |"
            )
    start = mean(r["start_accuracy"] for r in runs)
    m = result["machine"]
    lines += [
        "",
        f"Start of RL: {100 * start:.1f}% held-out; {result['settings']['steps']} steps per run; "
        f"books balanced in every run: {all(r['samples_accounted'] for r in runs)}.",
        f"Command: `{result['command']}`; {m['platform']}, {m['cpu_count']} CPUs, "
        f"torch {m['torch']}, ray {m['ray']}; {result['wall_clock_s'] / 60:.0f} min.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
