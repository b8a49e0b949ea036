"""Imagination in a rollout worker: imagined segments carry the policy's and the world model's
versions, their potential-based rewards sum to p(end) - p(start) plus the terminal term, episodes
end on the threshold, the failure head or the cap, and a worker imagines after each real episode
it finishes."""

from __future__ import annotations

import numpy as np
import pytest

from relayrl.data.trajectories import Episode
from relayrl.envs.embodied import ActionSpace, Observation, StepResult
from relayrl.executors.imagination import ImaginationSettings, Imaginer
from relayrl.executors.rollout_worker import RolloutWorker
from relayrl.models.world_model.serving import WMReply, WMRequest
from relayrl.types import ActReply

K = 2
WM_VERSION = 7
POLICY_VERSION = 3


def brightness_world_model(requests: list[WMRequest]) -> list[WMReply]:
    """Each step brightens the frame by 1 + the action token; p = brightness / 10; token 2 leads
    to a failure frame."""
    replies = []
    for r in requests:
        if r.actions is None:
            frame, value = None, int(r.context[-1].flat[0])
        else:
            value = int(r.context[-1].flat[0]) + 1 + int(r.actions[-1, 0])
            frame = np.full_like(r.context[-1], value)
        # Action token 2 is fatal: the frame it leads to is a failure frame (p_fail = 1).
        fatal = r.actions is not None and int(r.actions[-1, 0]) == 2
        replies.append(WMReply(frame, min(value / 10, 1.0), float(fatal), WM_VERSION))
    return replies


class ZeroPolicy:
    """Action token 0, log-prob -0.5, value = brightness."""

    def __init__(self):
        self.asked: list[Observation] = []

    def act_many(self, observations, worker, env_steps):
        self.asked += observations
        return [
            ActReply(np.array([0]), np.array([-0.5], np.float32), float(o.image.flat[0]), 3)
            for o in observations
        ]


def real_episode(start: int, steps: int) -> Episode:
    frames = np.stack([np.full((1, 4, 4, 3), start + t, np.uint8) for t in range(steps + 1)])
    return Episode(
        frames=frames,
        actions=np.zeros((steps, 1), np.int64),
        rewards=np.zeros(steps, np.float32),
        instruction="brighten",
        task="toy",
        seed=0,
        success=False,
        terminated=False,
        truncated=True,
    )


def settings(**changes) -> ImaginationSettings:
    base = dict(
        episodes_per_real=3,
        cache_episodes=2,
        context_frames=K,
        threshold=0.9,
        fail_threshold=0.5,
        max_steps=20,
        terminal_reward=1.0,
        segment_len=4,
    )
    return ImaginationSettings(**(base | changes))


def test_imagined_episodes_carry_both_versions_and_their_rewards_telescope():
    put, to_wm = [], []
    imaginer = Imaginer(settings(), brightness_world_model, put.append, to_wm.append, seed=0)
    segments = imaginer.after_episode(real_episode(0, 5), ZeroPolicy(), 0, 5)
    assert to_wm and to_wm[0][0].steps == 5  # the real episode went to B_wm
    assert put == segments and all(s.imagined and s.wm_version == WM_VERSION for s in segments)
    assert all((s.versions == POLICY_VERSION).all() for s in segments)
    by_episode: dict[int, list] = {}
    for s in segments:
        by_episode.setdefault(s.episode, []).append(s)
    assert sorted(by_episode) == [0, 1, 2]
    for episode in by_episode.values():
        assert [s.episode_done for s in episode] == [False] * (len(episode) - 1) + [True]
        start, end = int(episode[0].images[0].flat[0]), int(episode[-1].images[-1].flat[0])
        total = sum(float(s.rewards.sum()) for s in episode)
        # Brightness rises by 1 per step from a real frame in 0..4 to the threshold (9).
        assert end == 9 and episode[-1].terminated and episode[-1].success
        assert total == pytest.approx(end / 10 - start / 10 + 1.0, abs=1e-6)
        assert sum(len(s) for s in episode) == 9 - start
        assert all(len(s) <= 4 for s in episode)
        for a, b in zip(episode, episode[1:], strict=False):  # pieces overlap by one frame
            assert np.array_equal(a.images[-1], b.images[0]) and a.steps[-1] == b.steps[0]
    assert imaginer.counts == {
        "steps": sum(len(s) for s in segments),
        "segments": len(segments),
        "episodes": 3,
        "successes": 3,
    }


