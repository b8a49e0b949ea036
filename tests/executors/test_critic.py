"""Critic: token-level values, GAE with the reward on the last token, normalised advantages, value
regression; the trainer's use of per-token advantages; a PPO run with the critic placed."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import SMALL_LLM as SMALL
from conftest import tiny_config

from relayrl import job
from relayrl.executors.critic import Critic
from relayrl.executors.generator import Generator
from relayrl.executors.trainer import Trainer


def _sampled(cfg):
    """Two groups of two sampled completions of different lengths, rewards 1, 0, 0, 1."""
    generator = Generator(cfg)
    batch = generator.complete([[2, 4, 13, 5, 16], [2, 6, 13, 7, 16]], ["9", "13"], k=2)
    batch.rewards = np.array([1.0, 0.0, 0.0, 1.0], dtype=np.float32)
    return batch


@pytest.fixture
def start(tmp_path):
    cfg = tiny_config("trainer.advantage=gae", "critic.lam=1", "critic.gamma=1")
    Trainer(cfg).save_pretrained(str(tmp_path))
    return cfg, str(tmp_path)


def test_with_a_constant_value_every_token_of_a_completion_gets_its_reward_minus_v(start):
    """V = v everywhere, gamma = lam = 1: the TD errors telescope, A_t = R - v on every token of a
    completion; the advantages are then standardised over the batch's tokens."""
    cfg, path = start
    critic = Critic(cfg)
    critic.load(path)
    with torch.no_grad():
        critic.model.score.weight.zero_()
        critic.model.score.bias.fill_(0.25)
    batch = _sampled(cfg)
    summary, scored = critic.score(batch)
    raw = np.concatenate(
        [np.full(n, r - 0.25) for r, n in zip(batch.rewards, batch.completion_len, strict=True)]
    )
    expected = (raw - raw.mean()) / (raw.std(ddof=1) + 1e-8)
    got = scored.token_advantages[batch.completion_mask]
    assert np.allclose(got, expected, atol=1e-5)
    assert (scored.token_advantages[~batch.completion_mask] == 0).all()
    assert summary["samples"] == 4 and critic.updates == 1


def test_the_critic_learns_the_returns_of_a_batch(start):
    cfg, path = start
    critic = Critic(tiny_config("trainer.advantage=gae", "critic.lr=0.01"))
    critic.load(path)
    batch = _sampled(cfg)
    first = critic.score(batch)[0]
    for _ in range(30):
        last = critic.score(batch)[0]
    assert last["value_loss"] < 0.1 * first["value_loss"]
    assert last["explained_variance"] > 0.5
    restored = Critic(cfg)
    restored.load_state_dict(critic.state_dict())
    assert restored.updates == critic.updates
    stats = restored.stats()
    # 31 batches of 4 samples, critic.epochs steps each
    assert (stats.scored, stats.updates) == (4 * 31, 31 * critic.section.epochs)
    pairs = zip(restored.model.parameters(), critic.model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_the_trainer_steps_on_the_critics_token_advantages():
    cfg = tiny_config("trainer.advantage=gae", "trainer.lr=0.01")
    batch = _sampled(cfg)
    zero = Trainer(cfg)
    before = [p.detach().clone() for p in zero.model.parameters()]
    zero.train_step(replace(batch, token_advantages=np.zeros_like(batch.logprobs)))
    # zero advantages on every token: a zero gradient, and AdamW without decay stays put
    assert all(torch.equal(a, b) for a, b in zip(before, zero.model.parameters(), strict=True))
    moved = Trainer(cfg)
    advantages = np.where(batch.completion_mask, 1.0, 0.0).astype(np.float32)
    assert moved.train_step(replace(batch, token_advantages=advantages)).stepped
    assert any(not torch.equal(a, b) for a, b in zip(before, moved.model.parameters(), strict=True))
    with pytest.raises(ValueError, match="no token_advantages"):
        Trainer(cfg).train_step(batch)


def test_a_ppo_run_places_the_critic_and_logs_what_it_measured(ray_session, tmp_path):
    cfg = tiny_config(
        *SMALL, "mode=async", "steps=6", "trainer.advantage=gae", "trainer.loss=ppo_clip"
    )
    summary = job.train(cfg, tmp_path / "run")
    assert summary["status"] == "finished" and summary["samples"]["accounted"]
    roles = summary["topology"]["roles"]
    assert [m["name"] for m in roles["critic"]] == ["critic"]
    assert (tmp_path / "run" / "start_policy" / "model.safetensors").is_file()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert sum("loss/value" in r for r in records) == 6
    variance = [r["critic/explained_variance"] for r in records if "critic/value_loss" in r]
    assert len(variance) == 6 and all(np.isfinite(variance))
