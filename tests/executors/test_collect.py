"""A rollout worker's ``collect`` (the lockstep loop's call): it steps its env against the service
until it closes the segments asked for, leaves none open, and reports their books."""

from __future__ import annotations

import numpy as np

from relayrl.envs.embodied import ActionSpace, Observation, StepResult
from relayrl.executors.rollout_worker import Collected, RolloutWorker
from relayrl.types import ActReply


class SevenSteps:
    """Episodes of 7 steps; the reward is the action; step 5 of the env's life raises when
    ``crash``."""

    action_space = ActionSpace("discrete", 4)
    tasks = ("a",)

    def __init__(self, crash: bool = False):
        self.crash, self.calls, self.t = crash, 0, 0

    def reset(self, *, task=None, seed=None):
        self.t = 0
        return Observation(np.zeros((1, 2, 2, 3), np.uint8), "do a", "a", 0)

    def step(self, action):
        self.calls += 1
        if self.crash and self.calls == 5:
            raise RuntimeError("crashed")
        self.t += 1
        obs = Observation(np.zeros((1, 2, 2, 3), np.uint8), "do a", "a", self.t)
        return StepResult(
            obs, reward=float(action), terminated=self.t == 7, truncated=False, success=self.t == 7
        )

    def close(self):
        pass


class Service:
    """Answers action 1 at version 3 and records each request's (worker, env steps, seed)."""

    def __init__(self):
        self.asked: list[tuple[int, int, int]] = []
        self.closed = 0

    def __call__(self, obs, worker, env_steps, seed):
        self.asked.append((worker, env_steps, seed))
        return ActReply(np.array([1]), np.array([-0.5], np.float32), 0.0, 3)

    def close(self):
        self.closed += 1


def test_collect_closes_the_segments_asked_for_and_reports_their_books():
    worker = RolloutWorker(5, SevenSteps, segment_len=3, seed=11)
    service = Service()
    found = [worker.collect(service) for _ in range(3)]
    # 7 steps cut 3, 3, 1: each call returns once its segment closed, none left open.
    assert [c for c, _ in found] == [
        Collected(5, 3, 3, 0),
        Collected(5, 3, 6, 0),
        Collected(5, 1, 7, 0),
    ]
    assert [len(segments) for _, segments in found] == [1, 1, 1]
    assert found[2][1][0].episode_done and found[2][1][0].versions.tolist() == [3]
    # Each request's seed is fixed by the worker's seed and its env steps.
    assert service.asked == [(5, n, 11 * 1_000_003 + n) for n in range(7)]
    assert service.closed == 3
    assert worker.stats().open_steps == 0
    # Two segments in one call: the next episode's first two.
    collected, segments = worker.collect(service, segments=2)
    assert collected == Collected(5, 6, 13, 0) and [len(s) for s in segments] == [3, 3]


def test_a_crash_in_collect_drops_the_open_steps_and_the_call_goes_on():
    worker = RolloutWorker(0, lambda: SevenSteps(crash=True), segment_len=3, seed=0)
    first, _ = worker.collect(Service())
    # Steps 4 and 5 of the first env: step 4 opens a segment, step 5 crashes; a new episode in a
    # new env then closes 3 steps.
    collected, segments = worker.collect(Service())
    assert first == Collected(0, 3, 3, 0)
    assert collected == Collected(0, 3, 7, 1) and len(segments) == 1
