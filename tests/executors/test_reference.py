"""Reference executor and the trainer's KL term: log-probs under the frozen policy, KL in the
loss and in the reward, against hand-derived numbers."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import tiny_config

from relayrl.executors.generator import Generator
from relayrl.executors.reference import Reference
from relayrl.executors.trainer import Trainer
from relayrl.models.lm import token_logprobs


def _sampled(cfg):
    """Two groups of two completions sampled by a fresh generator (the trainer's initial
    weights: both are built from the same seed), rewards 1, 0 in each group."""
    generator = Generator(cfg)
    batch = generator.complete([[2, 4, 13, 5], [2, 6, 13, 7]], ["x", "y"], k=2, max_new_tokens=3)
    batch.rewards = np.array([1.0, 0.0, 1.0, 0.0], dtype=np.float32)
    return batch


def _params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_the_reference_scores_the_log_probs_the_policy_sampled_with(tmp_path):
    cfg = tiny_config("trainer.kl_coef=0.1")
    Trainer(cfg).save_pretrained(str(tmp_path))
    reference = Reference(cfg)
    reference.load(str(tmp_path))
    batch = _sampled(cfg)
    summary, scored = reference.score(batch)
    mask = batch.completion_mask
    assert np.allclose(scored.ref_logprobs[mask], batch.logprobs[mask], atol=1e-5)
    assert (scored.ref_logprobs[~mask] == 0).all()
    assert abs(summary["kl_mu_ref"]) < 1e-4 and summary["samples"] == 4
    state = {"path": str(tmp_path), "scored": 4, "errors": 0, "timeouts": 0}
    assert reference.state_dict() == state
    assert reference.stats().scored == 4
    restored = Reference(cfg)
    older = {"path": str(tmp_path), "scored": 4}  # a checkpoint from before errors, timeouts
    restored.load_state_dict(older)
    assert restored.state_dict() == state and restored.model is not None


def test_kl_in_the_loss_is_zero_at_the_reference_and_k3_of_a_shifted_reference():
    """ref = log pi: k3 = 0 with zero gradient, so the step is the plain one. ref = log pi - 1
    on every token: log r = -1, k3 = e^-1 - 1 + 1 = e^-1 on every token."""
    cfg = tiny_config("trainer.kl_coef=0.5", "trainer.kl_in=loss", "trainer.lr=0.01")
    batch = _sampled(cfg)
    own = Trainer(cfg)
    with torch.no_grad():
        aligned = token_logprobs(
            own.model,
            torch.from_numpy(batch.tokens),
            torch.from_numpy(batch.prompt_len + batch.completion_len),
            cfg.generator.temperature,
        ).numpy()
    logp = np.zeros_like(batch.logprobs)
    logp[:, 1:] = np.where(batch.completion_mask[:, 1:], aligned, 0.0)
    at_ref = own.train_step(replace(batch, ref_logprobs=logp))
    plain = Trainer(tiny_config("trainer.lr=0.01"))
    plain.train_step(batch)
    assert at_ref.metrics["loss/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    pairs = zip(_params(own), _params(plain), strict=True)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in pairs)

    shifted = Trainer(cfg).train_step(replace(batch, ref_logprobs=logp - 1.0))
    assert shifted.metrics["loss/kl_ref"] == pytest.approx(math.exp(-1), abs=1e-5)


def test_kl_in_the_reward_subtracts_each_completions_summed_estimate():
    """k1 with mu - ref = 0.25 on every token: a completion of n tokens loses kl_coef * n / 4."""
    cfg = tiny_config("trainer.kl_coef=0.2", "trainer.kl_in=reward", "trainer.kl_estimator=k1")
    batch = _sampled(cfg)
    ref = np.where(batch.completion_mask, batch.logprobs - 0.25, 0.0).astype(np.float32)
    result = Trainer(cfg).train_step(replace(batch, ref_logprobs=ref))
    expected = 0.2 * 0.25 * batch.completion_len.mean()
    assert result.metrics["rollout/kl_penalty"] == pytest.approx(expected, abs=1e-6)
    assert result.metrics["rollout/reward_mean"] == 0.5  # the task's reward, unshaped


def test_a_batch_without_reference_log_probs_is_refused_when_the_kl_term_is_on():
    cfg = tiny_config("trainer.kl_coef=0.1")
    with pytest.raises(ValueError, match="no ref_logprobs"):
        Trainer(cfg).train_step(_sampled(cfg))


def test_a_bf16_reference_scores_nearly_the_fp32_log_probs(tmp_path):
    cfg = tiny_config("trainer.kl_coef=0.1")
    Trainer(cfg).save_pretrained(str(tmp_path))
    batch = _sampled(cfg)
    scored = {}
    for dtype in ("fp32", "bf16"):
        reference = Reference(tiny_config("trainer.kl_coef=0.1", f"reference.dtype={dtype}"))
        reference.load(str(tmp_path))
        scored[dtype] = reference.score(batch)[1].ref_logprobs[batch.completion_mask]
    gap = np.abs(scored["fp32"] - scored["bf16"])
    assert 0 < gap.max() < 0.1
