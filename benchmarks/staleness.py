"""Staleness without collapse: held-out accuracy of each off-policy correction under a forced lag.

One supervised warm start (stopped at ``warm_start.target_accuracy`` on the probe, as a run stops
it) gives one checkpoint. From it, every cell of a correction, a lag K and a seed (``run.seed``)
trains the default arithmetic job (``configs/arith.yaml``) in async mode with
``generator.min_lag = max_staleness = K``: every sample is trained exactly K versions old,
whatever the machine's timing (the first K steps fill the pipeline on version 0, see
docs/architecture.md). K = 0 is on-policy (the staleness gate then admits one batch at a time).
A run takes max(1000, 4K) steps (``--steps`` sets another number), so the fill is a small part
of it, at a constant learning rate after a linear warmup of ``--lr-warmup-steps`` (50;
``trainer.lr_warmup_steps``). The corrections are the losses of ``relayrl.algorithms.losses``
(``pg``, none; ``aipo``, ``ppo_clip``, ``gipo``, ``tis_seq``, ``mis_seq``, ``mis_seq_verl``,
``geo_mask``, ``m2po``, ``m2po_release``, ``ess_aipo``), each with the config's
hyper-parameters; ``ess_lr``: ``aipo`` under VCPO's step rule (``trainer.ess_lr``, the learning
rate times sqrt(ESS of the sequence weights)); and ``vcpo``, VCPO's recipe: ``tis_seq`` at cap 8,
``ess_lr`` and its off-policy optimal baseline (``trainer.advantage=vcpo_baseline``).

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
- the learning and drift traces of every step: the sampled accuracy (``rollout/accuracy``), the
  share of groups without signal (``rollout/zero_signal_groups``), the entropy
  (``loss/entropy_sampled``), the sequence ESS (``staleness/seq_ess``) and KL(mu || pi)
  (``staleness/kl_mu_pi``), and the mean of each over the steps at lag K;
- the trainer's staleness mean and max (K once the pipeline is full) and the books.

The default grid is 13 corrections x 5 lags x 3 seeds = 195 runs of 1,000 steps or more (not
run; at the 400-step grid's pace, days on the 2-core reference machine). The fair grid of the
off-policy study is two commands of 3 lags x 4 corrections x 3 seeds, for instance::

    python benchmarks/staleness.py --lags 0 4 16 --losses ppo_clip ess_lr vcpo m2po_release
    python benchmarks/staleness.py --lags 0 64 256 --losses ppo_clip ess_lr vcpo m2po_release \
        --steps 1024 trainer.lr=1e-4

A smoke run (2 losses x 2 lags x 1 seed, 30 steps; a few minutes)::

    python benchmarks/staleness.py --steps 30 --eval-every 10 --losses pg aipo --lags 0 4 \
        --seeds 0

Other options: ``--losses`` (corrections), ``--lags``, ``--seeds``, ``--steps``,
``--lr-warmup-steps``, ``--eval-every``, ``--collapse-drop``, ``--out``, and ``a.b=value``
overrides of the shared config (e.g. ``task.heldout_size=500``; they come after the constant
learning rate, so ``trainer.lr_schedule=cosine`` takes the old schedule back).

The grid is resumable per cell: after each run ``staleness.partial.json`` holds the runs so far
with the commit and the settings, and a rerun at the same commit (no uncommitted changes to
tracked files) with the same config, overrides and shared options skips every cell (correction,
lag, seed, steps) already in it and warms up again from the same seed.

It writes ``benchmarks/results/staleness.json`` and ``.png`` (accuracy against lag, one line per
loss through the mean over seeds; the mean ESS against lag; the ESS per step at the largest lag)
with the command line and the machine, and prints Markdown tables. The JSON is a summary (every
run's numbers, its held-out curve, its ESS at about 50 steps, the early-warning table); the
per-step ESS, health and drift traces go to ``benchmarks/results/steps/staleness.json.gz``,
outside git, which ``--from-json`` also reads. The partial file keeps a grid stopped part-way.
The checkpoint and the run directories are temporary.
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
from common import (
    coarse,
    git_state,
    provenance,
    read_result,
    relative,
    save_result,
    warm_start,
    write_steps,
)

from relayrl.algorithms.losses import LOSSES
from relayrl.config import Config, load_config
from relayrl.job import train

matplotlib.use("Agg")  # benchmark machines have no display

REPO = Path(__file__).resolve().parents[1]
NAME = "staleness"
# A correction is a loss, or a loss with a step rule: its config overrides.
CORRECTIONS = {loss: [f"trainer.loss={loss}"] for loss in LOSSES} | {
    "ess_lr": ["trainer.loss=aipo", "trainer.ess_lr=true"],
    "vcpo": [
        "trainer.loss=tis_seq",
        "trainer.seq_is_cap=8",
        "trainer.ess_lr=true",
        "trainer.advantage=vcpo_baseline",
    ],
}
DEFAULT = (
    *("pg", "aipo", "ppo_clip", "gipo", "tis_seq", "mis_seq", "mis_seq_verl", "geo_mask"),
    *("m2po", "m2po_release", "ess_aipo", "ess_lr", "vcpo"),
)
LAGS = (0, 1, 4, 16, 64)
SEEDS = (0, 1, 2)
ESS_POINTS = 50  # of each run's ESS trace that staleness.json keeps
HEALTH = ("kl_mu_pi", "log_ratio_p99", "log_ratio_max", "clip_frac", "grad_norm", "ess_lr_scale")
# What each run logs per step of the learning and of the policy's drift from its sampler, beside
# the loss's health: sampled accuracy, groups without signal, entropy and the sequence ESS.
DRIFT = (
    "rollout/accuracy",
    "rollout/zero_signal_groups",
    "loss/entropy_sampled",
    "staleness/seq_ess",
    "staleness/kl_mu_pi",
)


def steps_for(args: argparse.Namespace, lag: int) -> int:
    """RL steps of a run at lag K: ``--steps``, or max(1000, 4K), so that the first K steps,
    which fill the pipeline on version 0, are a small part of the run."""
    return args.steps if args.steps is not None else max(1000, 4 * lag)


def cell(run: dict) -> tuple:
    """What makes a run the same cell of the grid: its correction, lag, seed and steps."""
    return run["loss"], run["lag"], run["seed"], run["steps_asked"]


def main(argv: list[str] | None = None) -> int:
    """Warm-start once, train every cell (correction, lag, seed) not already in the partial file
    of the same commit and settings from it, write JSON + plot, print tables."""
    args = parse_args(argv)
    if args.from_json is not None:  # tables and plot again, from a finished run's JSON
        result = summarise(read_result(args.from_json))
        save_result(args.out, NAME, result, plot, markdown_tables(result))
        return 0
    settings = grid_settings(args)
    partial_path = args.out / f"{NAME}.partial.json"
    runs, warm = resumable(partial_path, settings)
    wanted = [
        (loss, lag, seed, steps_for(args, lag))
        for lag in args.lags
        for loss in args.losses
        for seed in args.seeds
    ]
    grid = [key for key in wanted if key not in {cell(run) for run in runs}]
    print(f"[{NAME}] {len(runs)} runs kept from {relative(str(partial_path))}", file=sys.stderr)
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="relayrl-staleness-") as tmp:
        tmp_dir = Path(tmp)
        start_dir = tmp_dir / "start"
        # The settings every run shares, for the result (model.path is left out of it).
        shared = run_config(args, args.losses[0], args.lags[0], args.seeds[0], tmp_dir, tmp_dir)
        if grid:  # from the same seed as the runs kept, so from the same weights
            print(f"[{NAME}] warm start", file=sys.stderr)
            warm = warm_start(load_config(args.config, args.overrides), start_dir)
            print(f"[{NAME}] warm start: {json.dumps(warm)}", file=sys.stderr)
        try:
            for i, (loss, lag, seed, _) in enumerate(grid):
                left = (time.time() - began) / i * (len(grid) - i) if i else float("nan")
                print(
                    f"[{NAME}] run {i + 1}/{len(grid)}: loss={loss} lag={lag} seed={seed} "
                    f"(about {left / 60:.0f} min left)",
                    file=sys.stderr,
                )
                cfg = run_config(args, loss, lag, seed, start_dir, tmp_dir)
                run = run_once(cfg, args, tmp_dir / f"{loss}-{lag}-{seed}")
                runs.append(run | {"loss": loss, "seed": seed, "steps_asked": cfg.steps})
                partial = {**settings, "warm_start": warm, "runs": runs}
                args.out.mkdir(parents=True, exist_ok=True)
                partial_path.write_text(json.dumps(partial, indent=1, default=str))
        finally:
            ray.shutdown()
    order = {key: i for i, key in enumerate(wanted)}
    runs = sorted((r for r in runs if cell(r) in order), key=lambda r: order[cell(r)])
    config = shared.model_dump(mode="json", exclude={"max_staleness"})
    config["run"]["out_dir"] = "(temporary)"
    config["model"]["path"] = "(temporary warm-start checkpoint)"
    config["trainer"]["loss"] = config["trainer"]["ess_lr"] = "(per run)"
    config["trainer"]["advantage"] = config["trainer"]["seq_is_cap"] = "(per run)"
    config["generator"]["min_lag"] = config["steps"] = config["run"]["seed"] = "(per run)"
    config["channels"]["capacity"] = "(max of the config's and the run's lag)"
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {
            "config": relative(str(args.config)),
            "steps": args.steps if args.steps is not None else "max(1000, 4K)",
            "eval_every": args.eval_every,
            "collapse_drop": args.collapse_drop,
            "losses": args.losses,
            "lags": args.lags,
            "seeds": args.seeds,
            "lr_warmup_steps": args.lr_warmup_steps,
            "overrides": [relative(item) for item in args.overrides],
        },
        "config": config,
        "warm_start": warm,
        "wall_clock_s": sum(run["wall_clock_s"] for run in runs),
        "runs": runs,
    }
    write_steps(args.out, NAME, result)
    summary = summarise(result)
    save_result(args.out, NAME, summary, plot, markdown_tables(summary))
    return 0


def summarise(result: dict) -> dict:
    """What ``staleness.json`` keeps: ``result`` with each run's ESS trace coarsened and its
    health traces left out, and the early-warning table, which needs them, computed first. A
    summary passes through unchanged."""
    warnings = result["early_warnings"] if "early_warnings" in result else early_warnings(result)
    runs = [
        {key: value for key, value in run.items() if key not in ("health", "drift")}
        | {"ess": coarse(run["ess"], ESS_POINTS)}
        for run in result["runs"]
    ]
    return result | {"runs": runs, "early_warnings": warnings}


def grid_settings(args: argparse.Namespace) -> dict:
    """What a run of the grid depends on beyond its cell: the commit, the config and overrides,
    and the options every run shares. A partial file made with other settings is not resumed."""
    return {
        "git": git_state(),
        "config": relative(str(args.config)),
        "overrides": [relative(item) for item in args.overrides],
        "eval_every": args.eval_every,
        "collapse_drop": args.collapse_drop,
        "lr_warmup_steps": args.lr_warmup_steps,
    }


def resumable(path: Path, settings: dict) -> tuple[list[dict], dict | None]:
    """The runs of the partial file at ``path`` and its warm start, if it was made at the same
    commit (a clean tree) with the same ``settings``; none otherwise."""
    if not path.exists():
        return [], None
    if settings["git"].get("dirty", True):
        print(f"[{NAME}] uncommitted changes: {relative(str(path))} not resumed", file=sys.stderr)
        return [], None
    partial = json.loads(path.read_text())
    if {key: partial.get(key) for key in settings} != settings:
        print(f"[{NAME}] {relative(str(path))} has other settings: not resumed", file=sys.stderr)
        return [], None
    return partial["runs"], partial["warm_start"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items applied to every run."""
    parser = argparse.ArgumentParser(
        description="Train the arithmetic job under a forced lag with each off-policy correction; "
        "report held-out accuracy, the collapse step and the ESS.",
    )
    parser.add_argument(
        "--config", type=Path, default=REPO / "configs" / "arith.yaml", help="configs/arith.yaml"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="RL steps per run (max(1000, 4K) at lag K)"
    )
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=list(SEEDS), help="run.seed of each run (0 1 2)"
    )
    parser.add_argument(
        "--lr-warmup-steps",
        type=int,
        default=50,
        help="trainer.lr_warmup_steps under a constant lr (50)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=25, help="held-out evaluation period in steps (25)"
    )
    parser.add_argument(
        "--losses",
        nargs="+",
        choices=sorted(CORRECTIONS),
        default=list(DEFAULT),
        help="corrections to compare: a loss, ess_lr (aipo with trainer.ess_lr) or vcpo "
        "(tis_seq at cap 8, ess_lr and the vcpo_baseline advantage) (" + " ".join(DEFAULT) + ")",
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
    if (args.steps is not None and args.steps < 1) or args.eval_every < 1 or min(args.lags) < 0:
        parser.error("--steps and --eval-every must be >= 1, --lags >= 0")
    if args.lr_warmup_steps < 0:
        parser.error("--lr-warmup-steps must be >= 0")
    return args


def run_config(
    args: argparse.Namespace, loss: str, lag: int, seed: int, start_dir: Path, tmp_dir: Path
) -> Config:
    """The config of one run: the shared one from the warm-start checkpoint, async, lag forced,
    a constant learning rate after a linear warmup (overrides may change it)."""
    base = load_config(args.config, args.overrides)
    return load_config(
        args.config,
        [
            "trainer.lr_schedule=constant",
            f"trainer.lr_warmup_steps={args.lr_warmup_steps}",
            *args.overrides,
            "mode=async",
            f"steps={steps_for(args, lag)}",
            f"run.seed={seed}",
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
    drift = {name: [(r["step"], round(r[name], 6)) for r in records if name in r] for name in DRIFT}
    lag = cfg.generator.min_lag
    at_lag = [value for step, value in ess if step > lag]  # step k + 1 trains at lag min(k, K)
    drift_at_lag = {
        name: mean(values) if (values := [v for step, v in trace if step > lag]) else None
        for name, trace in drift.items()
    }
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
        "drift": drift,
        "ess_mean_at_lag": mean(at_lag) if at_lag else None,
        "drift_mean_at_lag": drift_at_lag,
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
    """Final accuracy against lag (the mean over seeds, each seed a dot, collapsed runs marked),
    mean ESS at lag against lag, and the ESS per step at the largest lag; one line per loss."""
    runs, lags = result["runs"], result["settings"]["lags"]
    losses = result["settings"]["losses"]
    fig, (acc_ax, ess_ax, trace_ax) = plt.subplots(1, 3, figsize=(16, 5))
    colors = dict(zip(losses, plt.cm.tab20.colors, strict=False))
    x = {lag: i for i, lag in enumerate(lags)}  # lags 0, 1, 4, 16, 64: evenly spaced
    for loss in losses:
        mine = sorted((r for r in runs if r["loss"] == loss), key=lambda r: r["lag"])
        cells = seed_cells(mine)
        acc_ax.plot(
            [x[lag] for lag in cells],
            [mean(r["final_accuracy"] for r in cell_runs) for cell_runs in cells.values()],
            "-",
            color=colors[loss],
            label=loss,
        )
        acc_ax.scatter(
            [x[r["lag"]] for r in mine],
            [r["final_accuracy"] for r in mine],
            s=8,
            color=colors[loss],
        )
        fell = [r for r in mine if r["collapse_step"] is not None]
        acc_ax.scatter(
            [x[r["lag"]] for r in fell],
            [r["final_accuracy"] for r in fell],
            marker="x",
            s=90,
            color=colors[loss],
            zorder=3,
        )
        with_ess = seed_cells([r for r in mine if r["ess_mean_at_lag"] is not None])
        ess_ax.plot(
            [x[lag] for lag in with_ess],
            [mean(r["ess_mean_at_lag"] for r in cell_runs) for cell_runs in with_ess.values()],
            "o-",
            color=colors[loss],
            label=loss,
        )
        for i, r in enumerate(cells.get(max(lags), [])):
            steps, values = zip(*r["ess"], strict=True) if r["ess"] else ((), ())
            label = loss if i == 0 else None
            trace_ax.plot(steps, values, color=colors[loss], linewidth=0.8, label=label)
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
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def seed_cells(runs: list[dict]) -> dict[int, list[dict]]:
    """``runs`` of one loss by lag, in lag order: each lag's runs over the seeds."""
    cells: dict[int, list[dict]] = {}
    for run in sorted(runs, key=lambda r: r["lag"]):
        cells.setdefault(run["lag"], []).append(run)
    return cells


def markdown_tables(result: dict) -> str:
    """Final accuracy (mean and range over seeds, collapses) and mean ESS, loss by lag, and the
    command."""
    runs, lags = result["runs"], result["settings"]["lags"]
    by: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        by.setdefault((r["loss"], r["lag"]), []).append(r)
    head = "| loss | " + " | ".join(f"K = {lag}" for lag in lags) + " |"
    rule = "|---|" + "---|" * len(lags)

    def accuracy(cell_runs: list[dict]) -> str:
        values = [100 * r["final_accuracy"] for r in cell_runs]
        notes = [f"{min(values):.1f}-{max(values):.1f}"] if len(values) > 1 else []
        fell = [str(r["collapse_step"]) for r in cell_runs if r["collapse_step"] is not None]
        notes += [f"collapsed at {', '.join(fell)}"] if fell else []
        return f"{mean(values):.1f}" + (f" ({'; '.join(notes)})" if notes else "")

    def ess(cell_runs: list[dict]) -> str:
        values = [r["ess_mean_at_lag"] for r in cell_runs if r["ess_mean_at_lag"] is not None]
        return f"{mean(values):.3f}" if values else "-"

    lines = [
        "Final held-out accuracy (%): the mean over seeds (their range), and collapse steps:",
        "",
        head,
        rule,
    ]
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
