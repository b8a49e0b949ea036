"""The ``relayrl`` command."""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from relayrl.config import ConfigError, load_config, preset_path

# What an override may change on --resume: everything else must match the checkpoint.
RESUME_OVERRIDES = ("steps", "log.", "run.checkpoint_every", "run.keep_checkpoints", "ray.")

EPILOG = """examples:
  relayrl train configs/arith.yaml
  relayrl train configs/arith.yaml mode=sync steps=200 trainer.loss=ppo_clip
  relayrl train configs/arith.yaml --ray-address auto

  relayrl train --resume runs/arith-20260101-120000

  relayrl wm collect configs/babyai.yaml --out wm-data --policy noisy_scripted
  relayrl wm pretrain configs/babyai.yaml --data wm-data --out wm world_model.backend=deterministic
  relayrl wm eval configs/babyai.yaml --world-model wm --data wm-data

Overrides use dotted keys (section.key=value); see the config reference in the README."""


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for configuration and data errors, 1 when
    Ray cannot be started or joined)."""
    parser = argparse.ArgumentParser(
        prog="relayrl",
        description="Distributed, asynchronous RL of language and vision-language-action policies.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="run a training job from a YAML config",
        description="Run a training job: warm start, evaluation, RL (sync or async), evaluation, "
        "checkpoint. Writes config.yaml, metrics.jsonl, TensorBoard events, learning_curve.png, "
        "checkpoint/ and summary.json into a new run directory.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    train.add_argument(
        "config",
        nargs="?",
        help="YAML config file, e.g. configs/arith.yaml (not with --resume, which reads the "
        "run's config.yaml)",
    )
    train.add_argument("overrides", nargs="*", help="a.b=value overrides, applied in order")
    train.add_argument(
        "--ray-address",
        default=None,
        help="join an existing Ray cluster (e.g. auto) instead of "
        "starting an embedded one; same as ray.address=...",
    )
    train.add_argument(
        "--run-dir",
        default=None,
        help="write here instead of OUT_DIR/NAME-TIME; refused if it holds files, unless "
        "--overwrite",
    )
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=None,
        help="continue the run in RUN_DIR from its newest valid checkpoint; overrides may "
        f"only change {', '.join(k + '*' if k.endswith('.') else k for k in RESUME_OVERRIDES)}",
    )
    train.add_argument(
        "--preset",
        action="append",
        default=[],
        metavar="NAME",
        help="merge a preset over the config, before the overrides: a YAML file, or NAME for "
        "presets/NAME.yaml beside the config (configs/presets/acce.yaml: AcceRL's settings); "
        "may repeat",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="empty a --run-dir that holds an earlier run's files before writing to it",
    )
    report = commands.add_parser(
        "report",
        help="write RUN_DIR/report.md with plots from a run's files",
        description="Build a Markdown report (learning curves, throughput, busy fractions, "
        "timeline, lag histogram, weight-sync times, evaluation) from a run directory; works on "
        "finished and interrupted runs.",
    )
    report.add_argument("run_dir", help="a run directory written by relayrl train")
    evaluate = commands.add_parser(
        "eval",
        help="replay a run's evaluation on its checkpoint, or score an LLM checkpoint on math data",
        description="A run directory: play the run's own evaluation protocol on its saved "
        "checkpoint, with the executors its in-run evaluations use, and report what its final "
        "evaluation reported, per task (LLM: greedy held-out accuracy; embodied: success per "
        "task under fixed seeds, or LIBERO's protocol of fixed init states, wait steps and the "
        "suite's step cap); write the report as JSON. With --data, an LLM checkpoint: generate "
        "with the generator executor and score with the sandboxed math scorer; print pass@1, "
        "mean@k and pass@k, a per-subject and per-level breakdown where the data has one, and "
        "timing; write every sample to a JSONL file.",
    )
    evaluate.add_argument(
        "path",
        help="a run directory (LLM or embodied), its checkpoint folder, or a Hugging Face "
        "checkpoint directory",
    )
    evaluate.add_argument(
        "--data",
        default=None,
        help="LLM: math500 or gsm8k (shipped), hf:NAME[:CONFIG][@SPLIT] (a Hugging Face hub "
        "dataset; needs relayrl[hf]), or a .jsonl/.jsonl.gz/.parquet file with 'prompt' and "
        "'answer' fields (required unless PATH is a run directory, whose own evaluation is then "
        "replayed)",
    )
    evaluate.add_argument("--k", type=int, default=1, help="samples per problem (1: greedy)")
    evaluate.add_argument("--max-new-tokens", type=int, default=256, help="completion length cap")
    evaluate.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    evaluate.add_argument("--limit", type=int, default=None, help="only the first N problems")
    evaluate.add_argument("--workers", type=int, default=2, help="scoring worker processes")
    evaluate.add_argument(
        "--chat-template",
        action="store_true",
        help="wrap each prompt in the checkpoint tokenizer's chat template",
    )
    evaluate.add_argument(
        "--out",
        default=None,
        help="with --data: samples JSONL (default next to the model); a run: the report JSON "
        "(default RUN_DIR/eval-PROTOCOL.json, eval-heldout.json for an LLM run)",
    )
    evaluate.add_argument(
        "--protocol",
        choices=["libero", "seeded"],
        default=None,
        help="embodied: libero (episode i from the task's init state i, wait steps, the suite's "
        "step cap; the default for LIBERO runs) or seeded (episode i from seed i; otherwise)",
    )
    evaluate.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="embodied: episodes per task (default: the run's env.eval_episodes split over the "
        "tasks; LIBERO's benchmark plays 50)",
    )
    evaluate.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help="embodied: tasks (default env.eval_tasks, else the env's tasks)",
    )
    actions = evaluate.add_mutually_exclusive_group()
    actions.add_argument(
        "--greedy",
        dest="greedy",
        action="store_const",
        const=True,
        help="embodied: the most likely action (default: as env.eval_greedy)",
    )
    actions.add_argument(
        "--sample", dest="greedy", action="store_const", const=False, help="embodied: sampled"
    )
    evaluate.add_argument(
        "--seed",
        type=int,
        default=None,
        help="embodied: seed of the episodes (default: the run's run.seed, as its own evaluations)",
    )
    _add_wm_commands(commands)
    # parse_args would reject overrides placed after an option (`--ray-address auto steps=5`):
    # argparse fills the nargs="*" positional once, so later ones come back as leftovers.
    args, leftovers = parser.parse_known_args(argv)
    if args.command == "wm":
        if any(item.startswith("-") for item in leftovers):
            parser.error(f"unrecognized arguments: {' '.join(leftovers)}")
        return _wm(args, [*args.overrides, *leftovers], argv)
    if args.command in ("report", "eval") and leftovers:
        parser.error(f"unrecognized arguments: {' '.join(leftovers)}")
    if args.command == "report":
        return _report(args.run_dir)
    if args.command == "eval":
        return _eval(args)
    if any(item.startswith("-") for item in leftovers):
        parser.error(f"unrecognized arguments: {' '.join(leftovers)}")

    overrides = [*args.overrides, *leftovers]
    if args.ray_address is not None:
        overrides.append(f"ray.address={args.ray_address}")
    if args.resume is not None:
        if args.preset:
            parser.error("--preset does not go with --resume: the run's config.yaml holds it")
        return _resume(args, overrides)
    if args.config is None:
        parser.error("a config file is required (or --resume RUN_DIR)")
    try:
        presets = [preset_path(name, args.config) for name in args.preset]
        cfg = load_config(args.config, overrides, presets)
    except ConfigError as err:
        print(f"relayrl: config error: {err}", file=sys.stderr)
        return 2
    from relayrl.preflight import PreflightError, check

    try:
        check(cfg)
    except PreflightError as err:
        print(f"relayrl: data error: {err}", file=sys.stderr)
        return 2

    try:
        run_dir = _claim_run_dir(args.run_dir, args.overwrite, cfg.run.out_dir, cfg.run.name)
    except FileExistsError as err:
        print(f"relayrl: {err}", file=sys.stderr)
        return 2
    return _run(cfg, run_dir, resume=False)


def _resume(args: argparse.Namespace, overrides: list[str]) -> int:
    """``relayrl train --resume RUN_DIR [overrides]``: the run's own config, a few overrides."""
    run_dir = Path(args.resume)
    if args.config is not None:  # argparse fills the optional positional with the first override
        overrides.insert(0, args.config)
    if args.run_dir is not None or args.overwrite:
        print("relayrl: --resume continues RUN_DIR; drop --run-dir/--overwrite", file=sys.stderr)
        return 2
    refused = [o for o in overrides if not o.split("=", 1)[0].startswith(RESUME_OVERRIDES)]
    if refused:
        print(
            f"relayrl: config error: a resumed run keeps its config; {refused} may not change "
            f"(allowed: {', '.join(RESUME_OVERRIDES)})",
            file=sys.stderr,
        )
        return 2
    if not (run_dir / "config.yaml").is_file():
        print(f"relayrl: {run_dir} is not a run directory (no config.yaml)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(str(run_dir / "config.yaml"), overrides)
    except ConfigError as err:
        print(f"relayrl: config error: {err}", file=sys.stderr)
        return 2
    from relayrl.checkpoint_format import NoCheckpoint, latest

    try:
        latest(run_dir, warn=lambda line: None)
    except NoCheckpoint as err:
        print(f"relayrl: {err}", file=sys.stderr)
        return 2
    return _run(cfg, run_dir, resume=True)


def _run(cfg: Any, run_dir: Path, *, resume: bool) -> int:
    from relayrl.job import train as run_training
    from relayrl.launch import RayStartError

    install_stop_handlers()
    try:
        run_training(cfg, run_dir, resume=resume)
    except KeyboardInterrupt:
        print(f"relayrl: interrupted; partial results in {run_dir}", file=sys.stderr)
        return 128 + _STOPPED_BY[-1] if _STOPPED_BY else 130
    except RayStartError as err:
        # 1, not the 2 of a refused command line: the run began (summary.json says failed)
        print(f"relayrl: {err}", file=sys.stderr)
        return 1
    return 0


def _claim_run_dir(given: str | None, overwrite: bool, out_dir: str, name: str) -> Path:
    """The run directory, created now so that no other run takes it.

    A ``--run-dir`` that holds files is refused unless ``overwrite`` (then emptied). A generated
    ``OUT_DIR/NAME-TIMESTAMP`` gets a ``-2``, ``-3`` ... suffix when a run started in the same
    second already took it.
    """
    if given is not None:
        path = Path(given)
        if path.is_dir() and any(path.iterdir()):
            if not overwrite:
                raise FileExistsError(
                    f"--run-dir {path} holds an earlier run's files; pass --overwrite to replace "
                    "them, or choose another directory"
                )
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
        return path
    stem = Path(out_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = stem if n == 1 else stem.with_name(f"{stem.name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise AssertionError("itertools.count never ends")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals that stop a run as Ctrl-C does: a terminal's Ctrl-C, and a scheduler's or ``kill``'s
SIGTERM (a batch system sends it before SIGKILL)."""
_STOPPED_BY: list[int] = []  # the signals received, in order


def install_stop_handlers() -> None:
    """Make SIGINT and SIGTERM stop a run with a checkpoint (the first) or at once (the second).

    asyncio.run's own Ctrl-C handler only cancels the loop's main task, which then waits on the
    tasks it cancels; once a run ignored two Ctrl-Cs that way. The handler asks the RL loop to
    checkpoint and stop after its step; a second signal (or one outside the loop) raises at once
    in the main thread, and so out of the event loop. Installing it also undoes the SIGINT a
    shell's background job starts with ignored.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    from relayrl.checkpoint import Checkpointer

    _STOPPED_BY.append(signum)
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    if Checkpointer.request_stop():
        print(
            f"\nrelayrl: {name}: stopping after this step to write a checkpoint (again: stop now)",
            file=sys.stderr,
            flush=True,
        )
        return
    raise KeyboardInterrupt


def _eval(args: argparse.Namespace) -> int:
    from relayrl.evaluate import llm_run
    from relayrl.evaluate_embodied import embodied_run

    found = embodied_run(Path(args.path))
    if found is not None:
        return _eval_embodied(args, *found)
    if args.data is None and (run := llm_run(Path(args.path))) is not None:
        return _eval_llm_run(args, *run)
    if args.data is None:
        print(
            f"relayrl: --data is required: '{args.path}' is no run directory, so it is scored "
            "on math data (math500, gsm8k, hf:NAME or a .jsonl/.jsonl.gz/.parquet file)",
            file=sys.stderr,
        )
        return 2
    if args.k < 1 or args.max_new_tokens < 1 or args.temperature <= 0:
        print("relayrl: --k and --max-new-tokens must be >= 1, --temperature > 0", file=sys.stderr)
        return 2
    from relayrl.data.datasets import check_source

    try:
        check_source(args.data)
    except ValueError as err:
        print(f"relayrl: --data: {err}", file=sys.stderr)
        return 2
    from relayrl.evaluate import evaluate, format_report

    try:
        report = evaluate(
            Path(args.path),
            args.data,
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            limit=args.limit,
            out=Path(args.out) if args.out else None,
            workers=args.workers,
            chat_template=args.chat_template,
        )
    except (OSError, ValueError, ImportError) as err:  # missing data or checkpoint, hub, extra
        print(f"relayrl: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0


# What an LLM run's own evaluation does not read (its protocol is the run's), with the defaults.
NOT_FOR_RUN_EVAL = {
    "k": 1,
    "max_new_tokens": 256,
    "temperature": 1.0,
    "limit": None,
    "workers": 2,
    "chat_template": False,
    "protocol": None,
    "episodes": None,
    "tasks": None,
    "greedy": None,
    "seed": None,
}


def _eval_llm_run(args: argparse.Namespace, cfg: Any, checkpoint: Path) -> int:
    from relayrl.evaluate import evaluate_run, format_run_report
    from relayrl.evaluate_embodied import write_report

    given = [k for k, default in NOT_FOR_RUN_EVAL.items() if getattr(args, k) != default]
    if given:
        names = ", ".join("--" + k.replace("_", "-") for k in given)
        print(
            f"relayrl: {names}: '{args.path}' is an LLM run, whose own held-out evaluation is "
            "replayed as the run played it; give --data to score other problems with them",
            file=sys.stderr,
        )
        return 2
    report = evaluate_run(cfg, checkpoint)
    out = Path(args.out) if args.out else checkpoint.parent / "eval-heldout.json"
    print(format_run_report(report))
    print(f"wrote {write_report(report, out)}")
    return 0


def _eval_embodied(args: argparse.Namespace, cfg: Any, checkpoint: Path) -> int:
    from relayrl.evaluate_embodied import evaluate_embodied, format_report, write_report

    try:
        report = evaluate_embodied(
            cfg,
            checkpoint,
            protocol=args.protocol,
            episodes=args.episodes,
            tasks=args.tasks,
            greedy=args.greedy,
            seed=args.seed,
            progress=cfg.log.progress and sys.stderr.isatty(),
        )
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"relayrl: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else checkpoint.parent / f"eval-{report['protocol']}.json"
    print(format_report(report))
    print(f"wrote {write_report(report, out)}")
    return 0


def _add_wm_commands(commands: Any) -> None:
    """``relayrl wm collect | pretrain | eval``: the world model's offline half."""
    wm = commands.add_parser(
        "wm",
        help="collect offline episodes, pretrain and evaluate the world model",
        description="The world model's offline half (docs/world_model.md): collect real "
        "episodes that do not come from the target task's solved policy, pretrain the "
        "observation and success models on them, evaluate both on held-out real episodes.",
    )
    actions = wm.add_subparsers(dest="wm_command", required=True)

    def command(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help_text, description=description)
        sub.add_argument("config", help="an embodied YAML config, e.g. configs/babyai.yaml")
        sub.add_argument("overrides", nargs="*", help="a.b=value overrides, applied in order")
        sub.add_argument(
            "--seed", type=int, default=0, help="seed of everything random (default 0)"
        )
        return sub

    collect = command(
        "collect",
        "record real episodes for pretraining into a folder",
        "Play episodes of the config's env and write frames, action tokens, instructions, "
        "rewards and how each episode ended into OUT (compressed .npz shards and "
        "manifest.json). Levels default to the config's env.tasks other than its target "
        "(env.eval_tasks); a target level is played only by --policy random.",
    )
    collect.add_argument("--out", required=True, help="a new (or empty) folder for the episodes")
    collect.add_argument("--episodes", type=int, default=200, help="episodes to play (default 200)")
    collect.add_argument(
        "--policy",
        default="random",
        help="random (uniform actions), noisy_scripted (BabyAI's bot with random actions mixed "
        "in), or the folder of a VLA checkpoint (RUN_DIR/checkpoint)",
    )
    collect.add_argument(
        "--level",
        action="append",
        default=None,
        help="a level (env task) to play, levels taken in turn; may repeat",
    )
    collect.add_argument(
        "--noise",
        type=float,
        default=None,
        help="noisy_scripted: the probability of a random action at each step (default 0.3)",
    )
    pretrain = command(
        "pretrain",
        "train the observation and success models on collected episodes",
        "Train M_obs (world_model.backend) and M_reward on the episodes of --data, with a "
        "held-out split of episodes; write OUT/observation and OUT/reward (safetensors + "
        "config.json, what world_model.path loads), OUT/metrics.jsonl and OUT/pretrain.json.",
    )
    pretrain.add_argument(
        "--data", action="append", required=True, help="a folder of episodes; may repeat"
    )
    pretrain.add_argument("--out", required=True, help="a new (or empty) folder for the models")
    pretrain.add_argument(
        "--steps", type=int, default=2000, help="optimizer steps of each model (default 2000)"
    )
    pretrain.add_argument(
        "--batch-size", type=int, default=32, help="samples per step (default 32)"
    )
    pretrain.add_argument(
        "--heldout",
        type=float,
        default=0.1,
        help="fraction of episodes held out, in (0, 1) (default 0.1)",
    )
    pretrain.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="measure on the held-out episodes every N steps (default: steps / 10)",
    )
    evaluate = command(
        "eval",
        "measure a pretrained world model on held-out real episodes",
        "Per-step and rollout prediction error (MSE, PSNR), the success model's accuracy and "
        "AUC, and one fixed policy's success rate in imagination against the real env. Prints "
        "the report and writes it as JSON.",
    )
    evaluate.add_argument(
        "--world-model", required=True, help="a folder written by relayrl wm pretrain"
    )
    evaluate.add_argument(
        "--data",
        action="append",
        required=True,
        help="a folder of real episodes; may repeat (only held-out episodes of the pretraining "
        "data count)",
    )
    evaluate.add_argument(
        "--policy", default="random", help="random (the default), or the folder of a VLA checkpoint"
    )
    evaluate.add_argument(
        "--episodes", type=int, default=32, help="most episodes evaluated (default 32)"
    )
    evaluate.add_argument(
        "--horizon", type=int, default=10, help="steps of the rollout error (default 10)"
    )
    evaluate.add_argument(
        "--out", default=None, help="report JSON (default: WORLD_MODEL/eval.json)"
    )


def _wm(args: argparse.Namespace, overrides: list[str], argv: list[str] | None) -> int:
    """Run ``relayrl wm COMMAND``: 2 and one line on stderr for bad configs or arguments."""
    command = "relayrl " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, overrides, world_model=True)
    except ConfigError as err:
        print(f"relayrl: config error: {err}", file=sys.stderr)
        return 2
    if cfg.workload != "embodied":
        print(
            f"relayrl: config error: workload={cfg.workload!r}: relayrl wm needs an embodied "
            "config (workload: embodied)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.wm_command == "collect":
            from relayrl.wm.collect import collect

            manifest = collect(
                cfg,
                args.out,
                episodes=args.episodes,
                policy=args.policy,
                levels=args.level,
                noise=args.noise,
                seed=args.seed,
                command=command,
            )
            print(
                f"{manifest['episodes']} episodes, {manifest['steps']} steps, "
                f"{manifest['successes']} successes -> {args.out}"
            )
        elif args.wm_command == "pretrain":
            from relayrl.wm.pretrain import pretrain

            report = pretrain(
                cfg,
                args.data,
                args.out,
                steps=args.steps,
                batch_size=args.batch_size,
                heldout=args.heldout,
                eval_every=args.eval_every,
                seed=args.seed,
                command=command,
            )
            start, end = report["heldout_start"], report["heldout_end"]
            print(
                f"held-out obs MSE {start['heldout/obs_mse']:.5f} -> {end['heldout/obs_mse']:.5f} "
                f"(copy last frame {end['heldout/copy_last_mse']:.5f}), reward accuracy "
                f"{start['heldout/reward_acc']:.3f} -> {end['heldout/reward_acc']:.3f}; "
                f"{args.out}/pretrain.json"
            )
        else:
            from relayrl.wm.evaluate import evaluate, format_report

            out = Path(args.out) if args.out else Path(args.world_model) / "eval.json"
            strip = out.with_name(f"{out.stem}_frames.png")
            report = evaluate(
                cfg,
                args.world_model,
                args.data,
                policy=args.policy,
                episodes=args.episodes,
                horizon=args.horizon,
                seed=args.seed,
                command=command,
                strip_path=strip,
            )
            out.write_text(json.dumps(report, indent=2) + "\n")
            print(format_report(report))
            print(f"report: {out}; real (above) and imagined frames: {strip}")
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as err:
        print(f"relayrl: wm {args.wm_command}: {err}", file=sys.stderr)
        return 2
    return 0


def _report(run_dir: str) -> int:
    from relayrl.observability.report import write_report

    try:
        path = write_report(Path(run_dir))
    except FileNotFoundError as err:
        print(f"relayrl: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
