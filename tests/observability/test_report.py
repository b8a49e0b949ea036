"""`relayrl report` on partial run directories (a run interrupted in the middle of RL is reported in
tests/test_kill.py's Ctrl-C test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from relayrl.observability.report import write_report

ROOT = Path(__file__).resolve().parents[2]


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
