"""The world-model trainer keeps B_wm's books, trains each model on its own schedule, learns,
checkpoints, and publishes both models as one version to an inference service that answers
imagination requests with them."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import ray
import torch
from conftest import ATOL, TIMEOUT_S, on_all, trainer_group

from relayrl.config import load_config
from relayrl.data.trajectories import Episode
from relayrl.executors.inference_service import InferenceService
from relayrl.executors.world_model_trainer import RealEpisodes, WorldModelTrainer
from relayrl.models.world_model import (
    ObsModelConfig,
    SuccessModel,
    SuccessModelConfig,
    build_obs_model,
)
from relayrl.models.world_model.serving import (
    WMReply,
    WMRequest,
    WorldModel,
    world_model_replies,
)

SIZE, SQUARE, K = 16, 4, 2
MOVES = np.array([[-2, 0], [2, 0], [0, -2], [0, 2]])  # action tokens 0..3: up, down, left, right


def square(pos: np.ndarray) -> np.ndarray:
    """uint8 [1, SIZE, SIZE, 3]: a white square at ``pos``."""
    frame = np.zeros((1, SIZE, SIZE, 3), np.uint8)
    frame[0, pos[0] : pos[0] + SQUARE, pos[1] : pos[1] + SQUARE] = 255
    return frame


def episode(steps: int, seed: int, success: bool = False) -> Episode:
    """The square moved by ``steps`` random actions; ``success`` labels its last frame."""
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, SIZE - SQUARE + 1, 2)
    actions = rng.integers(0, 4, (steps, 1))
    frames = [square(pos)]
    for a in actions[:, 0]:
        pos = np.clip(pos + MOVES[a], 0, SIZE - SQUARE)
        frames.append(square(pos))
    return Episode(
        frames=np.stack(frames),
        actions=actions.astype(np.int64),
        rewards=np.zeros(steps, np.float32),
        instruction="go to the square",
        task="toy",
        seed=seed,
        success=success,
        terminated=success,
        truncated=not success,
    )


def trainer_args(*overrides: str) -> tuple:
    """A world-model trainer's arguments: the config, M_obs's and M_reward's."""
    cfg = load_config(
        None,
        [
            "workload=embodied",
            "world_model.backend=deterministic",
            "world_model.channels=16",
            "world_model.cond_dim=32",
            f"world_model.context_frames={K}",
            "world_model.lr=3e-3",
            "world_model.batch_size=16",
            *overrides,
        ],
        world_model=True,
    )
    obs = ObsModelConfig(
        backend="deterministic",
        image_size=SIZE,
        context_frames=K,
        action_vocab=4,
        channels=16,
        cond_dim=32,
    )
    reward = SuccessModelConfig(image_size=SIZE, channels=8, hidden=16, instruction_tokens=4)
    return cfg, obs, reward


def make_trainer(*overrides: str) -> WorldModelTrainer:
    return WorldModelTrainer(*trainer_args(*overrides))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_b_wm_keeps_the_newest_episodes_within_capacity_and_counts_the_rest():
    buffer = RealEpisodes(12, seed=0)
    for steps, seed in ((5, 0), (7, 1), (4, 2), (13, 3)):
        buffer.add(episode(steps, seed))
    # 5 + 7 fill it; 4 evicts the 5-step episode; 13 is longer than the whole buffer.
    assert [e.steps for e in buffer.episodes] == [7, 4] and buffer.steps == 11
    assert (buffer.added_steps, buffer.evicted_steps) == (29, 18)
    batch = buffer.transitions(6, K)
    assert tuple(batch.context.shape) == (6, K, 1, SIZE, SIZE, 3)
    model = SuccessModel(SuccessModelConfig(image_size=SIZE, channels=8, hidden=16))
    assert buffer.success_labels(4, model) is None  # no success frame yet
    buffer.add(episode(3, 4, success=True))
    found = buffer.success_labels(4, model)
    assert found.success.tolist() == [True, True, False, False]
    # The success frames drawn are the successful episode's last frame.
    assert torch.equal(found.frames[0], torch.from_numpy(buffer.episodes[-1].frames[-1]))


def test_with_the_failure_head_a_quarter_of_the_frames_are_failure_frames():
    buffer = RealEpisodes(100, seed=0)
    won = episode(3, 1, success=True)
    lost = dataclasses.replace(episode(4, 2), terminated=True, truncated=False)
    cut = episode(5, 3)  # truncated: its last frame is neither a success nor a failure
    for e in (won, lost, cut):
        buffer.add(e)
    with_head = SuccessModel(
        SuccessModelConfig(image_size=SIZE, channels=8, hidden=16, failure_head=True)
    )
    found = buffer.success_labels(8, with_head)
    # 2 success frames, 2 failure frames, 4 of the 3 + 4 + 5 others (not the two ends).
    assert found.success.tolist() == [True] * 2 + [False] * 6
    assert found.failure.tolist() == [False] * 2 + [True] * 2 + [False] * 4
    assert torch.equal(found.frames[0], torch.from_numpy(won.frames[-1]))
    assert torch.equal(found.frames[2], torch.from_numpy(lost.frames[-1]))
    ends = [torch.from_numpy(e.frames[-1]) for e in (won, lost)]
    assert not any(torch.equal(f, end) for f in found.frames[4:] for end in ends)
    # Without the head the failure frames are other frames: half success, half the rest.
    without = SuccessModel(SuccessModelConfig(image_size=SIZE, channels=8, hidden=16))
    plain = buffer.success_labels(8, without)
    assert plain.failure is None and plain.success.tolist() == [True] * 4 + [False] * 4


