"""``relayrl wm collect | pretrain | eval`` end to end in this process on tiny BabyAI frames and
models: the files land, pretraining lowers the held-out prediction error, the reports' numbers
are finite, collection never plays a target level with anything but the random policy, and bad
arguments exit 2 with one line naming them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from relayrl import cli
from relayrl.config import load_config
from relayrl.data.trajectories import load_episodes
from relayrl.wm.evaluate import auc, frame_strip, load_world_model

pytest.importorskip("minigrid")

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/babyai.yaml")
TARGET = "BabyAI-GoToLocalS7N4-v0"
TINY = [
    "env.image_size=28",
    "vla.patch_size=7",
    "world_model.backend=deterministic",
    "world_model.context_frames=2",
    "world_model.channels=8",
    "world_model.levels=1",
    "world_model.cond_dim=16",
    "world_model.reward_hidden=16",
    "world_model.lr=3e-3",
    "world_model.max_steps=6",
    "log.progress=false",
]


def wm(command: str, *args: str) -> int:
    return cli.main(["wm", command, CONFIG, *TINY, *args])


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Episodes collected off the target (noisy scripted) and on it (random), a world model
    pretrained on the first, and its evaluation on both."""
    root = tmp_path_factory.mktemp("wm")
    code = wm("collect", "--out", f"{root}/data", "--episodes", "24", "--policy", "noisy_scripted")
    assert code == 0
    code = wm("collect", "--out", f"{root}/target", "--episodes", "6", "--level", TARGET)
    assert code == 0
    args = ["--data", f"{root}/data", "--out", f"{root}/wm", "--steps", "10", "--heldout", "0.25"]
    assert wm("pretrain", *args, "--batch-size", "8") == 0
    args = ["--world-model", f"{root}/wm", "--data", f"{root}/target", "--data", f"{root}/data"]
    assert wm("eval", *args, "--horizon", "3") == 0
    return root


def finite(values: object) -> bool:
    """Every number inside ``values`` (nested dicts and lists) is finite."""
    if isinstance(values, dict):
        return all(finite(v) for v in values.values())
    if isinstance(values, list):
        return all(finite(v) for v in values)
    return not isinstance(values, float) or math.isfinite(values)


def test_collect_writes_shards_and_a_manifest_of_what_made_them(root):
    manifest = json.loads((root / "data/manifest.json").read_text())
    episodes = load_episodes(root / "data")

    assert manifest["episodes"] == len(episodes) == 24
    assert manifest["steps"] == sum(e.steps for e in episodes)
    assert manifest["producer"]["policy"] == "noisy_scripted"
    assert manifest["producer"]["noise"] == 0.3
    assert "wm collect" in manifest["producer"]["command"]
    first = episodes[0]
    assert first.frames.dtype == np.uint8 and first.frames.shape[1:] == (1, 28, 28, 3)
    assert first.frames.shape[0] == first.steps + 1 and first.actions.shape == (first.steps, 1)
    assert first.instruction.startswith("go to")
    assert sum(e.success for e in episodes) == manifest["successes"] > 0


def test_collect_defaults_to_the_configs_levels_other_than_the_target(root):
    manifest = json.loads((root / "data/manifest.json").read_text())

    assert manifest["producer"]["target_levels"] == [TARGET]
    assert TARGET not in manifest["per_task"]
    assert set(manifest["per_task"]) == {"BabyAI-GoToLocalS5N2-v0", "BabyAI-GoToLocalS6N3-v0"}
    target = json.loads((root / "target/manifest.json").read_text())
    assert list(target["per_task"]) == [TARGET] and target["producer"]["policy"] == "random"


