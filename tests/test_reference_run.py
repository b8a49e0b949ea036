"""Runs with the KL term: the reference role is placed, scores every batch, survives being
killed, and the trainer reports the KL to it every step; a resumed run reloads it from its own
directory."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import SMALL_LLM as SMALL
from conftest import Kept, kill_at, tiny_config

from relayrl.checkpoint_format import DIRECTORY, load_part
from relayrl.pipeline import Pipeline, Stage, StageExecutor


class KeptPipeline(Pipeline):
    """A pipeline whose workload is kept in ``MADE``, where ``kill_at`` reaches its actors."""

    def workload(self) -> Kept:
        """The pipeline's ``LLMWorkload``, kept."""
        return Kept(self.cfg, stages=self.stages)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_kl_to_the_reference_starts_at_zero_grows_and_survives_a_dead_reference(
    ray_session, tmp_path, monkeypatch, mode
):
    """The sync run also has a stage of its own and checkpoints: a copy of it in another
    directory, cut back to its step-2 checkpoint, resumes with the reference weights of that
    directory's copy and the stage's counter going on from the checkpoint's."""
    cfg = tiny_config(
        *SMALL,
        f"mode={mode}",
        "steps=8",
        "max_staleness=0",  # on-policy: step 1 trains the reference's own samples
        "trainer.kl_coef=0.1",
        "trainer.lr=0.01",
        "log.every=1",
        "sync.timeout_s=5",
        *(["run.checkpoint_every=2", "run.keep_checkpoints=4"] if mode == "sync" else []),
    )
    pipeline = KeptPipeline(cfg, stages=[Stage("counter", Counter)] if mode == "sync" else [])
    whole = tmp_path / "whole"
    todo = kill_at(monkeypatch, [(4, "reference", 0, "ray.kill")])
    summary = pipeline.train(whole)
    assert todo == []

    assert summary["status"] == "finished" and summary["steps"] == 8
    assert [f["name"] for f in summary["failures"]["reference"]] == ["reference"]
    assert summary["samples"]["accounted"]
    assert (whole / "start_policy" / "model.safetensors").is_file()
    records = [json.loads(line) for line in (whole / "metrics.jsonl").open()]
    kl = {r["step"]: r["loss/kl_ref"] for r in records if "loss/kl_ref" in r}
    assert sorted(kl) == list(range(1, 9))  # every step, the replacement's included
    assert abs(kl[1]) < 1e-5  # version 0 is the reference
    assert kl[8] > 1e-4  # the policy moved away from it
    if mode == "async":
        return

    moved = tmp_path / "moved"
    shutil.copytree(whole, moved)
    for later in (moved / DIRECTORY).glob("step-*"):
        if later.name != "step-00000002":
            shutil.rmtree(later)
    shutil.rmtree(whole / "start_policy")  # only the moved copy can serve it now
    resumed = pipeline.train(moved, resume=True)
    assert resumed["resumes"][0]["step"] == 2 and resumed["samples"]["accounted"]
    last = moved / DIRECTORY / "step-00000004"
    assert load_part(last, "counter")["seen"] == 4 * 16  # 2 steps before the stop, 2 after
    assert load_part(last, "reference")["path"] == str(moved / "start_policy")


class Counter(StageExecutor):
    """Counts the samples it saw; its count is its state."""

    name = "counter"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.seen = 0

    def score(self, batch):
        self.seen += len(batch)
        return self.summary(batch), batch

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]
