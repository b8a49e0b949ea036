"""The world model as an embodied environment (AcceRL-WM's imagination).

``WorldModelEnv`` has the ``EmbodiedEnv`` interface, so a rollout worker steps it beside its real
envs, through the same rollout path and segmenter. ``reset`` starts an imagined episode from a
real context: a step t drawn uniformly over the steps of the real episodes in ``RealStarts`` (a
worker's cache of the last episodes it finished), with the frames o_{t-K+1} .. o_t and the
actions before a_t as context (``start_context``). ``step`` sends the context and the action to
the world-model service, which answers with the predicted next frame and M_reward's success and
failure probabilities of it. An episode ends in success when the success probability reaches
``threshold``, in failure when the failure probability reaches ``fail_threshold``, and is cut
(truncated) at ``max_steps`` steps; its rewards are the potential-based ones of
``models/world_model/rewards.py``, with the start frame's success probability (asked for at
``reset``, answered while the policy chooses the first action) as the first potential.

The service is passed in as anything with ``submit(WMRequest)`` returning a future of a
``WMReply``: ``submit_step`` returns without waiting, so a worker has every imagined env's
request in flight at once and the service batches them.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

import numpy as np
import torch

from relayrl.data.trajectories import Episode
from relayrl.envs.embodied import ActionSpace, Observation, StepResult
from relayrl.models.world_model.imagine import start_context
from relayrl.models.world_model.rewards import imagined_reward, imagined_termination
from relayrl.models.world_model.serving import WMReply, WMRequest


class WorldModelService(Protocol):
    """What a ``WorldModelEnv`` steps through: one request in, a future of its reply out."""

    def submit(self, request: WMRequest) -> Future[WMReply]:
        """Send ``request``; its reply once the service answers."""
        ...


class RealStarts:
    """The real episodes imagined ones start from: the last ``size`` with at least one step."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.episodes: deque[Episode] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self.episodes)

    def add(self, episode: Episode) -> None:
        """Keep ``episode`` (one without steps has no frame to act on, and is left out)."""
        if episode.steps:
            self.episodes.append(episode)

    def draw(self, rng: random.Random, task: str | None = None) -> tuple[Episode, int]:
        """A kept episode (of ``task``, if given) and a step t in it, uniformly over their
        steps."""
        found = [e for e in self.episodes if task is None or e.task == task]
        if not found:
            held = sorted({e.task for e in self.episodes})
            raise ValueError(f"task={task!r}: no real episode to start from; held: {held}")
        episode = rng.choices(found, weights=[e.steps for e in found])[0]
        return episode, rng.randrange(episode.steps)


class WorldModelEnv:
    """An embodied env whose frames the world model predicts (see the module docstring).

    ``action_space`` is the real env's; ``context_frames`` is K, the frames (and actions) the
    world model predicts from. The version of the world model that answered a step is in
    ``StepResult.info["wm_version"]``.
    """

    def __init__(
        self,
        world_model: WorldModelService,
        starts: RealStarts,
        action_space: ActionSpace,
        *,
        context_frames: int,
        threshold: float,
        max_steps: int,
        terminal_reward: float,
        fail_threshold: float = 1.0,
        tasks: Sequence[str] = (),
    ):
        if context_frames < 1:
            raise ValueError(f"context_frames must be >= 1, got {context_frames}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.world_model = world_model
        self.starts = starts
        self.action_space = action_space
        self.tasks = tuple(tasks)
        self.context_frames = context_frames
        self.threshold = threshold
        self.fail_threshold = fail_threshold
        self.max_steps = max_steps
        self.terminal_reward = terminal_reward
        self._episode: _Imagined | None = None

    def reset(self, *, task: str | None = None, seed: int | None = None) -> Observation:
        """Start an imagined episode at a real step drawn with ``seed`` (of ``task``'s episodes,
        if given); the observation is that real frame."""
        episode, t = self.starts.draw(random.Random(seed), task)
        frames, past = start_context(episode.frames, episode.actions, t, self.context_frames)
        judged = self.world_model.submit(WMRequest(frames, None, episode.instruction))
        self._episode = _Imagined(
            Observation(frames[-1], episode.instruction, episode.task, t),
            list(frames),
            list(past),
            judged,
        )
        return self._episode.obs

    def step(self, action: np.ndarray | int) -> StepResult:
        """Predict the next frame and judge it; blocks for the service's answer."""
        return self.submit_step(action).result()

    def submit_step(self, action: np.ndarray | int) -> _Step:
        """Send the step's request and return at once; the step's ``StepResult`` is its
        ``result()``."""
        ep = self._episode
        if ep is None:
            raise RuntimeError("step() needs an episode: call reset() first")
        tokens = self.action_space.to_tokens(action)
        request = WMRequest(np.stack(ep.context), np.stack([*ep.past, tokens]), ep.obs.instruction)
        return _Step(self, ep, tokens, self.world_model.submit(request))

    def close(self) -> None:
        """Nothing to release: the service belongs to the run."""
        self._episode = None

    def _finish(self, ep: _Imagined, tokens: np.ndarray, reply: WMReply) -> StepResult:
        """Book the service's ``reply`` to a step of ``ep``: the episode's next frame, reward and
        end."""
        if ep.prob is None:
            ep.prob = float(ep.judged.result().prob)
        ep.length += 1
        next_prob = torch.tensor([reply.prob], dtype=torch.float32)
        succeeded, failed, truncated = imagined_termination(
            next_prob,
            torch.tensor([ep.length]),
            threshold=self.threshold,
            max_steps=self.max_steps,
            next_fail=torch.tensor([reply.fail], dtype=torch.float32),
            fail_threshold=self.fail_threshold,
        )
        reward = imagined_reward(
            torch.tensor([ep.prob], dtype=torch.float32),
            next_prob,
            succeeded,
            terminal_reward=self.terminal_reward,
        )
        ep.prob = float(reply.prob)
        ep.context = [*ep.context[1:], reply.frame]
        ep.past = [*ep.past[1:], tokens] if ep.past else []
        obs = Observation(reply.frame, ep.obs.instruction, ep.obs.task, ep.obs.step + 1)
        ep.obs = obs
        success = bool(succeeded[0])
        terminated = success or bool(failed[0])
        if terminated or bool(truncated[0]):
            self._episode = None
        return StepResult(
            obs,
            float(reward[0]),
            terminated=terminated,
            truncated=bool(truncated[0]),
            success=success,
            info={"wm_version": int(reply.version)},
        )


class _Imagined:
    """The imagined episode being played: its newest observation, the last K frames and the
    K - 1 actions before the next one, and the success probability of the newest frame (None
    until the start frame's judgement, ``judged``, has been read)."""

    def __init__(
        self,
        obs: Observation,
        context: list[np.ndarray],
        past: list[np.ndarray],
        judged: Future[WMReply],
    ):
        self.obs = obs
        self.context = context
        self.past = past
        self.judged = judged
        self.prob: float | None = None
        self.length = 0


class _Step:
    """A step in flight: ``result()`` waits for the service and books the step."""

    def __init__(self, env: WorldModelEnv, ep: _Imagined, tokens: np.ndarray, reply: Future):
        self.env, self.ep, self.tokens, self.reply = env, ep, tokens, reply

    def result(self) -> StepResult:
        """The step's outcome (raises what the service raised)."""
        return self.env._finish(self.ep, self.tokens, self.reply.result())
