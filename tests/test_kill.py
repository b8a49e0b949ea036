"""A real ``relayrl train`` process group SIGKILLed during a train step, during weight sync and
during a checkpoint write; ``relayrl train --resume`` finishes each run with the parameters of
the uninterrupted run, balanced books, and no shared-memory files or processes left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SMALL_LLM as SMALL
from conftest import TINY, orphan_shm_files
from safetensors.torch import load_file

from relayrl.config import load_config
from relayrl.faults import PAUSE_AT, PAUSE_MARKER
from relayrl.job import train

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    *TINY,
    *SMALL,
    *("mode=sync", "steps=7", "warm_start.max_steps=0"),
    *("run.checkpoint_every=2", "run.keep_checkpoints=4"),
]
CONFIG = str(ROOT / "configs" / "arith.yaml")


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final parameters of the same run, never killed."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    train(load_config(CONFIG, RUN), run_dir)
    return load_file(run_dir / "checkpoint" / "model.safetensors")


def _cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "train", *args],
        env=env or os.environ.copy(),
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group and session, to kill and to look for
        **kwargs,
    )


def _session_processes(sid: int) -> list[str]:
    """Live processes of session ``sid`` (Ray moves actors into process groups of their own, so
    the session, not the group, is what finds what a run started)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(stat.parent.name)
    return found


def _wait_gone(sid: int, timeout_s: float = 60.0) -> list[str]:
    deadline = time.time() + timeout_s
    while (left := _session_processes(sid)) and time.time() < deadline:
        time.sleep(0.5)
    return left


def _run_until_killed(args: list[str], point: str, tmp_path: Path, name: str) -> None:
    """``relayrl train ARGS`` until it pauses at ``point``, then SIGKILL its whole session."""
    marker = tmp_path / f"{name}.paused"
    env = os.environ | {PAUSE_AT: point, PAUSE_MARKER: str(marker)}
    log = tmp_path / f"{name}.log"
    with log.open("w") as out:
        proc = _cli(*args, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"never paused at {point}: {log.read_text()}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert _wait_gone(proc.pid) == [], f"the run killed at {point} left processes behind"


def test_a_run_killed_three_times_resumes_to_the_uninterrupted_result(uninterrupted, tmp_path):
    """Killed during a train step (step 3), during weight sync (step 5's publish, after a resume
    from step 2) and while writing a checkpoint (step 6's, after a resume from step 4)."""
    run_dir = tmp_path / "run"
    _run_until_killed([CONFIG, "--run-dir", str(run_dir), *RUN], "train_step@3", tmp_path, "first")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "running"
    resume = ["--resume", str(run_dir)]
    # A resumed run publishes the checkpoint's weights first: publish 4 is step 5's.
    _run_until_killed(resume, "publish@4", tmp_path, "second")
    _run_until_killed(resume, "checkpoint@1", tmp_path, "third")
    assert list((run_dir / "checkpoints").glob(".step-00000006.partial"))

    with (tmp_path / "last.log").open("w") as log:
        last = _cli(*resume, stdout=log, stderr=subprocess.STDOUT)
        assert last.wait(timeout=300) == 0, (tmp_path / "last.log").read_text()
    assert _wait_gone(last.pid) == [], "the resumed run left processes behind"
    assert orphan_shm_files() == [], "shared-memory files of the killed runs are still there"

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 7
    assert [r["step"] for r in summary["resumes"]] == [2, 4, 4]
    samples = summary["samples"]
    assert samples["accounted"] and samples["trained"] == samples["generated"] == 7 * 16
    final = load_file(run_dir / "checkpoint" / "model.safetensors")
    assert max((final[k] - uninterrupted[k]).abs().max().item() for k in final) <= 1e-6
    assert not list((run_dir / "checkpoints").glob(".step-*")), "a partial checkpoint remains"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "samples/trained" in r] == list(range(1, 8))


def test_sigterm_writes_a_checkpoint_that_resume_finishes_from(tmp_path):
    """SIGTERM (what ``kill`` and batch schedulers send) stops a run as Ctrl-C does: the same
    handler (``cli.install_stop_handlers``) writes a checkpoint after the step in progress."""
    run_dir = tmp_path / "run"
    # Steps of this tiny run take milliseconds: 400 of them outlast the wait for the first.
    run = [*RUN, "steps=400", "run.checkpoint_every=0"]
    with (tmp_path / "interrupted.log").open("w") as log:
        proc = _cli(CONFIG, "--run-dir", str(run_dir), *run, stdout=log, stderr=log)
        metrics, deadline = run_dir / "metrics.jsonl", time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and '"samples/trained"' in metrics.read_text():
                break
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, (
            tmp_path / "interrupted.log"
        ).read_text()
    assert "SIGTERM: stopping after this step" in (tmp_path / "interrupted.log").read_text()
    assert _wait_gone(proc.pid) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["resume"].endswith(str(run_dir))
    stopped_at = summary["steps"]
    assert 1 <= stopped_at < 400
    report = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    text = (run_dir / "report.md").read_text()
    assert "status: **interrupted**" in text and f"RL steps: {stopped_at}" in text
    assert "![reward and accuracy](report/curves.png)" in text
    assert (run_dir / "report" / "curves.png").stat().st_size > 0
    assert [p.name for p in (run_dir / "checkpoints").glob("step-*")] == [f"step-{stopped_at:08d}"]

    last = stopped_at + 3
    with (tmp_path / "resumed.log").open("w") as log:
        resumed = _cli("--resume", str(run_dir), f"steps={last}", stdout=log, stderr=log)
        assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == last
    assert summary["resumes"][0]["step"] == stopped_at and summary["samples"]["accounted"]
