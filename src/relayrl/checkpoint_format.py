"""The run checkpoint's files: written atomically, verified by content hashes, pruned to the newest
few.

A checkpoint is a directory ``RUN_DIR/checkpoints/step-00000012`` of ``torch.save`` files, one per
part (``controller``, ``trainer_0``, ``generator_0``, ...), and a ``manifest.json`` that lists
every file with its size and SHA-256. It is built under a hidden temporary name, every file and
the directory are fsynced, and only then is it renamed into place, so a crash mid-write leaves no
directory that looks finished. Trainer ranks write their own parts (their state never passes
through the controller); the controller's ``Checkpointer`` (``relayrl.checkpoint``) writes the
rest and the manifest.

Reading goes newest first and skips (with a message naming it) a checkpoint whose manifest is
missing or whose files are missing, of another size, or fail their hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from relayrl.weight_sync.disk import fsync_path

DIRECTORY = "checkpoints"
MANIFEST = "manifest.json"
FORMAT = 1


class NoCheckpoint(FileNotFoundError):
    """The run directory holds no checkpoint that passes its manifest."""


def staging(run_dir: Path, step: int) -> Path:
    """The (emptied) temporary directory the parts of step ``step``'s checkpoint are written to."""
    path = run_dir / DIRECTORY / f".step-{step:08d}.partial"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def save_part(directory: Path | str, name: str, state: Any) -> dict:
    """``torch.save`` ``state`` as ``directory/name.pt``, fsynced; returns its manifest entry."""
    path = Path(directory) / f"{name}.pt"
    with path.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}


def load_part(directory: Path | str, name: str) -> Any:
    """What ``save_part`` wrote (pickled objects included: only load checkpoints you wrote)."""
    return torch.load(Path(directory) / f"{name}.pt", weights_only=False)


def commit(staged: Path, step: int, entries: list[dict], keep: int) -> Path:
    """Write the manifest, fsync, rename ``staged`` to ``step-{step}``, and prune to ``keep``.

    A finished checkpoint of the same step (a resume from an older one reached it again) is
    replaced. Returns the checkpoint's directory.
    """
    manifest = {"format": FORMAT, "step": step, "time": time.time(), "files": entries}
    path = staged / MANIFEST
    with path.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(staged)
    final = staged.parent / f"step-{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.rename(staged, final)
    fsync_path(staged.parent)
    prune(staged.parent.parent, keep)
    return final


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` finished checkpoints, and leftover partial ones."""
    root = run_dir / DIRECTORY
    if not root.is_dir():
        return
    for partial in root.glob(".step-*.partial"):
        shutil.rmtree(partial, ignore_errors=True)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest(run_dir: Path, warn: Any = print) -> Path:
    """The newest checkpoint of ``run_dir`` that passes its manifest; older ones are tried in turn
    after ``warn``-ing (one line each) why a newer one was skipped."""
    root = run_dir / DIRECTORY
    found = sorted(root.glob("step-*"), reverse=True) if root.is_dir() else []
    for path in found:
        problem = verify(path)
        if problem is None:
            return path
        warn(f"skipping checkpoint {path}: {problem}")
    raise NoCheckpoint(
        f"{run_dir} holds no usable checkpoint (looked for {root}/step-*/{MANIFEST}); "
        "run.checkpoint_every sets how often a run writes one"
    )


def verify(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be used, or None when every file matches."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return f"no readable {MANIFEST} ({type(err).__name__})"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')!r}, this relayrl reads {FORMAT}"
    for entry in manifest["files"]:
        file = path / entry["file"]
        if not file.is_file():
            return f"{entry['file']} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"{entry['file']} has {size} bytes, the manifest says {entry['bytes']}"
        if _sha256(file) != entry["sha256"]:
            return f"{entry['file']} fails its SHA-256"
    return None


def part_names(path: Path) -> list[str]:
    """The names of the parts the checkpoint at ``path`` holds, as its manifest lists them."""
    manifest = json.loads((path / MANIFEST).read_text())
    return [entry["file"].removesuffix(".pt") for entry in manifest["files"]]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
