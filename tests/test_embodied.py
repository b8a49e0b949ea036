"""The embodied workload end to end through Ray on BabyAI with a tiny VLA: sync and async runs keep
exact books of every env step, change the policy, bound the lag, and survive a crashing env."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    IMAGINING,
    QUIET,
    check_books,
    interrupted_copy,
    left_shm_files,
    shm_files,
    tiny_config,
)
from conftest import SMALL_EMBODIED as SMALL
from safetensors.torch import load_file

from relayrl.checkpoint_format import DIRECTORY
from relayrl.config import ConfigError, EnvConfig, load_config
from relayrl.executors.worker_side import BLIND_INSTRUCTION, build_env
from relayrl.job import train
from relayrl.models.vla import VLAConfig, VLAPolicy


class CrashingEnv:
    """An env whose every ``every``-th step raises, like a flaky simulator."""

    def __init__(self, env, every: int):
        self.env, self.every, self.calls = env, every, 0
        self.action_space, self.tasks = env.action_space, env.tasks

    def reset(self, *, task=None, seed=None):
        return self.env.reset(task=task, seed=seed)

    def step(self, action):
        self.calls += 1
        if self.calls % self.every == 0:
            raise RuntimeError("simulator crashed")
        return self.env.step(action)

    def close(self):
        self.env.close()


def crashing_babyai(ec: EnvConfig, seed: int) -> CrashingEnv:
    # Every 7th step: with 4-step segments a crash then finds 2 steps in the open segment unless
    # an episode ended just before it. (Every 9th step crashed right after two whole segments,
    # so whether any steps were lost depended on episode lengths, which vary with timing.)
    return CrashingEnv(build_env(ec, seed), every=7)


def changed_parameters(summary: dict, seed: int) -> list[str]:
    """Names of checkpoint tensors that differ from the trainer's initial (seeded) policy."""
    path = summary["artifacts"]["checkpoint"]
    with open(f"{path}/vla_config.json") as f:
        vla = VLAConfig(**json.load(f))
    torch.manual_seed(seed)
    initial = VLAPolicy(vla).state_dict()
    saved = load_file(f"{path}/model.safetensors")
    return [k for k, v in saved.items() if not torch.equal(v, initial[k])]


def test_sync_lockstep_run_is_on_policy_and_moves_the_policy_and_value_heads(ray_session, tmp_path):
    cfg = tiny_config(*SMALL, "mode=sync")
    before = shm_files()
    summary = train(cfg, tmp_path / "run")
    assert left_shm_files(before) == [], "the run left its shm weight-sync files behind"
    assert summary["status"] == "finished" and summary["workload"] == "embodied"
    assert summary["steps"] == summary["updates"] == 3
    samples = check_books(summary)
    assert samples["in_flight"] == 0 and samples["dropped_stale"] == 0
    assert summary["staleness"]["hist"] == {"0": samples["trained"]}
    assert samples["trained"] >= 3 * 16  # every round fills a super-batch
    assert summary["eval"]["start"]["version"] == 0 and summary["eval"]["end"]["version"] == 3
    assert summary["eval"]["end"]["n"] == 4
    assert {"action_head.weight", "value_head.mlp.2.weight"} <= set(
        changed_parameters(summary, cfg.run.seed)
    )
    assert summary["sync"]["publishes"] == 4  # version 0 and one per step
    assert set(summary["perf"]["busy"]) == {"trainer", "inference_service", "rollout_workers"}
    assert summary["rollout"]["episodes"] > 0 and summary["rollout"]["env_errors"] == 0
    assert set(summary["rollout"]["success_rate"]["per_task"]) == {"BabyAI-GoToLocalS7N4-v0"}