def test_each_model_trains_on_its_own_schedule_and_the_version_follows():
    trainer = make_trainer(
        "world_model.train_obs_every=2",
        "world_model.train_reward_every=3",
        "world_model.train_steps=2",
    )
    empty = trainer.train(2)  # nothing to learn from yet
    assert not empty.trained_obs and empty.version == 0
    trainer.add_episodes([episode(8, s, success=s == 0) for s in range(4)])
    done = {step: trainer.train(step) for step in range(1, 7)}
    assert [s for s, r in done.items() if r.trained_obs] == [2, 4, 6]
    assert [s for s, r in done.items() if r.trained_reward] == [3, 6]
    assert [r.version for r in done.values()] == [0, 1, 2, 3, 3, 4]
    assert trainer.stats().updates == {"obs": 6, "reward": 4}
    assert (
        "world_model/loss_obs" in done[6].metrics and "world_model/loss_reward" in done[6].metrics
    )


def test_rounds_of_fine_tuning_learn_the_dynamics():
    trainer = make_trainer("world_model.train_reward_every=0", "world_model.train_steps=25")
    trainer.add_episodes([episode(20, s) for s in range(20)])
    held = RealEpisodes(10_000, seed=1)
    held.add(episode(40, 99))
    batch = held.transitions(64, K)

    def mse() -> float:
        with torch.no_grad():
            predicted = trainer.model.obs.predict(batch.context, batch.actions).float()
        return float(((predicted - batch.next_frame.float()) / 255).square().mean())

    copy_last = float(
        ((batch.context[:, -1].float() - batch.next_frame.float()) / 255).square().mean()
    )
    before = mse()
    for step in range(1, 9):
        trainer.train(step)
    assert mse() < 0.3 * min(before, copy_last)


def test_state_dict_restores_models_optimizers_and_b_wm():
    every = ("world_model.train_obs_every=1", "world_model.train_steps=2")
    trainer = make_trainer(*every)
    trainer.add_episodes([episode(6, s, success=s == 1) for s in range(3)])
    trainer.train(1)
    other = make_trainer(*every, "run.seed=5")
    other.load_state_dict(trainer.state_dict())
    assert other.version == trainer.version == 1 and other.buffer.steps == 18
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(other.model.state_dict()[key], value)
    a, b = trainer.train(2), other.train(2)  # same state, same draws: the same next round
    assert a.metrics == b.metrics


def test_published_weights_serve_imagination_requests_in_batches():
    trainer = make_trainer("world_model.train_obs_every=1", "world_model.train_steps=3")
    trainer.add_episodes([episode(10, s, success=s == 0) for s in range(3)])
    trainer.train(1)
    fresh = WorldModel(
        build_obs_model(trainer.model.obs.cfg), SuccessModel(trainer.model.reward.cfg)
    )
    address = trainer.open_sync("shm", ["world_model_service"])
    ep = episode(5, 7)
    requests = [
        WMRequest(ep.frames[t : t + K], ep.actions[t : t + K], "go to the square") for t in (0, 2)
    ] + [WMRequest(ep.frames[:K], None, "go to the square")]

    async def main() -> list[WMReply]:
        service = InferenceService(
            fresh,
            max_batch=3,
            max_wait_ms=50,
            batch_fn=world_model_replies,
            name="world_model_service",
        )
        await service.open_sync([address], "world_model_service")
        await service.connect_sync()
        await service.update_weights(trainer.publish())
        replies = await asyncio.gather(*(service.act(r) for r in requests))
        stats = await service.stats()
        await service.close()
        return replies, stats

    try:
        replies, stats = asyncio.run(main())
    finally:
        trainer.close_sync()
    assert stats.forwards == 1 and stats.requests == 3  # one batch answered all three
    assert [r.version for r in replies] == [1, 1, 1]
    with torch.no_grad():
        expected = trainer.model.obs.predict(
            torch.from_numpy(np.stack([r.context for r in requests[:2]])),
            torch.from_numpy(np.stack([r.actions for r in requests[:2]])),
        ).numpy()
        ids = trainer.model.reward.tokenize(["go to the square"])
        start_prob = float(
            trainer.model.reward.success_prob(torch.from_numpy(ep.frames[K - 1 : K]), ids)
        )
    assert np.array_equal(replies[0].frame, expected[0]) and np.array_equal(
        replies[1].frame, expected[1]
    )
    assert replies[2].frame is None and replies[2].prob == pytest.approx(start_prob, abs=1e-6)


def test_two_ranks_take_the_step_one_trainer_takes(ray_session):
    """Rank 0 holds B_wm and draws; each rank trains on its block of the batch (3 and 2 of 5
    samples), gradients summed: both ranks end with the weights and losses of one trainer."""
    args = trainer_args(
        "world_model.train_obs_every=1",
        "world_model.train_reward_every=2",
        "world_model.train_steps=2",
        "world_model.batch_size=5",
    )
    episodes = [episode(6, s, success=s == 1) for s in range(4)]
    one = WorldModelTrainer(*args)
    one.add_episodes(episodes)
    with trainer_group(WorldModelTrainer, *args) as ranks:
        assert ray.get(ranks[0].add_episodes.remote(episodes), timeout=TIMEOUT_S) == 24
        for step in (1, 2):
            results = on_all(ranks, "train", step)
            alone = one.train(step)
            assert [r.version for r in results] == [alone.version] * 2
            for key, value in alone.metrics.items():
                assert results[0].metrics[key] == pytest.approx(value, abs=ATOL), key
        weights = ray.get(
            [r.__ray_call__.remote(lambda t: t.model.state_dict()) for r in ranks],
            timeout=TIMEOUT_S,
        )
    assert one.stats().updates == {"obs": 4, "reward": 2}
    for key, value in one.model.state_dict().items():
        for rank in weights:
            assert torch.allclose(rank[key], value, atol=ATOL), key