def test_an_imagined_episode_is_cut_at_the_step_cap_without_a_terminal_reward():
    put = []
    imaginer = Imaginer(settings(max_steps=2), brightness_world_model, put.append, print, seed=1)
    segments = imaginer.after_episode(real_episode(0, 3), ZeroPolicy(), 0, 3)
    assert all(len(s) == 2 and s.episode_done and not s.terminated for s in segments)
    for s in segments:
        start = int(s.images[0].flat[0])
        assert float(s.rewards.sum()) == pytest.approx(0.2, abs=1e-6)  # (start + 2 - start) / 10
        assert s.steps[0] < 3  # started from a real frame of the 3-step episode
        assert start == s.steps[0]


class FatalPolicy(ZeroPolicy):
    """Action token 2 (brightness + 3, into a failure frame), log-prob -0.5, value 0."""

    def act_many(self, observations, worker, env_steps):
        return [ActReply(np.array([2]), np.array([-0.5], np.float32), 0.0, 3) for _ in observations]


def test_an_imagined_episode_ends_in_failure_on_the_failure_head_unless_it_succeeds():
    put = []
    one = settings(episodes_per_real=6, cache_episodes=1)
    imaginer = Imaginer(one, brightness_world_model, put.append, print, seed=2)
    # Starts 0..3: brightness 3..6 after the fatal step, short of success (9): failures.
    failed = imaginer.after_episode(real_episode(0, 4), FatalPolicy(), 0, 4)
    assert len(failed) == 6
    for s in failed:
        assert len(s) == 1 and s.episode_done and s.terminated and not s.success
        assert float(s.rewards[0]) == pytest.approx(0.3, abs=1e-6)  # (start + 3 - start) / 10
    # Starts 6..9: brightness 9..12, success and failure at once: success wins the tie.
    won = imaginer.after_episode(real_episode(6, 4), FatalPolicy(), 0, 4)
    assert len(won) == 6
    assert all(s.terminated and s.success and float(s.rewards[0]) > 1 for s in won)
    assert imaginer.counts["successes"] == 6 and imaginer.counts["episodes"] == 12


class StepEnv:
    """An env of 3-step episodes whose frames hold the step number."""

    def __init__(self):
        self.t = 0
        self.action_space = ActionSpace("discrete", 2)
        self.tasks = ["toy"]

    def reset(self, *, task=None, seed=None):
        self.t = 0
        return Observation(np.zeros((1, 4, 4, 3), np.uint8), "brighten", "toy", 0)

    def step(self, action):
        self.t += 1
        obs = Observation(np.full((1, 4, 4, 3), self.t, np.uint8), "brighten", "toy", self.t)
        return StepResult(obs, 0.0, False, self.t == 3, False)

    def close(self):
        pass


def test_a_worker_imagines_after_each_real_episode_it_finishes():
    worker = RolloutWorker(0, StepEnv, segment_len=8, seed=0, env_threads=False)
    imagined, to_wm = [], []
    worker.set_imagination(
        Imaginer(
            settings(episodes_per_real=2),
            brightness_world_model,
            imagined.append,
            to_wm.extend,
            seed=0,
        )
    )
    real: list = []
    worker.run(ZeroPolicy(), real.append, max_segments=3)
    assert len(real) == 3 and [e.steps for e in to_wm] == [3, 3, 3]
    assert np.array_equal(to_wm[0].frames[:, 0, 0, 0, 0], [0, 1, 2, 3])
    stats = worker.stats()
    assert stats["imagined"]["episodes"] == 6 and stats["imagined"]["steps"] == sum(
        len(s) for s in imagined
    )
    assert stats["env_steps"] == 9  # imagined steps are not env steps
