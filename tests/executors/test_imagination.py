"""Imagination in a rollout worker: its WorldModelEnv slots step beside the real envs in the same
rounds (one act request for all), each real episode makes episodes_per_real imagined ones due,
imagined segments carry the policy's and the world model's versions and go to B_img, and their
steps stay out of the real books."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from relayrl.data.trajectories import Episode
from relayrl.envs.embodied import ActionSpace, Observation, StepResult
from relayrl.executors.imagination import Imagination, ImaginationSettings
from relayrl.executors.rollout_worker import RolloutWorker
from relayrl.models.world_model.serving import WMReply, WMRequest
from relayrl.types import ActReply

WM_VERSION = 7
POLICY_VERSION = 3


class BrightnessService:
    """Each step brightens the frame by 1 + the action token; p = brightness / 10."""

    def __init__(self):
        self.requests: list[WMRequest] = []

    def submit(self, r: WMRequest) -> Future:
        self.requests.append(r)
        value = int(r.context[-1].flat[0]) + (0 if r.actions is None else 1 + int(r.actions[-1, 0]))
        frame = None if r.actions is None else np.full_like(r.context[-1], value)
        future: Future = Future()
        future.set_result(WMReply(frame, min(value / 10, 1.0), 0.0, WM_VERSION))
        return future


class BrokenService:
    """A world-model service that died."""

    def submit(self, r: WMRequest) -> Future:
        future: Future = Future()
        future.set_exception(ConnectionError("world-model replica died"))
        return future


class ZeroPolicy:
    """Action token 0, log-prob -0.5, value = brightness; records how many observations each
    request held."""

    def __init__(self):
        self.sizes: list[int] = []

    def act_many(self, observations, worker, env_steps):
        self.sizes.append(len(observations))
        return [
            ActReply(np.array([0]), np.array([-0.5], np.float32), float(o.image.flat[0]), 3)
            for o in observations
        ]


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


def settings(**changes) -> ImaginationSettings:
    base = dict(
        episodes_per_real=2,
        cache_episodes=2,
        context_frames=2,
        threshold=0.9,
        fail_threshold=0.5,
        max_steps=2,
        terminal_reward=1.0,
    )
    return ImaginationSettings(**(base | changes))


def imagining_worker(service=None, **changes) -> tuple[RolloutWorker, list, list[Episode]]:
    """A worker of one StepEnv with imagination; the imagined segments and B_wm's episodes."""
    worker = RolloutWorker(0, StepEnv, segment_len=8, seed=0, env_threads=False)
    imagined: list = []
    to_wm: list[Episode] = []
    imagination = Imagination(
        settings(**changes), service or BrightnessService(), imagined.append, to_wm.extend, 0
    )
    worker.set_imagination(imagination)
    return worker, imagined, to_wm


def test_imagined_envs_step_beside_the_real_one_in_one_request_and_books_stay_apart():
    worker, imagined, to_wm = imagining_worker()
    policy, real = ZeroPolicy(), []
    assert worker.run(policy, real.append, max_segments=3) == 3
    # Rounds 1-3: the first real episode; then two imagined episodes of 2 steps (the cap) beside
    # each next real episode; the third real episode's two are due when the run stops.
    assert policy.sizes == [1, 1, 1, 3, 3, 1, 3, 3, 1]
    books = worker.state_dict()["counts"]
    assert books["env_steps"] == len(policy.sizes) == 9  # the real env stepped every round
    assert books["segment_steps"] == 9 and books["dropped_error_steps"] == 0
    assert [e.steps for e in to_wm] == [3, 3, 3]
    assert np.array_equal(to_wm[0].frames[:, 0, 0, 0, 0], [0, 1, 2, 3])
    assert not any(s.imagined for s in real)
    assert [s.episode for s in imagined] == [0, 1, 2, 3]  # the imagined episode counter
    for s in imagined:
        assert s.imagined and s.wm_version == WM_VERSION and (s.versions == POLICY_VERSION).all()
        assert len(s) == 2 and s.episode_done and not s.terminated  # cut at max_steps
        start = int(s.images[0].flat[0])
        assert start == s.steps[0] < 3  # a real frame of a 3-step episode: its step number
        assert s.steps.tolist() == [start, start + 1, start + 2]
        assert s.rewards.tolist() == pytest.approx([0.1, 0.1])  # p rises by 0.1 a step
    assert worker.imagination.counts == {"steps": 8, "segments": 4, "episodes": 4, "successes": 0}
    assert worker.imagination.due == 2


def test_imagined_episodes_that_reach_the_threshold_succeed_and_their_rewards_telescope():
    worker, imagined, _ = imagining_worker(max_steps=20)
    worker.run(ZeroPolicy(), [].append, max_segments=8)
    assert imagined
    for s in imagined:  # segment_len 8 and at most 9 steps from a real frame to brightness 9
        start, end = int(s.images[0].flat[0]), int(s.images[-1].flat[0])
        if s.episode_done:
            assert end == 9 and s.terminated and s.success
            assert float(s.rewards.sum()) == pytest.approx((end - start) / 10 + 1.0)
    done = [s for s in imagined if s.episode_done]
    assert worker.imagination.counts["successes"] == len(done) > 0


def test_starts_due_while_every_imagined_env_is_busy_wait_at_most_one_per_env():
    worker, _, _ = imagining_worker(max_steps=20)
    imagination = worker.imagination
    assert imagination.slots == 2
    imagination.real_episodes([Episode(*_real(3)) for _ in range(3)])  # 6 due, 2 envs
    assert imagination.due == 2
    assert imagination.start()[0] == 0 and imagination.start()[0] == 1
    assert imagination.start() is None and imagination.due == 0


def _real(steps: int) -> tuple:
    frames = np.stack([np.full((1, 4, 4, 3), t, np.uint8) for t in range(steps + 1)])
    actions = np.zeros((steps, 1), np.int64)
    return frames, actions, np.zeros(steps, np.float32), "brighten", "toy", 0, False, False, True


def test_a_reloaded_worker_drops_its_open_imagined_episodes_and_draws_the_same_starts():
    worker, _, _ = imagining_worker(max_steps=20)
    worker.run(ZeroPolicy(), [].append, max_segments=4)
    state = worker.state_dict()
    assert state["imagination"]["counts"] == worker.imagination.counts
    playing = [slot for slot in worker.slots if slot.imagined and slot.obs is not None]
    assert state["imagination"]["playing"] == len(playing) > 0
    assert worker.imagination.counts["steps"] > 0
    again, imagined, _ = imagining_worker(max_steps=20)
    again.load_state_dict(state)
    assert all(slot.obs is None for slot in again.slots)
    assert (
        len(again.imagination.starts) == 2 and again.imagination.due == state["imagination"]["due"]
    )
    drawn = worker.imagination.start()
    assert drawn is not None and again.imagination.start() == drawn


def test_a_failed_world_model_service_stops_the_run_and_is_not_booked_as_an_env_error():
    worker, _, _ = imagining_worker(BrokenService())
    with pytest.raises(ConnectionError, match="world-model replica died"):
        worker.run(ZeroPolicy(), [].append)
    assert worker.state_dict()["counts"]["env_errors"] == 0