def test_pretrain_saves_both_models_where_world_model_path_loads_them(root):
    for part in ("observation", "reward"):
        assert (root / "wm" / part / "model.safetensors").is_file()
        assert (root / "wm" / part / "config.json").is_file()
    cfg = load_config(CONFIG, [*TINY, f"world_model.path={root}/wm"], world_model=True)
    obs, reward = load_world_model(cfg.world_model.path)
    assert obs.cfg.backend == "deterministic" and obs.cfg.context_frames == 2
    assert reward.cfg.image_size == 28
    rows = [json.loads(line) for line in (root / "wm/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(11))


def test_pretraining_lowers_the_heldout_prediction_error(root):
    report = json.loads((root / "wm/pretrain.json").read_text())

    assert finite(report)
    start, end = report["heldout_start"], report["heldout_end"]
    # The deterministic model starts as "copy the last frame", so beating its start beats that.
    assert start["heldout/obs_mse"] == pytest.approx(start["heldout/copy_last_mse"], rel=1e-4)
    assert end["heldout/obs_mse"] < start["heldout/obs_mse"]
    assert report["split"]["heldout_episodes"] == 6
    assert report["split"]["train_failure_frames"] >= 0
    assert "heldout/failure_acc" in report["heldout_end"]


def test_eval_reports_finite_errors_success_scores_and_both_success_rates(root, capsys):
    report = json.loads((root / "wm/eval.json").read_text())

    assert finite(report)
    # Only the held-out episodes of the pretraining data count, beside all of the other folder.
    assert report["episodes"] == 6 + 6
    assert set(report["data"].values()) == {
        "held-out episodes of the pretraining data",
        "all episodes (not pretrained on)",
    }
    step = report["observation"]["per_step"]
    assert step["mse"] > 0 and step["psnr"] == pytest.approx(-10 * math.log10(step["mse"]))
    assert len(report["observation"]["rollout"]["mse"]) == 3
    assert 0 <= report["reward"]["accuracy"] <= 1
    assert report["reward"]["auc"] is None or 0 <= report["reward"]["auc"] <= 1
    # The failure head (on by default) is scored over the same frames at its own threshold.
    failure = report["reward"]["failure"]
    assert failure["frames"] == report["reward"]["frames"]
    assert failure["failure_frames"] + report["reward"]["success_frames"] <= report["episodes"]
    assert failure["auc"] is None or 0 <= failure["auc"] <= 1
    play = report["policy"]
    assert 0 <= play["imagined_success"] <= 1 and 0 <= play["real_success"] <= 1
    assert play["same_start_frames"] == 1.0  # the real env restarted every episode exactly
    assert 0 <= play["imagined_failed_early"] <= 1 and 0 <= play["real_failed_early"] <= 1


def test_eval_draws_the_real_and_imagined_frames_beside_its_report(root):
    strip = matplotlib.image.imread(root / "wm/eval_frames.png")
    # 4 pairs of rows of 28-pixel frames (one view) with 1-pixel lines; 12 frames across.
    assert strip.shape[:2] == (4 * 2 * 29, 12 * 29)


def test_a_frame_strip_puts_real_above_imagined_and_blacks_out_the_ended_steps():
    real = np.full((3, 2, 2, 2, 3), 200, np.uint8)  # 2 steps, 2 views of 2 x 2 pixels
    imagined = np.full((2, 2, 2, 2, 3), 100, np.uint8)  # ended a step earlier
    strip = frame_strip([(real, imagined)], steps=3)
    assert strip.shape == (2 * (4 + 1), 3 * (2 + 1), 3)
    assert (strip[0:4, 0:2] == 200).all() and (strip[4:8, 0:2] == 100).all()  # views stacked
    assert (strip[0:4, 6:8] == 200).all() and (strip[4:8, 6:8] == 0).all()  # imagined ended
    assert (strip[:, 2] == 128).all() and (strip[8:] == 128).all()  # grey lines


def test_auc_by_ranks_matches_hand_counted_pairs():
    # Pairs (positive, negative) ranked right: 0.35 > 0.1, 0.8 > 0.1, 0.8 > 0.4; wrong: 0.35 < 0.4.
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1], bool)) == 0.75
    assert auc(np.array([0.5, 0.5]), np.array([False, True])) == 0.5  # a tie counts half
    assert auc(np.array([0.5, 0.7]), np.array([True, True])) is None


