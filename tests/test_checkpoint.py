"""Run checkpoint files: atomic commit, manifest hashes, pruning, newest-valid lookup."""

from __future__ import annotations

import json

import pytest
import torch

from relayrl import checkpoint_format
from relayrl.checkpoint_format import NoCheckpoint, commit, latest, load_part, save_part, staging


def _write(run_dir, step: int, keep: int = 10, value: float = 1.0):
    staged = staging(run_dir, step)
    entries = [save_part(staged, "trainer_0", {"w": torch.full((4,), value)})]
    entries.append(save_part(staged, "controller", {"step": step}))
    return commit(staged, step, entries, keep)


def test_a_committed_checkpoint_has_a_manifest_with_every_file_and_reads_back(tmp_path):
    path = _write(tmp_path, 3, value=2.5)
    assert path == tmp_path / "checkpoints" / "step-00000003"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3
    assert sorted(e["file"] for e in manifest["files"]) == ["controller.pt", "trainer_0.pt"]
    assert all(len(e["sha256"]) == 64 and e["bytes"] > 0 for e in manifest["files"])
    assert checkpoint_format.verify(path) is None
    assert torch.equal(load_part(path, "trainer_0")["w"], torch.full((4,), 2.5))
    assert not list((tmp_path / "checkpoints").glob(".step-*")), "the staging directory remains"


def test_only_the_newest_keep_checkpoints_and_no_partial_ones_survive_a_commit(tmp_path):
    for step in (1, 2, 3, 4):
        _write(tmp_path, step, keep=2)
    staging(tmp_path, 9)  # a write that died before its commit
    _write(tmp_path, 5, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000005"]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: (p / "trainer_0.pt").write_bytes(b"x" * 10), "bytes, the manifest says"),
        (lambda p: (p / "controller.pt").unlink(), "controller.pt is missing"),
        (lambda p: (p / "manifest.json").unlink(), "no readable manifest.json"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_with_its_name_and_reason(tmp_path, damage, reason):
    _write(tmp_path, 2, value=2.0)
    newest = _write(tmp_path, 4, value=4.0)
    damage(newest)
    warnings: list[str] = []
    found = latest(tmp_path, warn=warnings.append)
    assert found.name == "step-00000002"
    assert len(warnings) == 1 and str(newest) in warnings[0] and reason in warnings[0]


def test_a_flipped_byte_fails_the_hash(tmp_path):
    path = _write(tmp_path, 1)
    data = bytearray((path / "trainer_0.pt").read_bytes())
    data[-20] ^= 0x01
    (path / "trainer_0.pt").write_bytes(bytes(data))
    assert checkpoint_format.verify(path) == "trainer_0.pt fails its SHA-256"
    with pytest.raises(NoCheckpoint, match="no usable checkpoint"):
        latest(tmp_path, warn=lambda line: None)


def test_rewriting_a_step_replaces_the_old_checkpoint_of_that_step(tmp_path):
    _write(tmp_path, 2, value=1.0)
    path = _write(tmp_path, 2, value=7.0)
    assert torch.equal(load_part(path, "trainer_0")["w"], torch.full((4,), 7.0))
    assert checkpoint_format.verify(path) is None
