"""What a rollout worker imagines with (AcceRL-WM): its ``WorldModelEnv``s, the real episodes they
start from, and where their segments and the real episodes go.

A worker given an ``Imagination`` (``RolloutWorker.set_imagination``) steps
``imagination.episodes_per_real`` ``WorldModelEnv`` slots per real env beside its real envs, in
the same rounds (one act request for all slots), through the same segmenter. Each real episode
it finishes goes to the world-model trainer's ``B_wm`` and into the cache of its last
``imagination.cache_episodes`` episodes (``RealStarts``), and makes ``episodes_per_real``
imagined episodes due; an idle imagined slot starts a due one from a real step of the cache
(drawn with this object's generator). Starts due while every slot is busy wait, at most one per
slot: the rest are not played. The imagined segments (tagged ``imagined``, with the world-model
version of their last step) go to ``B_img``.

Books: ``counts`` are the imagined env steps, segments, episodes and successes of the segments
put into ``B_img`` (an imagined step is generated when it is put); the steps of an imagined
segment still open are in no book, and a worker reloaded from a checkpoint drops them, as it
drops its real open segments.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.data.trajectories import Episode
from relayrl.envs.embodied import ActionSpace
from relayrl.envs.world_model_env import RealStarts, WorldModelEnv, WorldModelService
from relayrl.types import Segment


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

    @classmethod
    def from_config(cls, cfg: Any) -> ImaginationSettings:
        """The settings a run's ``Config`` gives (``imagination``, ``world_model``)."""
        wm = cfg.world_model
        return cls(
            episodes_per_real=cfg.imagination.episodes_per_real,
            cache_episodes=cfg.imagination.cache_episodes,
            context_frames=wm.context_frames,
            threshold=wm.threshold,
            fail_threshold=wm.failure_threshold,
            max_steps=wm.max_steps,
            terminal_reward=wm.terminal_reward,
        )


class Imagination:
    """A rollout worker's imagination: ``world_model`` is the world-model service
    (``WorldModelService``), ``sink`` takes the imagined segments (``put_many`` where it has
    it), ``to_world_model`` takes real episodes for ``B_wm``; ``seed`` seeds the start draws."""

    def __init__(
        self,
        settings: ImaginationSettings,
        world_model: WorldModelService,
        sink: Any,
        to_world_model: Callable[[list[Episode]], object],
        seed: int,
    ):
        if settings.episodes_per_real < 1:
            raise ValueError(
                f"episodes_per_real must be >= 1 to imagine, got {settings.episodes_per_real}"
            )
        self.settings = settings
        self.world_model = world_model
        self.sink = sink
        self.to_world_model = to_world_model
        self.starts = RealStarts(settings.cache_episodes)
        self.rng = random.Random(seed)
        self.slots = 0  # imagined envs, set by ``make_envs``
        self.due = 0  # imagined episodes due and not started
        self.started = 0  # imagined episodes started: the next one's number
        self.counts = {"steps": 0, "segments": 0, "episodes": 0, "successes": 0}

    def make_envs(
        self, real_envs: int, action_space: ActionSpace, tasks: Sequence[str]
    ) -> list[WorldModelEnv]:
        """The imagined envs of a worker with ``real_envs`` real ones of ``action_space``."""
        s = self.settings
        self.slots = s.episodes_per_real * real_envs
        return [
            WorldModelEnv(
                self.world_model,
                self.starts,
                action_space,
                context_frames=s.context_frames,
                threshold=s.threshold,
                max_steps=s.max_steps,
                terminal_reward=s.terminal_reward,
                fail_threshold=s.fail_threshold,
                tasks=tasks,
            )
            for _ in range(self.slots)
        ]

    def real_episodes(self, episodes: list[Episode]) -> None:
        """Hand finished real ``episodes`` to ``B_wm``, cache them and make their imagined
        episodes due."""
        self.to_world_model(episodes)
        for episode in episodes:
            self.starts.add(episode)
        self.due = min(self.due + self.settings.episodes_per_real * len(episodes), self.slots)

    def start(self) -> tuple[int, int] | None:
        """The number and reset seed of the next imagined episode, if one is due and the cache
        has a real episode to start it from; else None."""
        if not self.due or not len(self.starts):
            return None
        self.due -= 1
        self.started += 1
        return self.started - 1, self.rng.randrange(2**31)

    def put(self, segments: list[Segment]) -> None:
        """Put imagined ``segments`` into ``B_img`` in one call, and count them."""
        if hasattr(self.sink, "put_many"):
            self.sink.put_many(segments)
        else:
            for segment in segments:
                self.sink(segment)
        self.counts["steps"] += sum(len(s) for s in segments)
        self.counts["segments"] += len(segments)
        self.counts["episodes"] += sum(s.episode_done for s in segments)
        self.counts["successes"] += sum(s.success for s in segments)

    def state_dict(self) -> dict:
        """The episode cache, the start-drawing generator, the starts due and the counters."""
        return {
            "cache": list(self.starts.episodes),
            "rng": self.rng.getstate(),
            "due": self.due,
            "started": self.started,
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.starts.episodes.clear()
        self.starts.episodes.extend(state["cache"])
        self.rng.setstate(state["rng"])
        self.due, self.started = state["due"], state["started"]
        self.counts = dict(state["counts"])
