"""VLA trainer: GAE per micro-batch, values from the current critic, staleness drops, updates."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import TINY_VLA, assert_bit_identical, core_state, nan_on_calls, segment
from safetensors.torch import load_file

from relayrl.config import ConfigError, load_config
from relayrl.executors.vla_trainer import VLATrainer, critic_values, micro_batches, pad_segments
from relayrl.models.vla import VLAConfig, VLAPolicy
from relayrl.types import Segment
from relayrl.weight_sync import TRANSPORTS


def make_trainer(*overrides: str) -> VLATrainer:
    cfg = load_config(
        None, ["workload=embodied", "env.image_size=8", "vla.patch_size=4", *overrides]
    )
    return VLATrainer(cfg, TINY_VLA)


def naive_gae(policy: VLAPolicy, seg: Segment, gamma: float, lam: float) -> np.ndarray:
    """One segment at a time, with a plain reversed loop."""
    with torch.no_grad():
        ids = policy.tokenize([seg.instruction] * (len(seg) + 1))
        _, values = policy(torch.from_numpy(seg.images), ids, torch.from_numpy(seg.steps))
    values = values.numpy()
    adv, running = np.zeros(len(seg)), 0.0
    for t in reversed(range(len(seg))):
        last = t == len(seg) - 1
        next_value = 0.0 if (last and seg.terminated) else values[t + 1]
        running = seg.rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        adv[t] = running
    return adv


SEGMENTS = [
    segment(3, seed=0),
    segment(1, seed=1, terminated=True),
    segment(4, seed=2, terminated=True),
    segment(2, seed=3),
]


def test_micro_batches_are_consecutive_and_hold_at_most_max_steps():
    groups = micro_batches(SEGMENTS, 4)
    assert [[len(s) for s in g] for g in groups] == [[3, 1], [4], [2]]
    assert [len(g) for g in micro_batches(SEGMENTS, 1)] == [1, 1, 1, 1]  # one at least


def test_gae_per_micro_batch_equals_gae_on_the_whole_batch_and_a_naive_loop():
    small = make_trainer("trainer.minibatch_steps=2", "trainer.gamma=0.9", "trainer.lam=0.8")
    whole = make_trainer("trainer.minibatch_steps=1000", "trainer.gamma=0.9", "trainer.lam=0.8")
    a, b = small.advantages(SEGMENTS), whole.advantages(SEGMENTS)
    torch.testing.assert_close(a["advantages"], b["advantages"])
    torch.testing.assert_close(a["returns"], b["returns"])
    naive = np.concatenate([naive_gae(whole.policy, s, 0.9, 0.8) for s in SEGMENTS])
    np.testing.assert_allclose(b["advantages"].numpy(), naive, rtol=1e-5, atol=1e-5)
    assert b["instructions"][:4] == ["go to the red ball"] * 3 + ["open the door"]


def test_values_come_from_the_current_critic_not_the_recorded_ones():
    trainer = make_trainer()
    seg = segment(1, seed=1, terminated=True)
    before = trainer.advantages([seg])["advantages"]
    seg.values[:] = 100.0  # behaviour values are ignored
    torch.testing.assert_close(trainer.advantages([seg])["advantages"], before)
    with torch.no_grad():  # V + 0.5 everywhere: a one-step terminal A = r - V drops by 0.5
        trainer.policy.value_head.mlp[2].bias += 0.5
    after = trainer.advantages([seg])["advantages"]
    torch.testing.assert_close(after, before - 0.5)


def test_timeout_terminal_ends_a_truncated_episode_without_its_bootstrap():
    # One step cut at the step limit: A = r + gamma * V(last) - V(first) when bootstrapped,
    # r - V(first) when the timeout is terminal; the difference is gamma * V(last).
    cut = segment(1, seed=1)
    cut.episode_done = True  # truncated: the episode ended, not terminated
    boot = make_trainer("trainer.gamma=0.9")
    ends = make_trainer("trainer.gamma=0.9", "trainer.timeout_terminal=true")
    with torch.no_grad():
        ids = boot.policy.tokenize([cut.instruction] * 2)
        _, values = boot.policy(torch.from_numpy(cut.images), ids, torch.from_numpy(cut.steps))
    a = boot.advantages([cut])["advantages"]
    b = ends.advantages([cut])["advantages"]  # same seed: the same policy
    torch.testing.assert_close(a, cut.rewards[0] + 0.9 * values[1] - values[0][None])
    torch.testing.assert_close(b, cut.rewards[0] - values[0][None])
    # A segment that stops mid-episode still bootstraps with the option on.
    open_ = segment(1, seed=1)
    torch.testing.assert_close(ends.advantages([open_])["advantages"], a)


def test_a_step_changes_parameters_bumps_the_version_and_reports_losses():
    trainer = make_trainer("trainer.minibatch_steps=4", "trainer.epochs=2")
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    result = trainer.train_step(SEGMENTS)
    metrics = result.metrics
    assert trainer.version == result.version == 1 and metrics["version"] == 1.0 and result.stepped
    changed = [k for k, v in trainer.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert "action_head.weight" in changed and "value_head.mlp.2.weight" in changed
    assert result.trained == 10 and trainer.trained == 10
    assert metrics["rollout/accuracy"] == 1.0 and metrics["rollout/episodes_ended"] == 2
    assert result.lags == [10, 0, 0] and metrics["staleness/max"] == 0
    assert np.isfinite(
        [metrics["loss/policy"], metrics["loss/value"], metrics["loss/entropy"]]
    ).all()
    assert trainer.tracer.spans[-1].name == "train_step"


def test_stale_segments_are_dropped_and_counted():
    trainer = make_trainer("max_staleness=2")
    trainer.version = 5
    batch = [segment(3, seed=0, version=2), segment(2, seed=1, version=3)]
    batch[1].versions[0] = 4  # a segment's oldest action decides
    result = trainer.train_step(batch)
    assert (result.dropped_stale, result.trained) == (3, 2)
    assert result.lags == [0, 1, 1] and result.metrics["staleness/max"] == 2
    assert (trainer.dropped_stale, trainer.trained, trainer.version) == (3, 2, 6)
    result = trainer.train_step([segment(2, seed=0, version=1)])
    assert not result.stepped and trainer.version == 6 and trainer.dropped_stale == 5


def test_the_loss_is_chosen_by_name_and_gipo_is_the_embodied_default():
    assert make_trainer().loss_fn.__name__ == "gipo_loss"
    assert make_trainer("trainer.loss=ppo_clip").loss_kwargs == {"clip_eps": 0.2}


def test_state_dict_restores_and_the_checkpoint_rebuilds_the_policy(tmp_path):
    trainer = make_trainer()
    trainer.train_step(SEGMENTS)
    other = make_trainer("run.seed=9")
    other.load_state_dict(trainer.state_dict())
    assert other.version == 1 and other.trained == trainer.trained
    for key, value in trainer.policy.state_dict().items():
        assert torch.equal(other.policy.state_dict()[key], value)
    path = trainer.save_pretrained(str(tmp_path / "ckpt"))
    rebuilt = VLAPolicy(
        VLAConfig(**json.loads((tmp_path / "ckpt" / "vla_config.json").read_text()))
    )
    rebuilt.load_state_dict(load_file(f"{path}/model.safetensors"))
    for key, value in trainer.policy.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[key], value)


def test_vla_path_starts_the_trainer_from_a_saved_policy_of_the_same_sizes(tmp_path):
    trainer = make_trainer()
    trainer.train_step(SEGMENTS)
    path = trainer.save_pretrained(str(tmp_path / "ckpt"))
    fresh, loaded = make_trainer(), make_trainer(f"vla.path={path}")
    assert loaded.version == 0  # a new run's first version, from the saved weights
    state = trainer.policy.state_dict()
    assert all(torch.equal(loaded.policy.state_dict()[k], v) for k, v in state.items())
    assert not all(torch.equal(fresh.policy.state_dict()[k], v) for k, v in state.items())


def test_vla_path_of_other_sizes_or_no_policy_is_refused_naming_the_difference(tmp_path):
    from relayrl.workloads.saved_models import check_saved_vla

    path = make_trainer().save_pretrained(str(tmp_path / "ckpt"))
    wider = VLAConfig(**{**TINY_VLA.__dict__, "d_model": 16, "heads": 4})
    with pytest.raises(ConfigError, match=r"vla.path=.*d_model=8 \(this run: 16\)"):
        check_saved_vla(path, wider)
    with pytest.raises(ValueError, match=r"other sizes: d_model=8 \(this run: 16\)"):
        VLATrainer(
            load_config(None, ["workload=embodied", "env.image_size=8", f"vla.path={path}"]),
            wider,
        )
    with pytest.raises(ConfigError, match="vla_config.json and model.safetensors missing"):
        check_saved_vla(str(tmp_path), TINY_VLA)
    check_saved_vla(path, TINY_VLA)  # the same sizes pass


def test_a_step_whose_only_minibatch_is_non_finite_takes_no_step_and_is_counted():
    trainer = make_trainer("trainer.minibatch_steps=1000", "trainer.epochs=1")
    trainer.train_step(SEGMENTS)  # the optimizer now holds moments
    before = core_state(trainer)
    trainer.loss_fn = nan_on_calls(0)

    result = trainer.train_step([segment(3, seed=7, version=1)])

    assert not result.stepped and result.skipped_nonfinite == 1
    assert result.version == trainer.version == 1 and result.trained == 3
    assert not any(k.startswith("loss/") for k in result.metrics)
    assert_bit_identical(core_state(trainer), before)
    assert trainer.stats().skipped_nonfinite == 1

    result = trainer.train_step([segment(3, seed=7, version=1)])  # the loss is good again
    assert result.stepped and result.skipped_nonfinite == 0 and trainer.version == 2
    assert np.isfinite(result.metrics["loss/policy"])
    assert all(torch.isfinite(v).all() for v in trainer.policy.state_dict().values())


def test_nan_behaviour_log_probs_skip_the_step():
    trainer = make_trainer("trainer.minibatch_steps=1000", "trainer.epochs=1")
    before = core_state(trainer)
    bad = segment(3, seed=7)
    bad.logprobs[1, 0] = np.nan
    result = trainer.train_step([bad])
    assert not result.stepped and result.skipped_nonfinite == 1 and trainer.version == 0
    assert_bit_identical(core_state(trainer), before)


def test_a_non_finite_minibatch_is_skipped_and_the_others_still_step():
    trainer = make_trainer("trainer.minibatch_steps=4", "trainer.epochs=1")
    trainer.loss_fn = nan_on_calls(1)

    result = trainer.train_step(SEGMENTS)  # 10 steps: minibatches of 4, 4 and 2

    assert result.stepped and result.skipped_nonfinite == 1 and trainer.version == 1
    assert np.isfinite([v for k, v in result.metrics.items() if k.startswith("loss/")]).all()
    # Adam counts its steps: two minibatches stepped, the skipped one left no trace.
    assert {int(s["step"]) for s in trainer.optimizer.state.values()} == {2}


FUSED = [
    "trainer.value_recompute=fused",
    "trainer.epochs=1",
    "trainer.minibatch_order=sequential",
    "trainer.adv_norm=lagged_welford",
]


def test_fused_gae_equals_the_separate_pass_gae_when_the_weights_do_not_change():
    trainer = make_trainer(*FUSED, "trainer.gamma=0.9", "trainer.lam=0.8")
    for group in micro_batches(SEGMENTS, 4):
        fused = trainer.fused_samples(group)
        separate = trainer.advantages(group)
        torch.testing.assert_close(fused["advantages"], separate["advantages"])
        torch.testing.assert_close(fused["returns"], separate["returns"])
        torch.testing.assert_close(fused["values"].detach(), separate["values"])
        assert fused["values"].requires_grad and fused["logp"].requires_grad  # the training pass


def test_a_fused_step_takes_one_optimizer_step_per_micro_batch_and_bumps_once():
    trainer = make_trainer(*FUSED, "trainer.minibatch_steps=4")
    result = trainer.train_step(SEGMENTS)
    assert result.stepped and trainer.version == 1
    assert trainer.optimizer.state[next(trainer.policy.parameters())]["step"] == 3  # 3 groups
    assert trainer.adv_stats.count == sum(len(s) for s in SEGMENTS)


def test_value_recompute_off_uses_the_recorded_values_and_the_critics_bootstrap():
    trainer = make_trainer("trainer.value_recompute=off", "trainer.gamma=1", "trainer.lam=1")
    seg = segment(2, seed=3)  # not terminated: bootstraps from the last observation
    seg.values[:] = [0.5, 0.25]
    with torch.no_grad():
        ids = trainer.policy.tokenize([seg.instruction])
        _, last = trainer.policy(
            torch.from_numpy(seg.images[-1:]), ids, torch.from_numpy(seg.steps[-1:])
        )
    # gamma = lam = 1: A_t = sum of the rewards from t on + V_boot - V_t
    tail = float(last[0])
    expected = [seg.rewards.sum() + tail - 0.5, seg.rewards[1] + tail - 0.25]
    got = trainer.advantages([seg])["advantages"]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)


def test_sequential_minibatches_keep_the_segment_then_step_order():
    assert make_trainer("trainer.minibatch_order=sequential").minibatch_order(5).tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]
    shuffled = make_trainer().minibatch_order(50)
    assert sorted(shuffled.tolist()) == list(range(50)) and shuffled.tolist() != list(range(50))


def test_lagged_welford_standardises_with_the_earlier_steps_statistics():
    """Step 1 has none yet: its own mean and std. Step 2 uses step 1's: mean 2, std 1 for raw
    advantages 1, 3 (population std), whatever its own are."""
    trainer = make_trainer("trainer.adv_norm=lagged_welford")
    held = torch.tensor([True, True])
    first = trainer._normalize(torch.tensor([1.0, 3.0]), held)
    torch.testing.assert_close(first, torch.tensor([-1.0, 1.0]), atol=1e-6, rtol=0)
    second = trainer._normalize(torch.tensor([10.0, 2.0]), held)
    torch.testing.assert_close(second, torch.tensor([8.0, 0.0]), atol=1e-6, rtol=0)
    assert trainer.adv_stats.count == 4
    restored = make_trainer("trainer.adv_norm=lagged_welford")
    restored.load_state_dict(trainer.state_dict())
    assert restored.adv_stats.count == 4 and float(restored.adv_stats.mean) == 4.0


def test_fused_recompute_without_its_companions_is_refused_naming_them():
    with pytest.raises(ConfigError, match="value_recompute=fused.*trainer.epochs=2"):
        make_trainer("trainer.value_recompute=fused")


def test_a_forced_lag_publishes_the_weights_of_min_lag_versions_ago_and_resumes_them():
    trainer = make_trainer("inference.min_lag=2", "max_staleness=4")
    receiver_model = VLAPolicy(TINY_VLA)
    address = trainer.open_sync("shm", ["service"])
    receiver = TRANSPORTS["shm"].Receiver(receiver_model, [address], "service", timeout_s=10)
    weights = {}  # version -> the trainer's weights at it
    try:
        for step in range(5):
            weights[trainer.version] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            ticket = trainer.publish()
            assert ticket.version == max(step - 2, 0)
            receiver.receive([ticket])
            with receiver.serving() as served:
                assert served == ticket.version
                for key, value in receiver_model.state_dict().items():
                    assert torch.equal(value, weights[ticket.version][key]), key
            assert trainer.train_step([segment(3, seed=step, version=ticket.version)]).stepped
        # Versions 3 and 4 are held (4 is the newest published, 5 is not yet); a resumed trainer
        # publishes version 3 next, as this one would.
        assert [v for v, _ in trainer.held] == [2, 3, 4]
        other = make_trainer("inference.min_lag=2", "max_staleness=4", "run.seed=9")
        other.load_state_dict(trainer.state_dict())
        assert other.publish_lag == 2 and [v for v, _ in other.held] == [2, 3, 4]
        version, state = other._lagged()
        assert version == 3 and all(torch.equal(state[k], weights[3][k]) for k in state)
    finally:
        receiver.close()
        trainer.close_sync()


def test_a_forced_lag_needs_the_staleness_bound_and_held_copies():
    with pytest.raises(ConfigError, match=r"max_staleness=2 must be >= inference.min_lag=3"):
        make_trainer("inference.min_lag=3")
    with pytest.raises(ConfigError, match=r"inference.min_lag=1 .*sync.in_place=false"):
        make_trainer("inference.min_lag=1", "sync.in_place=true", "sync.transport=dist")


def with_old_policy_offset(trainer: VLATrainer, offset: float) -> list[Segment]:
    """SEGMENTS whose behaviour log-probs are the trainer's current ones minus ``offset``: the
    behaviour weight pi_old / mu is exp(offset) on every token."""
    out = []
    for seg in SEGMENTS:
        _, old = critic_values(trainer.policy, pad_segments([seg]))
        out.append(replace(seg, logprobs=(old[0, : len(seg)] - offset).numpy()))
    return out


def test_the_value_pass_gives_the_log_probs_of_the_actions_taken():
    trainer = make_trainer()
    batch = pad_segments(SEGMENTS)
    _, old = critic_values(trainer.policy, batch)
    for i, seg in enumerate(SEGMENTS):
        ids = trainer.policy.tokenize([seg.instruction] * len(seg))
        with torch.no_grad():
            logp, _, _ = trainer.policy.evaluate_actions(
                torch.from_numpy(seg.images[:-1]),
                ids,
                torch.from_numpy(seg.steps[:-1]),
                torch.from_numpy(seg.actions),
            )
        torch.testing.assert_close(old[i, : len(seg)], logp)
        assert (old[i, len(seg) :] == 0).all()  # padding


def test_proximal_current_centres_the_trust_region_on_the_old_policy_and_weights_the_lag():
    # mu = log pi_old - ln 1.5 on every token. One epoch, one minibatch: the forward runs before
    # the only optimizer step, so pi = pi_old there. Against mu the ratio is 1.5 everywhere;
    # against the old policy it is 1, and the behaviour weight pi_old / mu = 1.5 (capped at 1.2).
    one = ("trainer.epochs=1", "trainer.minibatch_steps=1000", "trainer.loss=ppo_clip")
    behaviour = make_trainer(*one)
    result = behaviour.train_step(with_old_policy_offset(behaviour, np.log(1.5)))
    assert result.metrics["loss/ratio_mean"] == pytest.approx(1.5, rel=1e-5)
    assert "loss/behaviour_weight" not in result.metrics
    current = make_trainer(*one, "trainer.proximal=current")
    result = current.train_step(with_old_policy_offset(current, np.log(1.5)))
    assert result.metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert result.metrics["loss/clip_frac"] == 0.0
    assert result.metrics["loss/behaviour_weight"] == pytest.approx(1.5, rel=1e-5)
    capped = make_trainer(*one, "trainer.proximal=current", "trainer.proximal_weight_cap=1.2")
    result = capped.train_step(with_old_policy_offset(capped, np.log(1.5)))
    assert result.metrics["loss/behaviour_weight"] == pytest.approx(1.2, rel=1e-5)


def test_proximal_current_without_lag_takes_the_same_steps_as_the_behaviour_policy():
    # mu = pi_old: the weight is 1 and both old policies are the same.
    two = ("trainer.epochs=2", "trainer.minibatch_steps=4")
    behaviour, current = make_trainer(*two), make_trainer(*two, "trainer.proximal=current")
    behaviour.train_step(with_old_policy_offset(behaviour, 0.0))
    current.train_step(with_old_policy_offset(current, 0.0))
    for key, value in behaviour.policy.state_dict().items():
        torch.testing.assert_close(current.policy.state_dict()[key], value)


def test_proximal_current_needs_the_value_pass():
    for other in ("off", "fused"):
        with pytest.raises(
            ConfigError, match="trainer.proximal=current .* needs trainer.value_recompute=pass; got"
        ):
            make_trainer(*FUSED, "trainer.proximal=current", f"trainer.value_recompute={other}")
