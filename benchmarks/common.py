"""Helpers shared by the benchmark scripts: machine description, git state, result files, and
the supervised warm start that several benchmarks share between their runs."""

from __future__ import annotations

import contextlib
import datetime
import gzip
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from PIL import Image

from relayrl.config import Config, load_config
from relayrl.executors.generator import Generator
from relayrl.executors.rewarder import Rewarder
from relayrl.executors.trainer import Trainer
from relayrl.job import train

REPO = Path(__file__).resolve().parents[1]


def machine() -> dict:
    """The machine and library versions, without host name or paths."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "ray": ray.__version__,
    }


def git_state() -> dict:
    """Commit and whether the working tree had changes, or empty outside a git checkout."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit, "dirty": dirty}


def save_result(
    out: Path, name: str, result: dict, plot: Callable[[dict, Path], Path], table: str
) -> None:
    """Write ``out/NAME.json`` (see ``dumps``) and ``out/NAME.png`` (see ``shrink_png``), print
    the Markdown table."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{name}.json"
    json_path.write_text(dumps(result))
    png_path = shrink_png(plot(result, out / f"{name}.png"))
    print(table)
    print(f"\nwrote {relative(str(json_path))} and {relative(str(png_path))}", file=sys.stderr)


def dumps(result: dict) -> str:
    """``result`` as indented JSON for a file in git: each list or dict of plain values (a curve's
    point, a row of numbers, a record) on one line, and the numbers directly inside lists (curves,
    traces) to 4 significant digits or more, as many as it takes for them to show the same to 0-4
    decimals (so a table quoting them does not change); a dict's numbers are kept exact."""

    def one_line(match: re.Match) -> str:
        # A JSON string holds no raw newline, so only whitespace between values goes.
        return re.sub(
            r"\n\s*([\]}])",
            r"\1",
            re.sub(r"([\[{])\n\s*", r"\1", re.sub(r",\n\s*", ", ", match[0])),
        )

    text = json.dumps(_short_in_lists(result), indent=2)
    return re.sub(r"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}", one_line, text) + "\n"


def _short_in_lists(value: Any, in_list: bool = False) -> Any:
    if isinstance(value, list):
        return [_short_in_lists(item, True) for item in value]
    if isinstance(value, dict):  # a record's own numbers stay exact, even in a list of records
        return {key: _short_in_lists(item) for key, item in value.items()}
    if not in_list or not isinstance(value, float) or not math.isfinite(value):
        return value
    for digits in range(4, 17):  # the shortest that shows as ``value`` does to 0-4 decimals
        short = float(f"{value:.{digits}g}")
        if all(f"{short:.{places}f}" == f"{value:.{places}f}" for places in range(5)):
            return short
    return value


def shrink_png(path: Path) -> Path:
    """Rewrite the PNG at ``path`` in 32 colours (result files live in git): a plot of lines,
    markers and text, or a strip of env frames, keeps its look at about a fifth of the bytes of
    matplotlib's RGBA. An octree palette: median cut spends its colours on the many pixels of
    the background and the antialiased greys, and turns the few of a frame's agent, key or box
    grey."""
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(
            32, Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE
        )
    small.save(path, optimize=True)
    return path


def coarse(curve: list, points: int = 100) -> list:
    """Every k-th entry of ``curve``, k chosen to keep at most ``points`` (and the last entry):
    how a summary in git keeps a per-step curve."""
    if len(curve) <= points:
        return list(curve)
    stride = math.ceil((len(curve) - 1) / (points - 1))
    kept = curve[::stride]
    return kept if kept[-1] == curve[-1] else [*kept, curve[-1]]


def write_steps(out: Path, name: str, result: dict) -> Path:
    """Write a per-step dump, compressed, to ``out/steps/NAME.json.gz``: outside git (see
    .gitignore), beside the summary that ``save_result`` writes to ``out/NAME.json``."""
    path = out / "steps" / f"{name}.json.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(result, separators=(",", ":")).encode(), mtime=0))
    print(f"wrote {relative(str(path))}", file=sys.stderr)
    return path


def read_result(path: Path) -> dict:
    """A result file: ``NAME.json``, or a per-step dump ``NAME.json.gz``."""
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=10
    )
    return done.stdout.strip()


