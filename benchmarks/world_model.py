"""Real env steps to S7N4 success with and without the world model, from the same policy.

Phases, each kept in ``--work`` so that a rerun skips what is done (delete a phase's folder to
redo it; delete only an arm's ``done.json`` to report its finished run again):

1. ``start``: the starting policy. ``relayrl train configs/babyai.yaml`` for ``--start-steps``
   steps (the curriculum run, stopped early); its ``checkpoint/`` is what both arms load with
   ``vla.path``, and its final S7N4 evaluation is the starting success.
2. ``offline``: ``relayrl wm collect`` on other levels (``--collect-levels``, default S5N2 and
   S6N3) with the noisy scripted bot, never the target level's solved policy;
   ``relayrl wm pretrain`` on them; and
   ``relayrl wm eval`` of the pretrained model on random-policy episodes of the target level
   (collected for evaluation only), with the starting policy's success measured in imagination
   against the real env.
3. Two arms of ``configs/babyai_wm.yaml`` (S7N4 only; ``--arms`` picks one) from ``vla.path``:
   ``model_free`` (``imagination.episodes_per_real=0``) and ``world_model`` (``world_model.path``
   = phase 2's model), each for ``--steps`` trainer steps, evaluated every ``--eval-every`` steps on
   ``--eval-episodes`` sampled S7N4 episodes.

Reported: each arm's real env steps (the workers' finished segments, ``samples/real_put_total``)
and wall clock to ``--target``, the ratio of real env steps (model-free / world-model), the
imagined env steps the world-model arm trained on, and the world model's quality (per-step and
rollout PSNR against copying the last frame, the success model's AUC, imagined against real
success of the starting policy).

    python benchmarks/world_model.py --work wm-bench
    python benchmarks/world_model.py --work wm-bench --steps 200 world_model.backend=deterministic

Overrides (``a.b=value``) apply to every phase (the same sizes everywhere: ``vla.path`` needs
them); ``--wm-set`` items only to the world-model arm. It writes
``benchmarks/results/world_model.json`` and ``.png`` (success against real env steps, log x, and
against wall clock) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import provenance, relative, save_result  # noqa: E402

from relayrl.cli import install_stop_handlers  # noqa: E402
from relayrl.config import load_config  # noqa: E402
from relayrl.job import train  # noqa: E402
from relayrl.wm.collect import collect  # noqa: E402
from relayrl.wm.evaluate import (  # noqa: E402
    evaluate,
    load_world_model,
    policy_success,
    select_episodes,
)
from relayrl.wm.pretrain import pretrain  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NAME = "world_model"
START_CONFIG = REPO / "configs" / "babyai.yaml"
ARM_CONFIG = REPO / "configs" / "babyai_wm.yaml"
TARGET_LEVEL = "BabyAI-GoToLocalS7N4-v0"
OFFLINE_LEVELS = ["BabyAI-GoToLocalS5N2-v0", "BabyAI-GoToLocalS6N3-v0"]
QUIET = ["log.progress=false", "log.tensorboard=false"]
IMAGINED = "samples/imagined_trained_total"
ARMS = ("model_free", "world_model")
ENDED = ("finished", "interrupted")  # an arm's run in one of these is reported, not run again


def main(argv: list[str] | None = None) -> int:
    """Run the phases not yet in ``--work``, then both arms; write the JSON, plot and table."""
    args = parse_args(argv)
    install_stop_handlers()  # Ctrl-C or SIGTERM ends an arm with a checkpoint, as in a run
    args.work.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("work", "out")
        },
    }
    result["start"] = starting_policy(args)
    result["offline"] = offline_world_model(args, Path(result["start"]["checkpoint"]))
    for arm in ARMS:
        result[arm] = (
            run_arm(args, arm, result["start"]["checkpoint"], result["offline"]["path"])
            if arm in args.arms
            else None
        )
    mf, wm = result["model_free"], result["world_model"]
    result["real_steps_ratio"] = (
        None
        if mf is None
        or wm is None
        or None in (mf["real_steps_to_target"], wm["real_steps_to_target"])
        else mf["real_steps_to_target"] / wm["real_steps_to_target"]
    )
    result = _scrub(result, str(args.work.resolve()))
    save_result(args.out, NAME, result, plot, markdown_table(result))
    return 0


def _scrub(value: object, work: str) -> object:
    """``value`` with every path under ``--work`` written as ``WORK/...`` (no machine paths)."""
    if isinstance(value, dict):
        return {k: _scrub(v, work) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v, work) for v in value]
    if isinstance(value, str) and value.startswith(work):
        return "WORK" + value[len(work) :]
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items for every phase."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the phases' output")
    parser.add_argument("--target", type=float, default=0.8, help="S7N4 success to reach (0.8)")
    parser.add_argument("--start-steps", type=int, default=60, help="steps of the start policy")
    parser.add_argument("--collect-episodes", type=int, default=600, help="offline episodes")
    parser.add_argument(
        "--collect-levels",
        type=lambda text: text.split(","),
        default=OFFLINE_LEVELS,
        help="levels of the offline episodes, comma-separated (default: S5N2 and S6N3; with "
        "env.view=full, levels of the target's 7-cell grid, e.g. BabyAI-GoToLocalS7N5-v0)",
    )
    parser.add_argument("--eval-data-episodes", type=int, default=48, help="target-level episodes")
    parser.add_argument("--pretrain-steps", type=int, default=2000, help="steps of each model")
    parser.add_argument("--steps", type=int, default=150, help="trainer steps of each arm")
    parser.add_argument("--eval-every", type=int, default=10, help="arm steps per evaluation")
    parser.add_argument("--eval-episodes", type=int, default=100, help="episodes per evaluation")
    parser.add_argument("--seed", type=int, default=0, help="seed of every phase and arm")
    parser.add_argument(
        "--wm-set",
        action="append",
        default=[],
        help="an a.b=value item for the world-model arm only, e.g. "
        "imagination.episodes_per_real=4; may repeat",
    )
    parser.add_argument(
        "--arms",
        type=lambda text: text.split(","),
        default=list(ARMS),
        help="the arms to run and report, comma-separated (default: model_free,world_model)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("overrides", nargs="*", help="a.b=value items (every phase)")
    args = parser.parse_args(argv)
    if not args.arms or set(args.arms) - set(ARMS):
        parser.error(f"--arms {','.join(args.arms)}: allowed arms are {', '.join(ARMS)}")
    counts = (args.start_steps, args.collect_episodes, args.eval_data_episodes)
    counts += (args.pretrain_steps, args.steps, args.eval_every, args.eval_episodes)
    if not 0 < args.target <= 1 or min(counts) < 1:
        parser.error("--target must be in (0, 1]; every count must be >= 1")
    return args


def _say(text: str) -> None:
    print(f"[{NAME}] {text}", file=sys.stderr, flush=True)


def _fresh(folder: Path) -> Path:
    """``folder`` emptied of a phase that did not finish (a phase writes ``done.json`` last)."""
    if folder.exists():
        shutil.rmtree(folder)
    return folder


def _done(folder: Path) -> dict | None:
    marker = folder / "done.json"
    return json.loads(marker.read_text()) if marker.is_file() else None


def _finish(folder: Path, record: dict) -> dict:
    (folder / "done.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def starting_policy(args: argparse.Namespace) -> dict:
    """Phase 1: the curriculum run stopped after ``--start-steps`` steps, and its S7N4 success."""
    folder = args.work / "start"
    if (found := _done(folder)) is not None:
        _say(f"start policy: kept ({found['success']:.2f} on S7N4)")
        return found
    _say(f"start policy: {args.start_steps} steps of {relative(str(START_CONFIG))}")
    cfg = load_config(
        START_CONFIG,
        [
            f"steps={args.start_steps}",
            f"run.seed={args.seed}",
            f"env.eval_episodes={args.eval_episodes}",
            f"log.eval_every={args.start_steps}",
            *args.overrides,
            *QUIET,
        ],
    )
    start = time.time()
    with contextlib.redirect_stdout(sys.stderr):
        summary = train(cfg, _fresh(folder) / "run")
    return _finish(
        folder,
        {
            "checkpoint": str(folder / "run" / "checkpoint"),
            "steps": args.start_steps,
            "success": summary["eval"]["end"]["success_rate"],
            "real_env_steps": summary["samples"]["generated"],
            "wall_clock_s": time.time() - start,
        },
    )


def _arm_config(args: argparse.Namespace, extra: list[str]):
    return load_config(ARM_CONFIG, [f"run.seed={args.seed}", *args.overrides, *extra, *QUIET])


def offline_world_model(args: argparse.Namespace, policy: Path) -> dict:
    """Phase 2: collect on the other levels, pretrain, and measure on the target level."""
    folder = args.work / "offline"
    if (found := _done(folder)) is not None:
        _say("offline world model: kept")
        return found
    if TARGET_LEVEL in args.collect_levels:
        raise ValueError(f"--collect-levels must not include the target level {TARGET_LEVEL}")
    levels = ",".join([TARGET_LEVEL, *args.collect_levels])
    cfg = _arm_config(args, [f"env.tasks=[{levels}]", f"env.eval_tasks=[{TARGET_LEVEL}]"])
    _fresh(folder).mkdir(parents=True)
    timings = {}
    start = time.time()
    _say(f"collect {args.collect_episodes} noisy scripted episodes on {args.collect_levels}")
    data = folder / "data"
    collected = collect(
        cfg,
        data,
        episodes=args.collect_episodes,
        policy="noisy_scripted",
        levels=args.collect_levels,
        seed=args.seed,
    )
    heldout_data = folder / "target_random"
    collect(
        cfg,
        heldout_data,
        episodes=args.eval_data_episodes,
        policy="random",
        levels=[TARGET_LEVEL],
        seed=args.seed + 1,
    )
    timings["collect_s"] = time.time() - start
    _say(f"pretrain {args.pretrain_steps} steps ({cfg.world_model.backend})")
    start = time.time()
    model = folder / "model"
    trained = pretrain(cfg, [str(data)], model, steps=args.pretrain_steps, seed=args.seed)
    timings["pretrain_s"] = time.time() - start
    _say("evaluate on the target level")
    start = time.time()
    played = evaluate(
        cfg,
        model,
        [str(heldout_data)],
        policy=str(policy),
        seed=args.seed,
        strip_path=folder / "eval_frames.png",
    )
    # The random policy on the same episodes: only the play differs, not the model's errors.
    episodes, _ = select_episodes([str(heldout_data)], model, played["episodes"])
    generator = torch.Generator().manual_seed(args.seed)
    random_play, _ = policy_success(
        cfg, *load_world_model(model), episodes, "random", args.seed, generator
    )
    timings["eval_s"] = time.time() - start
    return _finish(
        folder,
        {
            "path": str(model),
            "backend": cfg.world_model.backend,
            "collected": {k: collected[k] for k in ("episodes", "steps", "successes")},
            "pretrain_heldout_end": trained["heldout_end"],
            "target_level": {
                "observation": played["observation"],
                "reward": played["reward"],
                "start_policy": played["policy"],
                "random_policy": random_play,
            },
            **timings,
        },
    )


def run_arm(args: argparse.Namespace, arm: str, policy: str, world_model: str) -> dict:
    """One arm from ``vla.path``: its evaluations against real env steps and wall clock."""
    folder = args.work / arm
    if (found := _done(folder)) is not None:
        _say(f"{arm}: kept")
        return found
    extra = [
        f"vla.path={policy}",
        f"steps={args.steps}",
        f"log.eval_every={args.eval_every}",
        f"env.eval_episodes={args.eval_episodes}",
    ]
    if arm == "model_free":
        extra.append("imagination.episodes_per_real=0")
    else:
        extra += [f"world_model.path={world_model}", *args.wm_set]
    run_dir = folder / "run"
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    if summary is not None and summary["status"] in ENDED and summary["steps"] > 0:
        # An arm stopped with Ctrl-C or SIGTERM, or one whose done.json was deleted to report it
        # again: report it from its run directory (a rerun keeps it). One stopped before its
        # first step has nothing to report and runs again.
        _say(f"{arm}: kept, {summary['status']} after step {summary['steps']}")
        wall = summary.get("wall_clock_s")
        return _finish(folder, _arm_record(args, run_dir, summary, wall))
    cfg = _arm_config(args, extra)
    _say(f"{arm}: {args.steps} steps (Ctrl-C or SIGTERM ends it early, reporting its reach)")
    start = time.time()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            summary = train(cfg, _fresh(folder) / "run")
    except KeyboardInterrupt:
        summary = json.loads(summary_path.read_text())
    return _finish(folder, _arm_record(args, run_dir, summary, time.time() - start))


def _arm_record(args: argparse.Namespace, run_dir: Path, summary: dict, wall: float | None):
    """An arm's result from its run directory: the evaluations against real env steps (from
    ``metrics.jsonl``) and the summary's books; an interrupted run has no end evaluation, busy
    fractions or imagined books."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    key = "samples/real_put_total"
    real = {r["step"]: r[key] for r in records if key in r}
    imagined_steps = {r["step"]: r[IMAGINED] for r in records if IMAGINED in r}
    times = {r["step"]: r["time"] for r in records if "time" in r}
    rl_start = times[0]
    curve = [
        (r["time"] - rl_start, real.get(r["step"], 0.0), r["step"], r["eval/success_rate"])
        for r in records
        if "eval/success_rate" in r
    ]
    reached = next((c for c in curve if c[3] >= args.target), None)
    finished = summary["status"] == "finished"
    imagined = summary.get("imagined_samples") or {}
    last = max(real, default=0)
    return {
        "status": summary["status"],
        "steps": summary["steps"],
        "wall_clock_s": wall,
        "rl_wall_clock_s": max(times.values()) - rl_start,
        "real_env_steps": summary["samples"]["generated"] if finished else real.get(last, 0.0),
        "real_trained": summary["samples"]["trained"],
        "imagined_trained": imagined.get("trained", imagined_steps.get(last)),
        "accounted": summary["samples"].get("accounted") and imagined.get("accounted", True),
        "start_success": curve[0][3] if curve else None,
        "final_success": curve[-1][3] if curve else None,
        "best_success": max((c[3] for c in curve), default=None),
        "real_steps_to_target": None if reached is None else reached[1],
        "rl_time_to_target_s": None if reached is None else reached[0],
        "busy": summary.get("perf", {}).get("busy"),
        "episodes": _episodes(summary),
        "world_model": summary.get("world_model"),
        "curve": curve,
    }