# The socket with one env per worker is the default every other async embodied test runs.
@pytest.mark.parametrize(("transport", "envs"), [("ray", 1), ("socket", 2)])
def test_async_run_bounds_the_lag_keeps_the_books_and_contains_env_crashes(
    ray_session, tmp_path, transport, envs
):
    # The env factory lives in this module, which Ray's workers cannot import.
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = tiny_config(
        *SMALL,
        "mode=async",
        "max_staleness=1",
        "steps=4",
        f"experiment.inference_transport={transport}",
        f"rollout.envs_per_worker={envs}",
    )
    summary = train(cfg, tmp_path / "run", make_env=functools.partial(crashing_babyai, cfg.env))
    assert summary["status"] == "finished" and summary["steps"] == 4
    samples = check_books(summary)
    assert summary["rollout"]["env_errors"] > 0 and samples["dropped_error"] > 0
    assert "RuntimeError: simulator crashed" in summary["rollout"]["last_errors"][0]
    assert summary["staleness"]["max"] <= 1
    assert sum(summary["staleness"]["hist"].values()) == samples["trained"]
    assert summary["eval"]["end"]["version"] == summary["updates"] >= 1
    assert changed_parameters(summary, cfg.run.seed)
    assert summary["sync"]["publishes"] == summary["updates"] + 1
    assert 0 <= summary["replay"]["occupancy_end"] <= 1
    assert summary["dwr"]["weights"] == {"BabyAI-GoToLocalS7N4-v0": 1.0}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    versions = [m["version"] for m in metrics if "version" in m]
    # With two envs a worker outruns this tiny trainer and the buffer fills with segments at the
    # staleness bound; the fetch ahead drops them for the trainer's next version, so none arrives
    # stale and every step takes its optimizer step (it once dropped whole batches).
    assert versions == [1, 2, 3, 4]
    # Real env steps the workers had finished by each step: counted, never falling, and within
    # what the run generated (open segments and env errors aside) and at least what it trained.
    put = [m["samples/real_put_total"] for m in metrics if "samples/real_put_total" in m]
    assert len(put) == 4 and put == sorted(put)
    assert samples["trained"] <= put[-1] <= samples["generated"]


# The lockstep run also forces a lag of one version: the ranks publish their held shards.
@pytest.mark.parametrize(("mode", "lag"), [("sync", 1), ("async", 0)])
def test_two_trainer_ranks_and_two_inference_replicas_serve_train_and_keep_the_books(
    ray_session, tmp_path, mode, lag
):
    cfg = tiny_config(
        *SMALL,
        f"mode={mode}",
        "trainer.ranks=2",
        "inference.replicas=2",
        f"inference.min_lag={lag}",
        "max_staleness=2",
    )
    summary = train(cfg, tmp_path / "run")
    samples = check_books(summary)
    assert summary["updates"] == summary["steps"] == 3
    hist = summary["staleness"]["hist"]
    assert sum(hist.values()) == samples["trained"]
    if lag:  # step 1 trains on version 0 at version 0; steps 2 and 3 one version behind
        assert set(hist) == {"0", "1"} and hist["1"] > hist["0"] > 0
    assert changed_parameters(summary, cfg.run.seed)
    # Each replica serves its own workers and ends on the trainer's last version (less the lag).
    inference = summary["perf"]["inference"]
    assert inference["replicas"] == 2 and min(inference["requests_per_replica"]) > 0
    assert inference["versions"] == [3 - lag, 3 - lag]
    assert summary["sync"]["publishes"] == summary["updates"] + 1
    names = [a["name"] for a in summary["topology"]["roles"]["inference_service"]]
    assert names == ["inference_service_0", "inference_service_1"]


def test_the_blind_control_sees_one_constant_instruction():
    env = build_env(EnvConfig(image_size=28, blind=True), seed=0)
    obs = env.reset()
    assert obs.instruction == BLIND_INSTRUCTION and obs.image.shape == (1, 28, 28, 3)
    assert env.step(2).obs.instruction == BLIND_INSTRUCTION
    env.close()