def provenance() -> dict:
    """What every result records of how it was made: the command line (paths made
    repository-relative), the UTC date, the machine and the git state."""
    return {
        "command": shlex.join(["python", *(relative(arg) for arg in sys.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git_state(),
    }


def relative(arg: str) -> str:
    """``arg`` (or the value of ``key=value``) with an absolute path made repository-relative.

    Result files are shared, so they must not name this machine's folders: a path outside the
    repository keeps only its last component.
    """
    key, sep, value = arg.rpartition("=") if "=" in arg else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    try:
        value = str(Path(value).resolve().relative_to(REPO))
    except ValueError:
        value = f".../{Path(value).name}"
    return f"{key}{sep}{value}"


def warm_start(cfg: Config, out: Path) -> dict:
    """The controller's warm start, run in-process; saves the checkpoint every system starts from.

    Supervised slices of ``warm_start.check_every`` steps until the trainer's greedy accuracy on
    the probe reaches ``warm_start.target_accuracy`` (as ``LLMWorkload._warm_start``, without
    Ray)."""
    start = time.perf_counter()
    trainer, generator, rewarder = Trainer(cfg), Generator(cfg), Rewarder(cfg)
    generator.open_sync([trainer.open_sync("shm", ["generator"])])
    ws, steps, probe = cfg.warm_start, 0, 0.0
    while steps < ws.max_steps:
        trainer.warm_start(min(ws.check_every, ws.max_steps - steps))
        steps += min(ws.check_every, ws.max_steps - steps)
        if ws.target_accuracy > 0:
            probe = rewarder.score(trainer.probe())[0]["reward_mean"]
            if probe >= ws.target_accuracy:
                break
    trainer.save_pretrained(str(out))
    generator.update_weights(trainer.publish())
    heldout = accuracy(generator, rewarder, "heldout")
    trainer.close_sync()  # removes its shared-memory files
    return {
        "steps": steps,
        "probe_accuracy": probe,
        "heldout_accuracy": heldout,
        "time_s": time.perf_counter() - start,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
    }


def accuracy(generator: Generator, rewarder: Rewarder, split: str) -> float:
    """Greedy accuracy of the generator's model on a split, scored as in a relayrl run."""
    summary, _ = rewarder.score(generator.evaluate(split))
    return summary["reward_mean"]


def train_from(cfg: Config, run_dir: Path) -> dict:
    """Train one run (its summary to stderr, stdout kept for tables); its held-out curve, start
    and end accuracy, mean trained reward, books, mean pi/mu ratio, lag and wall clock."""
    with contextlib.redirect_stdout(sys.stderr):
        summary = train(cfg, run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    curve = sorted({r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}.items())
    trained = [
        r["rollout/trained_reward_mean"] for r in records if "rollout/trained_reward_mean" in r
    ]
    return {
        "start_accuracy": summary["eval"]["start"]["accuracy"],
        "final_accuracy": summary["eval"]["end"]["accuracy"],
        "eval_curve": curve,
        "trained_reward_mean": sum(trained) / len(trained) if trained else None,
        "samples_accounted": summary["samples"]["accounted"],
        "ratio_mean": summary["staleness"]["ratio_mean"],
        "staleness_mean": summary["staleness"]["mean"],
        "wall_clock_s": summary["wall_clock_s"],
        "warm_start_steps": summary.get("warm_start", {}).get("warm_start/steps"),
    }


def from_start(args: Any, tmp_dir: Path, extra: list[str]) -> Config:
    """One RL run's config: ``args.config`` with ``args.overrides``, async, ``args.steps`` steps
    from the warm-start checkpoint in ``tmp_dir / "start"``, held-out every ``args.eval_every``
    steps, quiet, no run checkpoints, written under ``tmp_dir``; then ``extra`` overrides."""
    return load_config(
        args.config,
        [
            *args.overrides,
            "mode=async",
            f"steps={args.steps}",
            f"model.path={tmp_dir / 'start'}",
            "warm_start.max_steps=0",
            f"log.eval_every={args.eval_every}",
            "log.progress=false",
            "log.tensorboard=false",
            "run.checkpoint_every=0",
            f"run.out_dir={tmp_dir}",
            *extra,
        ],
    )
