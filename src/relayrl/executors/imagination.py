"""Imagination inside a rollout worker (AcceRL-WM).

After each real episode a worker hands the episode to the world-model trainer's ``B_wm``, keeps
it in its cache of the last ``imagination.cache_episodes`` episodes, and plays
``imagination.episodes_per_real`` imagined episodes, stepped together. Each starts from a real
frame o_t of a cached episode (drawn uniformly over the cached steps) with the real frames and
actions before it as context. Every step asks the policy service for actions on the newest frames
(one request for all), then the world-model service for the next frames and their success
probabilities (all in flight at once, batched by the service). An imagined episode ends in
success when the probability reaches ``world_model.threshold``, in failure when the reward
model's failure head reaches ``world_model.failure_threshold``, and is cut at
``world_model.max_steps`` steps; its rewards are potential-based (``imagined_reward``). Episodes
are cut into segments of at most ``rollout.segment_len`` steps, as real ones, tagged
``imagined`` with the policy version of each action and the world-model version of the
segment's last prediction, numbered by the worker's imagined-episode counter, and put into
``B_img``.

Books: a worker counts the imagined steps of the segments it put (``imagined_steps``); an
imagination round ends with every episode ended and put, so no imagined step is ever open.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from relayrl.data.trajectories import Episode
from relayrl.envs.embodied import Observation
from relayrl.models.world_model.imagine import start_context
from relayrl.models.world_model.rewards import imagined_reward, imagined_termination
from relayrl.models.world_model.serving import WMReply, WMRequest
from relayrl.types import ActReply, Segment, segment_arrays


@dataclass
class ImaginationSettings:
    """What a worker's imagination needs from the config."""

    episodes_per_real: int
    cache_episodes: int
    context_frames: int
    threshold: float
    fail_threshold: float
    max_steps: int
    terminal_reward: float
    segment_len: int

    @classmethod
    def from_config(cls, cfg: Any) -> ImaginationSettings:
        """The settings a run's ``Config`` gives (``imagination``, ``world_model``, ``rollout``)."""
        wm = cfg.world_model
        return cls(
            episodes_per_real=cfg.imagination.episodes_per_real,
            cache_episodes=cfg.imagination.cache_episodes,
            context_frames=wm.context_frames,
            threshold=wm.threshold,
            fail_threshold=wm.failure_threshold,
            max_steps=wm.max_steps,
            terminal_reward=wm.terminal_reward,
            segment_len=cfg.rollout.segment_len,
        )


@dataclass
class _Dream:
    """One imagined episode being played."""

    instruction: str
    task: str
    context: list[np.ndarray]  # the last K frames
    past: list[np.ndarray]  # the K - 1 actions before the newest frame
    step: int  # the episode step of the newest frame
    prob: float  # M_reward's success probability of the newest frame
    images: list[np.ndarray]
    steps: list[int]
    actions: list[np.ndarray]
    logprobs: list[np.ndarray]
    values: list[float]
    rewards: list[float]
    versions: list[int]
    number: int = -1  # the worker's imagined episode counter
    length: int = 0
    wm_version: int = -1
    done: bool = False


