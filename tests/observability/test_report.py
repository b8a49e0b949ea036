"""`relayrl report` on a finished run and on a run interrupted in the middle of RL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import TINY

from relayrl.observability.report import write_report

ROOT = Path(__file__).resolve().parents[2]


def test_report_of_a_run_interrupted_during_rl(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "relayrl.cli", "train", "configs/arith.yaml", *TINY]
    cmd += ["steps=100000", "log.every=1", "generator.prompts_per_step=4", f"--run-dir={run_dir}"]
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (
        not metrics.exists() or len(metrics.read_text().splitlines()) < 3
    ):
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr.decode()[-2000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["steps"] >= 2 and summary["samples"]["trained"] > 0
    report = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "report", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    text = (run_dir / "report.md").read_text()
    assert "status: **interrupted**" in text
    assert "![reward and accuracy](report/curves.png)" in text
    assert (run_dir / "report" / "curves.png").stat().st_size > 0


def test_report_of_a_run_with_only_a_torn_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "rollout/accuracy": 0.5, "rollout/reward_mean": 0.5})
        + '\n{"step": 2, "roll'
    )
    text = write_report(tmp_path).read_text()
    assert "unknown (no summary.json)" in text
    assert "No data for busy fractions" in text
    assert "report/curves.png" in text


def test_report_of_a_missing_directory_exits_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "report", str(tmp_path / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_report_shows_the_off_policy_health_metrics(tmp_path):
    rows = [
        {"step": 1, "loss/ess": 0.9, "loss/clip_frac": 0.0, "loss/grad_norm": 1.5},
        {"step": 2, "loss/ess": 0.2, "loss/clip_frac": 0.25, "loss/grad_norm": 3.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(tmp_path).read_text()
    assert "![off-policy health metrics](report/health.png)" in text
    assert "| ESS (normalised) | 0.2 | 0.2 | 0.9 |" in text
    assert "| truncated / masked / clipped | 0.25 | 0 | 0.25 |" in text
    assert "| gradient norm | 3 | 1.5 | 3 |" in text
    assert "KL" not in text  # not logged, not shown
    assert (tmp_path / "report" / "health.png").stat().st_size > 0
