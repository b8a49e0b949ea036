"""MetricsLog: JSONL always, TensorBoard and Weights & Biases (offline) when asked."""

from __future__ import annotations

import json
import time

import pytest

from relayrl.config import ConfigError, load_config
from relayrl.observability.metrics import EssWatch, MetricsLog


def test_jsonl_holds_every_logged_step(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.log(1, {"loss/value": 0.5, "note": "not a scalar"})
    log.log(2, {"loss/value": 0.25})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss/value"]) for r in rows] == [(1, 0.5), (2, 0.25)]
    assert "note" not in rows[0]


def test_wandb_offline_run_is_written_under_the_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="W&B is an optional extra: pip install 'relayrl[wandb]'")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(tmp_path, False, wandb_project="relayrl-test", config={"mode": "async"})
    log.log(1, {"rollout/accuracy": 0.25})
    log.log(2, {"rollout/accuracy": 0.75})
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (events,) = runs[0].glob("*.wandb")  # the record log that `wandb sync` uploads
    # History rows are protobuf records with JSON-encoded values. W&B's writer process may still
    # be flushing them when finish() returns on a loaded machine, so allow it a moment.
    deadline = time.monotonic() + 30
    while b"0.75" not in events.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    records = events.read_bytes()
    assert b"rollout/accuracy" in records and b"0.75" in records


def test_tensorboard_events_are_written(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=True)
    log.log(1, {"loss/value": 0.5})
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_wandb_project_validates_mode():
    with pytest.raises(ConfigError, match="log.wandb_mode"):
        load_config(None, ["log.wandb_project=x", "log.wandb_mode=cloud"])


def test_the_ess_watch_warns_once_per_stretch_of_low_ess_steps():
    watch = EssWatch(below=0.3, steps=3)
    essays = [0.2, 0.1, 0.5, 0.2, 0.2, 0.25, 0.1, 0.05, 0.9, 0.1, 0.1, 0.1]
    warned = [step for step, ess in enumerate(essays, 1) if watch.see(step, {"loss/ess": ess})]
    # the third low step in a row warns, and the stretch does not warn again; 0.9 ends it
    assert warned == [6, 12] and watch.warnings == 2
    assert watch.see(13, {"loss/ratio_mean": 1.0}) is None  # no ESS logged: nothing to say
    message = EssWatch(0.3, 1).see(7, {"loss/ess": 0.125})
    assert "step 7" in message and "under 0.3 for 1 steps (now 0.125)" in message
    off = EssWatch(below=0.0, steps=1)
    assert off.see(1, {"loss/ess": 0.0}) is None and off.warnings == 0