class Imaginer:
    """A rollout worker's imagination: ``world_model`` answers a list of ``WMRequest`` with
    ``WMReply``s, ``sink`` takes the imagined segments (``put_many`` where it has it), and
    ``to_world_model`` takes real episodes for ``B_wm``."""

    def __init__(
        self,
        settings: ImaginationSettings,
        world_model: Callable[[list[WMRequest]], list[WMReply]],
        sink: Any,
        to_world_model: Callable[[list[Episode]], object],
        seed: int,
    ):
        self.settings = settings
        self.world_model = world_model
        self.sink = sink
        self.to_world_model = to_world_model
        self.cache: deque[Episode] = deque(maxlen=settings.cache_episodes)
        self.rng = random.Random(seed)
        self.counts = {"steps": 0, "segments": 0, "episodes": 0, "successes": 0}

    def after_episode(
        self, episode: Episode, policy: Any, worker: int, env_steps: int
    ) -> list[Segment]:
        """Hand ``episode`` to ``B_wm``, cache it, imagine from the cache with ``policy`` (a
        service as ``RolloutWorker.run`` takes it) and put the segments; returns them."""
        self.to_world_model([episode])
        if episode.steps:
            self.cache.append(episode)
        if not self.cache or not self.settings.episodes_per_real:
            return []
        dreams = [self._start() for _ in range(self.settings.episodes_per_real)]
        for i, dream in enumerate(dreams):
            dream.number = self.counts["episodes"] + i
        judged = self.world_model(
            [WMRequest(np.stack(d.context), None, d.instruction) for d in dreams]
        )
        for dream, reply in zip(dreams, judged, strict=True):
            dream.prob, dream.wm_version = reply.prob, reply.version
        segments: list[Segment] = []
        while not all(d.done for d in dreams):
            live = [d for d in dreams if not d.done]
            segments += self._step(live, policy, worker, env_steps)
        if segments:
            if hasattr(self.sink, "put_many"):
                self.sink.put_many(segments)
            else:
                for segment in segments:
                    self.sink(segment)
        self.counts["steps"] += sum(len(s) for s in segments)
        self.counts["segments"] += len(segments)
        self.counts["episodes"] += len(dreams)
        self.counts["successes"] += sum(s.success for s in segments)
        return segments

    def _start(self) -> _Dream:
        """A new imagined episode from a real frame of a cached episode, uniformly over steps."""
        weights = [e.steps for e in self.cache]
        episode = self.rng.choices(list(self.cache), weights=weights)[0]
        t = self.rng.randrange(episode.steps)
        frames, past = start_context(
            episode.frames, episode.actions, t, self.settings.context_frames
        )
        return _Dream(
            instruction=episode.instruction,
            task=episode.task,
            context=list(frames),
            past=list(past),
            step=t,
            prob=0.0,
            images=[frames[-1]],
            steps=[t],
            actions=[],
            logprobs=[],
            values=[],
            rewards=[],
            versions=[],
        )

    def _step(self, live: list[_Dream], policy: Any, worker: int, env_steps: int) -> list[Segment]:
        """One step of every ``live`` episode; returns the segments that closed."""
        observations = [Observation(d.context[-1], d.instruction, d.task, d.step) for d in live]
        if hasattr(policy, "act_many"):
            replies: list[ActReply] = policy.act_many(observations, worker, env_steps)
        else:
            replies = [policy(o, worker, env_steps) for o in observations]
        tokens = [np.asarray(r.actions, dtype=np.int64) for r in replies]
        predicted = self.world_model(
            [
                WMRequest(np.stack(d.context), np.stack([*d.past, a]), d.instruction)
                for d, a in zip(live, tokens, strict=True)
            ]
        )
        s = self.settings
        next_prob = torch.tensor([p.prob for p in predicted])
        succeeded, failed, truncated = imagined_termination(
            next_prob,
            torch.tensor([d.length + 1 for d in live]),
            threshold=s.threshold,
            max_steps=s.max_steps,
            next_fail=torch.tensor([p.fail for p in predicted]),
            fail_threshold=s.fail_threshold,
        )
        rewards = imagined_reward(
            torch.tensor([d.prob for d in live]),
            next_prob,
            succeeded,
            terminal_reward=s.terminal_reward,
        )
        closed = []
        for i, (dream, reply, action, found) in enumerate(
            zip(live, replies, tokens, predicted, strict=True)
        ):
            dream.actions.append(action)
            dream.logprobs.append(np.asarray(reply.logprobs, dtype=np.float32))
            dream.values.append(float(reply.value))
            dream.versions.append(int(reply.version))
            dream.rewards.append(float(rewards[i]))
            dream.images.append(found.frame)
            dream.step += 1
            dream.steps.append(dream.step)
            dream.length += 1
            dream.prob, dream.wm_version = found.prob, found.version
            dream.context = [*dream.context[1:], found.frame]
            dream.past = [*dream.past[1:], action] if dream.past else []
            success, terminated = bool(succeeded[i]), bool(succeeded[i] or failed[i])
            done = terminated or bool(truncated[i])
            if done or len(dream.actions) == s.segment_len:
                closed.append(self._close(dream, worker, terminated, success, done))
            dream.done = done
        return closed

    def _close(
        self, dream: _Dream, worker: int, terminated: bool, success: bool, done: bool
    ) -> Segment:
        """The dream's open segment as a ``Segment``; the next one starts at its last frame."""
        segment = Segment(
            worker=worker,
            episode=dream.number,
            task=dream.task,
            instruction=dream.instruction,
            **segment_arrays(dream),
            terminated=terminated,
            episode_done=done,
            success=success,
            imagined=True,
            wm_version=dream.wm_version,
        )
        dream.images, dream.steps = [dream.images[-1]], [dream.steps[-1]]
        dream.actions, dream.logprobs, dream.values = [], [], []
        dream.rewards, dream.versions = [], []
        return segment

    def state_dict(self) -> dict:
        """The episode cache, the start-drawing generator and the counters."""
        return {"cache": list(self.cache), "rng": self.rng.getstate(), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.cache = deque(state["cache"], maxlen=self.settings.cache_episodes)
        self.rng.setstate(state["rng"])
        self.counts = dict(state["counts"])
