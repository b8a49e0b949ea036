"""A rollout worker's ``collect`` (the lockstep loop's call): it steps its env against the service
until it closes the segments asked for, leaves none open, and reports their books; the seeded
requests it makes are answered alike however other requests are batched."""

from __future__ import annotations

import asyncio

import numpy as np
import torch
from conftest import TINY_VLA

from relayrl.envs.embodied import ActionSpace, Observation, StepResult
from relayrl.executors.inference_service import InferenceService
from relayrl.executors.rollout_worker import Collected, RolloutWorker
from relayrl.models.vla import VLAPolicy
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


def test_a_seeded_request_gets_the_same_actions_whatever_arrives_beside_it():
    torch.manual_seed(0)
    service = InferenceService(VLAPolicy(TINY_VLA), max_batch=8, max_wait_ms=20.0, seed=0)
    rng = np.random.default_rng(0)
    observations = [
        Observation(rng.integers(0, 256, (1, 8, 8, 3), dtype=np.uint8), "go", "a", 0)
        for _ in range(6)
    ]

    async def seeded(others: int, seed: int) -> ActReply:
        # The seeded request arrives among ``others`` unseeded ones, batched meanwhile.
        calls = [service.act(o) for o in observations[1 : 1 + others]]
        replies = await asyncio.gather(service.act(observations[0], 0, 0, seed), *calls)
        return replies[0]

    alone, crowded = asyncio.run(seeded(0, 7)), asyncio.run(seeded(5, 7))
    assert alone.actions.tolist() == crowded.actions.tolist()
    assert np.array_equal(alone.logprobs, crowded.logprobs)
    # Over a few seeds the sampled actions differ: the seed, not the batch, picks them.
    draws = {tuple(asyncio.run(seeded(3, s)).actions.tolist()) for s in range(8)}
    assert len(draws) > 1