def _episodes(summary: dict) -> dict:
    """The arm's real and imagined training episodes: count, success rate, mean length."""
    rollout, imagined = summary.get("rollout") or {}, summary.get("imagined_samples") or {}
    out = {}
    for kind, n, rate, steps in (
        ("real", rollout.get("episodes"), (rollout.get("success_rate") or {}).get("overall"), None),
        ("imagined", imagined.get("episodes"), imagined.get("success_rate"), "generated"),
    ):
        if n:
            total = imagined.get(steps) if steps else summary["samples"]["generated"]
            out[kind] = {"episodes": n, "success_rate": rate, "mean_length": total / n}
    return out


def plot(result: dict, path: Path) -> Path:
    """S7N4 success against real env steps (log x) and against wall clock, both arms; the world
    model's rollout PSNR against the horizon on the target level."""
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    for arm, label in (("model_free", "model-free"), ("world_model", "world model")):
        curve = (result[arm] or {}).get("curve")
        if curve:
            t, real, _, success = zip(*curve, strict=True)
            left.plot([max(x, 1.0) for x in real], success, marker=".", label=label)
            middle.plot([x / 60 for x in t], success, marker=".", label=label)
    left.set_xscale("log")
    for ax, xlabel in ((left, "real env steps (log)"), (middle, "RL wall clock (minutes)")):
        ax.axhline(result["settings"]["target"], color="0.6", linestyle=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("S7N4 evaluation success")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    rollout = result["offline"]["target_level"]["observation"]["rollout"]
    if rollout.get("mse"):
        horizon = range(1, len(rollout["mse"]) + 1)
        for key, label in (("mse", "world model"), ("copy_mse", "copy the start frame")):
            right.plot(horizon, [_psnr(m) for m in rollout[key]], marker=".", label=label)
        right.legend(fontsize=8)
    right.set_xlabel("open-loop steps")
    right.set_ylabel("PSNR (dB), random-policy S7N4 episodes")
    right.grid(True, alpha=0.3)
    fig.suptitle(result["command"], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _psnr(mse: float) -> float:
    return 10 * math.log10(1 / max(mse, 1e-12))


def markdown_table(result: dict) -> str:
    """Both arms side by side, then the world model's quality on the target level."""

    def k(n: float | None) -> str:
        return "not reached" if n is None else f"{n / 1000:.1f}k"

    def minutes(s: float | None) -> str:
        return "-" if s is None else f"{s / 60:.1f} min"

    rows = [
        "| arm | start -> best -> end success | real env steps to target | RL time to target "
        "| real env steps | imagined trained | wall clock | books |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        r = result[arm]
        if r is None:
            rows.append(f"| {arm} | not run (--arms) | | | | | | |")
            continue
        rows.append(
            f"| {arm} | {r['start_success']:.2f} -> {r['best_success']:.2f} -> "
            f"{r['final_success']:.2f} | {k(r['real_steps_to_target'])} "
            f"| {minutes(r['rl_time_to_target_s'])} | {k(r['real_env_steps'])} "
            f"| {'-' if not r['imagined_trained'] else k(r['imagined_trained'])} "
            f"| {minutes(r['wall_clock_s'])} | {r['accounted']} |"
        )
    ratio = result["real_steps_ratio"]
    off = result["offline"]["target_level"]
    obs, roll = off["observation"]["per_step"], off["observation"]["rollout"]
    psnr_h = roll.get("psnr_at_horizon")
    copy_h = roll.get("copy_psnr_at_horizon")
    pol, rnd = off["start_policy"], off["random_policy"]
    rows += [
        "",
        "Real env steps to target, model-free / world model: "
        + ("-" if ratio is None else f"{ratio:.1f}x")
        + f". Start policy: {result['start']['steps']} steps of configs/babyai.yaml, "
        f"{result['start']['success']:.2f} on S7N4.",
        "",
        f"World model ({result['offline']['backend']}) on random-policy S7N4 episodes: per-step "
        f"PSNR {obs['psnr']:.1f} dB (copy last frame {obs['copy_last_psnr']:.1f}); at "
        f"{roll['horizon']} steps {_db(psnr_h)} (copy {_db(copy_h)}); success AUC "
        f"{_num(off['reward'].get('auc'))}, failure AUC "
        f"{_num((off['reward'].get('failure') or {}).get('auc'))}. Start policy success imagined "
        f"{pol['imagined_success']:.2f} vs real {pol['real_success']:.2f} (agreement "
        f"{pol['outcome_agreement']:.2f}; failed before the cap "
        f"{pol.get('imagined_failed_early', 0):.2f} imagined vs {pol['real_failed_early']:.2f} "
        f"real); random policy {rnd['imagined_success']:.2f} vs {rnd['real_success']:.2f}.",
        *_episode_lines((result["world_model"] or {}).get("episodes") or {}),
        "",
        f"Command: `{result['command']}`.",
    ]
    return "\n".join(rows)


def _episode_lines(episodes: dict) -> list[str]:
    """The world-model arm's training episodes, real beside imagined, as a paragraph."""
    if "imagined" not in episodes:
        return []
    parts = [
        f"{kind} {e['episodes']} episodes, success {e['success_rate']:.2f}, mean length "
        f"{e['mean_length']:.1f} steps"
        for kind, e in episodes.items()
    ]
    return ["", f"World-model arm's training episodes: {'; '.join(parts)}."]


def _db(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.1f} dB"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    os.environ.setdefault("RAY_worker_niceness", "0")
    sys.exit(main())
