"""Run checkpoints and ``train(resume=True)`` through Ray: a resumed sync run ends with the same
parameters as the uninterrupted one, and a checkpoint that fails its hashes is skipped. (That an
async resume keeps the books and the staleness bound is checked on the resumes of the failed and
the interrupted runs of test_recovery.)"""

from __future__ import annotations

import json

import pytest
from conftest import SMALL_EMBODIED as EMBODIED
from conftest import SMALL_LLM as LLM
from conftest import check_books, interrupted_copy, tiny_config
from safetensors.torch import load_file

from relayrl.checkpoint_format import DIRECTORY
from relayrl.job import train


def _max_difference(a, b) -> float:
    one, two = (
        load_file(a / "checkpoint" / "model.safetensors"),
        load_file(b / "checkpoint" / "model.safetensors"),
    )
    assert one.keys() == two.keys()
    return max((one[k].float() - two[k].float()).abs().max().item() for k in one)


def _steps_logged(run) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "samples/trained" in r]


def test_a_resumed_sync_llm_run_of_two_ranks_ends_with_the_uninterrupted_parameters(
    ray_session, tmp_path, capfd
):
    cfg = tiny_config(
        *LLM,
        *("mode=sync", "steps=7", "run.checkpoint_every=2", "run.keep_checkpoints=3"),
        *("trainer.ranks=2", "generator.replicas=2"),  # each rank saves its shards
    )
    whole = train(cfg, tmp_path / "whole")
    run = tmp_path / "whole"
    assert [p.name for p in sorted((run / DIRECTORY).glob("step-*"))] == [
        "step-00000002",
        "step-00000004",
        "step-00000006",
    ]
    killed = interrupted_copy(run, 2, tmp_path, corrupt_after=4)
    resumed = train(cfg, killed, resume=True)

    assert "skipping checkpoint" in capfd.readouterr().err  # the corrupt step-4 one, by name
    assert resumed["resumes"][0]["step"] == 2
    assert resumed["resumes"][0]["checkpoint"] == "step-00000002"
    assert _max_difference(run, killed) <= 1e-6  # 5 steps after the checkpoint
    assert resumed["samples"] == whole["samples"]
    assert resumed["samples"]["accounted"]
    assert _steps_logged(killed) == list(range(1, 8))  # steps 3..7 once, after 1..2


def test_a_resumed_lockstep_embodied_run_ends_with_the_uninterrupted_parameters(
    ray_session, tmp_path
):
    cfg = tiny_config(
        *EMBODIED, "mode=sync", "steps=4", "run.checkpoint_every=1", "run.keep_checkpoints=5"
    )
    train(cfg, tmp_path / "whole")
    run = tmp_path / "whole"
    killed = interrupted_copy(run, 1, tmp_path)
    resumed = train(cfg, killed, resume=True)
    assert resumed["resumes"][0]["step"] == 1
    assert _max_difference(run, killed) <= 1e-6
    samples = check_books(resumed)
    assert samples["dropped_resume"] == 0 and samples["in_flight"] == 0


def test_resume_without_a_checkpoint_says_so(tmp_path):
    from relayrl.checkpoint_format import NoCheckpoint

    cfg = tiny_config(*LLM)
    with pytest.raises(NoCheckpoint, match="no usable checkpoint"):
        train(cfg, tmp_path / "empty", resume=True)
