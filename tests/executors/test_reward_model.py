"""Reward-model executor: a sequence classifier's score of (prompt, completion), mixed with the
rule reward by weights; and a run with the reward_model role placed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SMALL_LLM as SMALL
from conftest import tiny_config, tiny_reward_model
from transformers import LlamaConfig, LlamaForSequenceClassification

from relayrl import job
from relayrl.executors.generator import Generator
from relayrl.executors.reward_model import RewardModel
from relayrl.models.lm import load_tokenizer


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny random one-label Llama classifier with the character tokenizer."""
    return tiny_reward_model(tmp_path_factory.mktemp("rm"), seed=0)


def _batch(cfg):
    generator = Generator(cfg)
    batch = generator.complete([[2, 4, 13, 5, 16], [2, 6, 13, 7, 16]], ["9", "13"], k=2)
    batch.rewards = np.array([1.0, 0.0, 0.0, 1.0], dtype=np.float32)
    return batch


def test_rewards_are_the_weighted_sum_of_rule_reward_and_score(classifier):
    cfg = tiny_config(
        f"reward_model.path={classifier}", "reward_model.weight=2", "reward_model.rule_weight=0.5"
    )
    rm = RewardModel(cfg)
    batch = _batch(cfg)
    summary, scored = rm.score(batch)
    prompts, completions = rm._texts(batch)
    # one pair at a time, without padding: the batched scores do not depend on the batch
    alone = np.array([rm.scores([p], [c])[0] for p, c in zip(prompts, completions, strict=True)])
    assert np.allclose(scored.rewards, 0.5 * batch.rewards + 2 * alone, atol=1e-5)
    assert len(set(alone.round(5))) > 1  # the score depends on the text
    assert summary["samples"] == 4 and summary["score_mean"] == pytest.approx(alone.mean())
    assert scored.stage_metrics["reward_model/score_mean"] == summary["score_mean"]
    assert rm.stats().scored == 4 and rm.state_dict() == {"scored": 4, "errors": 0, "timeouts": 0}


def test_a_classifier_with_more_than_one_label_is_refused(tmp_path):
    tokenizer = load_tokenizer("builtin:char")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has 2 labels; a reward model has 1"):
        RewardModel(tiny_config(f"reward_model.path={tmp_path}"))


def test_a_run_with_a_reward_model_trains_on_the_mixed_reward(ray_session, classifier, tmp_path):
    cfg = tiny_config(
        *SMALL, "mode=async", "steps=4", f"reward_model.path={classifier}", "reward_model.weight=3"
    )
    summary = job.train(cfg, tmp_path / "run")
    assert summary["status"] == "finished" and summary["samples"]["accounted"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if "rollout/trained_reward_mean" in r]
    assert len(steps) == 4
    # the trained reward is the mix: it differs from the rule reward the metrics report
    assert any(r["rollout/trained_reward_mean"] != r["rollout/reward_mean"] for r in steps)
    topology = json.loads((tmp_path / "run" / "summary.json").read_text())["topology"]
    assert "reward_model" in json.dumps(topology)