# The lockstep run also sends its weights in place over dist: which tasks the workers play and
# how the weights reach the service are independent.
def test_curriculum_opens_stages_in_order_and_an_in_place_dist_lockstep_serves_every_version(
    ray_session, tmp_path
):
    easy, hard = "BabyAI-GoToLocalS5N2-v0", "BabyAI-GoToLocalS6N3-v0"
    cfg = tiny_config(
        *SMALL,
        "mode=sync",
        "sync.transport=dist",
        "sync.in_place=true",
        f"env.tasks=[{easy},{hard}]",
        f"env.eval_tasks=[{hard}]",
        "rollout.curriculum=true",
        "rollout.curriculum_max_steps=2",
        "steps=5",
    )
    summary = train(cfg, tmp_path / "run")
    check_books(summary)
    sync = summary["sync"]
    assert sync["transport"] == "dist" and sync["lost"] == {}
    assert sync["publishes"] == summary["updates"] + 1 == 6  # version 0 and one per step
    assert summary["staleness"]["hist"] == {"0": summary["samples"]["trained"]}
    assert summary["eval"]["end"]["version"] == 5  # the service evaluated the last version
    assert summary["curriculum"]["enabled"] and summary["curriculum"]["stage"] == hard
    assert summary["curriculum"]["opened_at_step"] == {easy: 0, hard: 2}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    staged = [m for m in metrics if "curriculum/stage" in m]
    assert [m["curriculum/stage"] for m in staged] == [0, 1, 1, 1, 1]
    # The stage's window empties when the next opens (step 2) and refills from its episodes.
    assert staged[1]["curriculum/stage_episodes"] == 0
    assert "curriculum/stage_success" not in staged[1]
    filled = [m["curriculum/stage_episodes"] for m in staged[1:]]
    assert filled == sorted(filled) and filled[-1] > 0
    assert staged[-1]["curriculum/stage_success"] == summary["curriculum"]["stage_success_rate"]
    assert set(summary["eval"]["start"]["per_task"]) == {hard}
    assert set(summary["eval"]["end"]["per_task"]) == {hard}


def test_the_acce_preset_trains_its_value_head_and_a_closed_stage_is_never_played(
    ray_session, tmp_path
):
    """configs/presets/acce.yaml over the small embodied run: fused recompute (one optimizer step
    per micro-batch), the D.2 value head and AcceRL's DWR; the books balance. Its two tasks are
    curriculum stages, and the workers play only the open one whatever DWR weighs."""
    preset = Path(__file__).resolve().parents[1] / "configs" / "presets" / "acce.yaml"
    easy, hard = "BabyAI-GoToLocalS5N2-v0", "BabyAI-GoToLocalS6N3-v0"
    stages = [f"env.tasks=[{easy},{hard}]", "rollout.curriculum=true"]
    cfg = load_config(None, [*QUIET, *SMALL, "mode=async", *stages], [preset])
    assert cfg.trainer.value_recompute == "fused" and cfg.vla.value_head == "acce"
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "finished" and summary["updates"] == 3
    check_books(summary)
    changed = changed_parameters(summary, cfg.run.seed)
    assert any(name.startswith("value_head.") for name in changed)
    assert summary["curriculum"]["stage"] == easy  # tiny run: never solved, no step budget
    assert set(summary["rollout"]["success_rate"]["per_task"]) == {easy}


