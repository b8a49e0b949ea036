"""One evaluator: ``relayrl eval RUN`` on a run's saved checkpoint reports, task by task, what the
run's final in-run evaluation reported (embodied and LLM); and the lockstep loop hands the
segments to the trainer by reference, so no segment or observation (collected or evaluated)
passes through the driver."""

from __future__ import annotations

import json

import ray
from conftest import SMALL_EMBODIED, SMALL_LLM, check_books, tiny_config

from relayrl import controller
from relayrl.cli import main
from relayrl.config import save_config
from relayrl.envs.embodied import Observation
from relayrl.job import train
from relayrl.types import Segment


def test_a_lockstep_runs_segments_skip_the_driver_and_eval_replays_its_final_evaluation(
    ray_session, tmp_path, monkeypatch, capsys
):
    # Sampled actions over six episodes: lengths and successes differ between seeds and weights.
    cfg = tiny_config(*SMALL_EMBODIED, "mode=sync", "steps=2", "env.eval_episodes=6")
    passed: list = []
    train_step = controller._train_step

    async def recorded(trainer, *batch_refs):
        passed.append(batch_refs)
        return await train_step(trainer, *batch_refs)

    loaded: list = []

    def counted(self, state):  # unpickling one in this process goes through here
        loaded.append(type(self).__name__)
        self.__dict__.update(state)

    monkeypatch.setattr(controller, "_train_step", recorded)
    for kind in (Segment, Observation):  # neither collecting nor evaluating passes them here
        monkeypatch.setattr(kind, "__setstate__", counted, raising=False)
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert loaded == [], "the driver unpickled segments or observations"
    assert len(passed) == 2 and all(
        refs and all(isinstance(r, ray.ObjectRef) for r in refs) for refs in passed
    )
    samples = check_books(summary)
    assert summary["staleness"]["hist"] == {"0": samples["trained"]}

    end = summary["eval"]["end"]
    assert end["version"] == 2 and end["n"] == 6
    assert main(["eval", str(run)]) == 0
    report = json.loads((run / "eval-seeded.json").read_text())
    assert report["seed"] == cfg.run.seed and report["greedy"] is False
    for task, row in end["per_task"].items():
        replayed = report["tasks"][task]
        assert {k: replayed[k] for k in row} == row
    assert report["episodes"] == 6 and task in capsys.readouterr().out
    # The same check fails for other episodes: another seed plays other ones.
    again = ["eval", str(run), "--seed", str(cfg.run.seed + 1), "--out", str(tmp_path / "x")]
    assert main(again) == 0
    other = json.loads((tmp_path / "x").read_text())["tasks"][task]
    assert other["seeds"] != report["tasks"][task]["seeds"]


def test_eval_of_an_llm_run_replays_its_final_held_out_evaluation(ray_session, tmp_path, capsys):
    cfg = tiny_config(*SMALL_LLM, "mode=sync", "steps=2", "warm_start.max_steps=300")
    run = tmp_path / "run"
    summary = train(cfg, run)
    end = summary["eval"]["end"]
    assert end["version"] == 2 and end["n"] == cfg.task.heldout_size
    assert end["accuracy"] > 0  # the warm start solves some: the numbers compared carry signal
    assert main(["eval", str(run)]) == 0
    assert "held-out addition" in capsys.readouterr().out
    report = json.loads((run / "eval-heldout.json").read_text())
    assert (
        report["per_task"]
        == end["per_task"]
        == {"addition": {"n": cfg.task.heldout_size, "accuracy": end["accuracy"]}}
    )
    assert report["accuracy"] == end["accuracy"]


def test_eval_of_an_llm_run_refuses_the_options_its_protocol_does_not_read(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "config.json").write_text("{}")
    save_config(tiny_config(*SMALL_LLM), run / "config.yaml")
    assert main(["eval", str(run), "--k", "4", "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert "--k, --seed:" in err and "is an LLM run" in err and len(err.splitlines()) == 1
