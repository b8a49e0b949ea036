"""Helpers shared by the benchmark scripts: machine description, git state, result files."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import ray
import torch

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
    """Write ``out/NAME.json`` and ``out/NAME.png``, print the Markdown table."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    png_path = plot(result, out / f"{name}.png")
    print(table)
    print(f"\nwrote {relative(str(json_path))} and {relative(str(png_path))}", file=sys.stderr)


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=10
    )
    return done.stdout.strip()


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