def test_imagination_trains_on_imagined_segments_and_keeps_both_books(ray_session, tmp_path):
    """AcceRL-WM on the small run: the workers step WorldModelEnvs beside their real envs, the
    world-model trainer (two ranks) fine-tunes both models every step and its replicas serve the
    new versions; real and imagined env steps each balance their books, also after a resume from
    a checkpoint that fell with imagined episodes in progress, and the trace has the world-model
    rows."""
    # A checkpoint every step: the imagined envs play most of the time, so some checkpoint of
    # the four before the last step falls with imagined episodes in progress.
    cfg = tiny_config(
        *SMALL,
        *IMAGINING,
        "steps=5",
        "run.checkpoint_every=1",
        "run.keep_checkpoints=5",
        "world_model.ranks=2",
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "finished" and summary["steps"] == 5
    check_books(summary)
    imagined = summary["imagined_samples"]
    assert imagined["accounted"] and imagined["trained"] > 0
    assert imagined["generated"] == imagined["by_live_workers"] > 0
    assert imagined["episodes"] > 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    per_step = [m["samples/imagined_trained"] for m in metrics if "samples/imagined_trained" in m]
    key = "samples/imagined_trained_total"
    totals = [m[key] for m in metrics if key in m]
    assert sum(per_step) == totals[-1] == imagined["trained"]  # the books' count, step by step
    wm = summary["world_model"]
    assert wm["version"] >= 1 and wm["updates"]["obs"] >= 2 and wm["b_wm"]["added_steps"] > 0
    assert wm["service"]["versions"] == [wm["version"]] and wm["service"]["requests"] > 0
    rows = {"world_model_trainer_0", "world_model_trainer_1", "world_model_service"}
    assert (
        rows <= set(summary["perf"]["busy"])
        and summary["perf"]["busy"]["world_model_trainer_1"] > 0
    )

    def imagining_at(step: int) -> int:
        """Imagined episodes in progress when checkpoint ``step`` fell."""
        found = (tmp_path / "run" / DIRECTORY / f"step-{step:08d}").glob("rollout_worker_*.pt")
        saved = [torch.load(path, weights_only=False)["imagination"] for path in found]
        assert len(saved) == 2
        return sum(s["playing"] for s in saved)

    # The last checkpoint before the end that fell mid-imagination: the resume drops those.
    mid = [step for step in (1, 2, 3, 4) if imagining_at(step) > 0]
    assert mid, "no checkpoint fell with imagined episodes in progress"
    at = mid[-1]
    resumed = train(cfg, interrupted_copy(tmp_path / "run", at, tmp_path), resume=True)
    assert resumed["status"] == "finished" and resumed["steps"] == 5
    check_books(resumed)
    imagined = resumed["imagined_samples"]
    assert imagined["accounted"] and imagined["trained"] > 0
    assert imagined["generated"] == imagined["by_live_workers"] > 0
    record = resumed["resumes"][0]
    assert record["step"] == at and record["imagined_dropped_resume"] == imagined["dropped_resume"]
    # A round kept (the checkpoint waits for the one in progress) and one more after the resume;
    # a round starts after a step only once the one before it has ended.
    assert resumed["world_model"]["version"] >= 2


def test_a_pretrained_world_model_of_other_sizes_is_refused_naming_them(tmp_path):
    from relayrl.models.world_model import (
        ObsModelConfig,
        SuccessModel,
        SuccessModelConfig,
        build_obs_model,
        save_pretrained,
    )
    from relayrl.workloads.saved_models import check_saved_world_model

    obs = ObsModelConfig(backend="deterministic", image_size=16, channels=8, cond_dim=16)
    reward = SuccessModelConfig(image_size=16, channels=8, hidden=16)
    save_pretrained(build_obs_model(obs), tmp_path / "observation")
    save_pretrained(SuccessModel(reward), tmp_path / "reward")
    check_saved_world_model(str(tmp_path), obs, reward)  # the same sizes pass
    with_head = SuccessModelConfig(image_size=16, channels=8, hidden=16, failure_head=True)
    with pytest.raises(ConfigError, match=r"reward/ has other sizes .*failure_head=False \(this"):
        check_saved_world_model(str(tmp_path), obs, with_head)
    with pytest.raises(ConfigError, match="world_model.path=.*config.json and model.safetens"):
        check_saved_world_model(str(tmp_path / "nothing"), obs, reward)


def test_workers_that_wait_for_room_stay_within_it_and_stop_for_a_checkpoint(ray_session, tmp_path):
    # Two envs per worker outrun this tiny trainer (the test above), filling the buffer to 43
    # steps and more; with replay.wait_at a worker waits after a put that leaves 8 steps unless
    # the trainer's fetch waits for its batch (16), so the buffer never holds more than 15 steps
    # plus one round of every worker (2 workers x 2 segments of 4 steps), and a checkpoint's stop
    # reaches workers that are waiting.
    cfg = tiny_config(
        *SMALL,
        "mode=async",
        "max_staleness=2",
        "steps=6",
        "rollout.envs_per_worker=2",
        "replay.wait_at=8",
        "run.checkpoint_every=2",
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "finished" and summary["steps"] == 6
    samples = check_books(summary)
    replay = summary["replay"]
    assert 16 <= replay["resident_max_steps"] <= 15 + 2 * 2 * 4
    assert samples["dropped_overflow"] == 0
    assert replay["wait_at"] == 8 and replay["writer_wait_s"] > 0
    written = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert written[-2:] == ["step-00000002", "step-00000004"]  # mid-run, workers stopped
