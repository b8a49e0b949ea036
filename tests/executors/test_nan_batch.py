"""A batch that makes the loss or the gradient nan leaves every trainer as it was, and is counted.

Each of the four trainers (LLM policy, VLA policy, critic, world model) takes its optimizer steps
through ``trainer_core.GradientStep``. Each test first takes a good step (so that the optimizer
holds moments, which a careless skip would still decay), then feeds a bad batch and checks that
weights, optimizer state, schedule and version are bit for bit as before and that the skip is
counted; then that a good batch steps again.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_VLA, assert_bit_identical, core_state, segment, tiny_config

from relayrl.config import load_config
from relayrl.data.trajectories import Episode
from relayrl.executors.critic import Critic
from relayrl.executors.trainer import Trainer
from relayrl.executors.vla_trainer import VLATrainer
from relayrl.executors.world_model_trainer import WorldModelTrainer
from relayrl.models.world_model import ObsModelConfig, SuccessModelConfig
from relayrl.types import RolloutBatch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def completions(rows: int, *, version: int = 0) -> RolloutBatch:
    """Groups of 2 samples of version ``version``: a 3-token prompt, 2 completion tokens of
    behaviour log-prob -1, rewards 1, 0, 1, 0, ..."""
    tokens = np.tile(np.array([[2, 4, 13, 5, 1]]), (rows, 1))
    tokens[:, 3] = 5 + np.arange(rows) % 3
    versions = np.full((rows, 5), -1)
    versions[:, 3:] = version
    return RolloutBatch(
        tokens=tokens,
        prompt_len=np.full(rows, 3),
        completion_len=np.full(rows, 2),
        logprobs=np.where(versions >= 0, -1.0, 0.0).astype(np.float32),
        versions=versions,
        finished=np.ones(rows, dtype=bool),
        group_size=2,
        answers=["x"] * rows,
        rewards=np.tile(np.array([1.0, 0.0], dtype=np.float32), rows // 2),
    )


def test_the_llm_trainer_skips_a_batch_with_a_nan_behaviour_log_prob():
    trainer = Trainer(tiny_config("trainer.weight_decay=0.1"))  # decay alone would move weights
    assert trainer.train_step(completions(4)).stepped
    before = core_state(trainer)
    bad = completions(4, version=1)
    bad.logprobs[0, 3] = np.nan  # a nan loss and nan gradients

    result = trainer.train_step(bad)

    assert not result.stepped and result.skipped_nonfinite == 1 and result.version == 1
    assert_bit_identical(core_state(trainer), before)
    assert trainer.stats().skipped_nonfinite == 1
    assert trainer.train_step(completions(4, version=1)).stepped and trainer.version == 2


def test_the_vla_trainer_skips_a_batch_with_a_nan_reward():
    cfg = load_config(
        None,
        [
            "workload=embodied",
            "env.image_size=8",
            "vla.patch_size=4",
            "trainer.minibatch_steps=1000",
            "trainer.epochs=1",
            "log.progress=false",
        ],
    )
    trainer = VLATrainer(cfg, TINY_VLA)
    assert trainer.train_step([segment(3, seed=0), segment(2, seed=1)]).stepped
    before = core_state(trainer)
    bad = segment(3, seed=2, version=1)
    bad.rewards[1] = np.nan  # nan advantages and returns: a nan loss

    result = trainer.train_step([bad])

    assert not result.stepped and result.skipped_nonfinite == 1 and result.version == 1
    assert result.trained == 3  # the env steps are booked as trained; the step was not taken
    assert_bit_identical(core_state(trainer), before)
    assert trainer.stats().skipped_nonfinite == 1
    assert trainer.train_step([segment(3, seed=3, version=1)]).stepped and trainer.version == 2


def test_the_critic_skips_a_batch_with_a_nan_reward(tmp_path):
    cfg = tiny_config("trainer.advantage=gae", "critic.lr=0.01")
    Trainer(cfg).save_pretrained(str(tmp_path))
    critic = Critic(cfg)
    critic.load(str(tmp_path))
    critic.score(completions(4))
    assert critic.updates == 1
    state = critic.state_dict()
    before = {"model": state["model"], "gradient_step": state["gradient_step"]}
    bad = completions(4)
    bad.rewards[2] = np.nan  # nan returns: a nan value loss

    _, scored = critic.score(bad)

    state = critic.state_dict()
    after = {"model": state["model"], "gradient_step": state["gradient_step"]}
    skips = after["gradient_step"].pop("skipped_nonfinite")
    before["gradient_step"].pop("skipped_nonfinite")
    assert_bit_identical(after, before)
    assert skips == 1 and critic.updates == 1
    assert critic.stats().skipped_nonfinite == 1
    assert scored.stage_metrics["critic/skipped_nonfinite"] == 1.0
    _, scored = critic.score(completions(4))
    assert critic.updates == 2 and scored.stage_metrics["critic/skipped_nonfinite"] == 0.0


SIZE = 8


def episode(steps: int, seed: int, success: bool) -> Episode:
    """Random 8x8 frames and actions; ``success`` labels the last frame."""
    rng = np.random.default_rng(seed)
    return Episode(
        frames=rng.integers(0, 256, (steps + 1, 1, SIZE, SIZE, 3), dtype=np.uint8),
        actions=rng.integers(0, 4, (steps, 1)).astype(np.int64),
        rewards=np.zeros(steps, np.float32),
        instruction="go to the square",
        task="toy",
        seed=seed,
        success=success,
        terminated=success,
        truncated=not success,
    )


def test_the_world_model_trainer_skips_a_nan_step_of_one_model_and_steps_the_other():
    cfg = load_config(
        None,
        [
            "workload=embodied",
            "world_model.backend=deterministic",
            "world_model.channels=8",
            "world_model.cond_dim=16",
            "world_model.context_frames=2",
            "world_model.batch_size=4",
            "world_model.train_steps=2",
            "world_model.train_obs_every=1",
            "world_model.train_reward_every=1",
            "log.progress=false",
        ],
        world_model=True,
    )
    obs = ObsModelConfig(
        backend="deterministic",
        image_size=SIZE,
        context_frames=2,
        action_vocab=4,
        channels=8,
        cond_dim=16,
    )
    reward = SuccessModelConfig(image_size=SIZE, channels=4, hidden=8, instruction_tokens=4)
    trainer = WorldModelTrainer(cfg, obs, reward)
    trainer.add_episodes([episode(5, s, success=s == 0) for s in range(3)])
    assert trainer.train(1).version == 1
    before = trainer.state_dict()
    good_loss = trainer.model.obs.loss
    trainer.model.obs.loss = lambda batch: good_loss(batch) * float("nan")  # nan gradients too

    result = trainer.train(2)

    after = trainer.state_dict()
    # M_obs's two steps were skipped; M_reward's two were taken and bump the version.
    assert result.trained_reward and not result.trained_obs and result.version == 2
    assert result.skipped_nonfinite == 2 and result.metrics["world_model/skipped_nonfinite"] == 2
    assert "world_model/loss_obs" not in result.metrics
    assert np.isfinite(result.metrics["world_model/loss_reward"])
    assert trainer.stats().skipped_nonfinite == 2
    assert trainer.stats().updates == {"obs": 2, "reward": 4}
    obs_keys = [k for k in before["model"] if k.startswith("obs.")]
    assert obs_keys and all(torch.equal(after["model"][k], before["model"][k]) for k in obs_keys)
    assert any(
        not torch.equal(after["model"][k], before["model"][k])
        for k in before["model"]
        if k.startswith("reward.")
    )
    # Adam's per-parameter state of M_obs is untouched: the skipped steps left no trace.
    obs_ids = range(len(list(trainer.model.obs.parameters())))
    for i in obs_ids:
        assert_bit_identical(after["optimizer"]["state"][i], before["optimizer"]["state"][i])

    del trainer.model.obs.loss  # the good loss again
    result = trainer.train(3)
    assert result.trained_obs and result.skipped_nonfinite == 0 and result.version == 3