BAD = {
    "scripted-on-target": (
        ["collect", "--out", "{tmp}/x", "--episodes", "2", "--policy", "noisy_scripted"]
        + ["--level", TARGET],
        f"--level {TARGET} is a target level of the config",
    ),
    "noise-without-scripted": (
        ["collect", "--out", "{tmp}/x", "--noise", "0.5"],
        "--noise 0.5: only --policy noisy_scripted reads it",
    ),
    "no-episodes": (["collect", "--out", "{tmp}/x", "--episodes", "0"], "--episodes must be in"),
    "unknown-level": (
        ["collect", "--out", "{tmp}/x", "--level", "BabyAI-Nope-v0"],
        "level 'BabyAI-Nope-v0' is not a registered",
    ),
    "not-a-checkpoint": (
        ["collect", "--out", "{tmp}/x", "--policy", "{tmp}"],
        "is not a saved VLA policy: vla_config.json and model.safetensors missing",
    ),
    "heldout-out-of-range": (
        ["pretrain", "--data", "{root}/data", "--out", "{tmp}/m", "--heldout", "1.5"],
        "--heldout must be in (0, 1), got 1.5",
    ),
    "not-episodes": (
        ["pretrain", "--data", "{tmp}", "--out", "{tmp}/m"],
        "holds no manifest.json: not a folder written by relayrl wm collect",
    ),
    "out-not-empty": (
        ["pretrain", "--data", "{root}/data", "--out", "{root}/wm"],
        "is not empty; choose a new folder",
    ),
    "not-a-world-model": (
        ["eval", "--world-model", "{tmp}", "--data", "{root}/data"],
        "no observation/config.json; expected a folder written by relayrl wm pretrain",
    ),
    "bad-horizon": (
        ["eval", "--world-model", "{root}/wm", "--data", "{root}/data", "--horizon", "0"],
        "--horizon must be >= 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_exit_2_with_one_line_naming_them(case, root, tmp_path, capsys):
    args, expected = BAD[case]
    args = [a.format(tmp=tmp_path, root=root) for a in args]
    capsys.readouterr()

    code = wm(*args)

    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"relayrl: wm {args[0]}: ") and expected in err
    assert not (tmp_path / "x").exists()


def test_an_llm_config_is_refused(capsys):
    code = cli.main(["wm", "collect", str(REPO / "configs/arith.yaml"), "--out", "x"])

    assert code == 2
    assert "relayrl wm needs an embodied config" in capsys.readouterr().err


def save_policy(folder: Path) -> None:
    """A tiny untrained VLA policy saved as an embodied run saves its checkpoint."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from relayrl.models.vla import VLAConfig, VLAPolicy

    cfg = VLAConfig(image_size=28, patch_size=7, channels=4, d_model=8, heads=2, conv_layers=0)
    folder.mkdir()
    save_file(VLAPolicy(cfg).state_dict(), str(folder / "model.safetensors"))
    (folder / "vla_config.json").write_text(json.dumps(asdict(cfg)))


def test_collect_plays_a_saved_vla_policy_off_the_target_and_refuses_it_on_it(tmp_path, capsys):
    save_policy(tmp_path / "ckpt")
    policy = ["--policy", str(tmp_path / "ckpt"), "--episodes", "2"]

    assert wm("collect", "--out", f"{tmp_path}/data", *policy) == 0
    manifest = json.loads((tmp_path / "data/manifest.json").read_text())
    assert manifest["producer"]["policy"] == str(tmp_path / "ckpt")
    assert TARGET not in manifest["per_task"]
    capsys.readouterr()
    assert wm("collect", "--out", f"{tmp_path}/on", *policy, "--level", TARGET) == 2
    assert "allowed there: --policy random" in capsys.readouterr().err


def test_noisy_bot_advice_is_the_bots_action_whatever_the_noise_took() -> None:
    """``advice`` is the bot's own action: without noise every action taken is the advice and the
    episodes succeed; with noise 1 the actions are random, the advice is still given each step and
    differs from what was taken at some step."""
    from relayrl.envs.babyai import BabyAIEnv
    from relayrl.wm.policies import NoisyScriptedPolicy

    env = BabyAIEnv("BabyAI-GoToLocalS5N2-v0", image_size=28, seed=3)
    clean = NoisyScriptedPolicy(env.action_space, 0.0, seed=0)
    wins = 0
    for _ in range(5):
        obs = env.reset()
        clean.reset(env)
        while True:
            action = int(clean.act(obs)[0])
            assert action == clean.advice
            result = env.step(action)
            if result.terminated or result.truncated:
                wins += bool(result.success)
                break
            obs = result.obs
    assert wins == 5

    noisy = NoisyScriptedPolicy(env.action_space, 1.0, seed=0)
    obs = env.reset()
    noisy.reset(env)
    differed = 0
    for _ in range(6):
        action = int(noisy.act(obs)[0])
        assert noisy.advice in (0, 1, 2)
        differed += action != noisy.advice
        result = env.step(action)
        if result.terminated or result.truncated:
            break
        obs = result.obs
    assert differed >= 1
    env.close()
