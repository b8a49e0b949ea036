"""The adapter every embodied environment implements: image observations and an instruction in,
actions out, a success flag at the end of an episode.

Rollout workers, the inference service and the trainer only ever see these types, so BabyAI,
MetaWorld, LIBERO and a learned world model are interchangeable behind ``EmbodiedEnv``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np


@dataclass(frozen=True)
class ActionSpace:
    """The action space as the policy sees it: a vocabulary of action tokens.

    A discrete space of ``n`` actions is one token per step from a vocabulary of ``n``. A
    continuous space of ``n`` dimensions in [``low``, ``high``] is ``n`` tokens per step, each
    one of ``bins`` uniform bins per dimension; ``to_env`` maps tokens to bin centres.
    """

    kind: Literal["discrete", "continuous"]
    n: int
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()
    bins: int = 256

    @property
    def dims(self) -> int:
        """Action tokens per step."""
        return 1 if self.kind == "discrete" else self.n

    @property
    def vocab(self) -> int:
        """Size of the action-token vocabulary of each dimension."""
        return self.n if self.kind == "discrete" else self.bins

    def to_env(self, tokens: np.ndarray) -> np.ndarray | int:
        """Action tokens [dims] to what the environment's ``step`` takes."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(self.dims)
        if self.kind == "discrete":
            return int(tokens[0])
        low, high = np.asarray(self.low, np.float64), np.asarray(self.high, np.float64)
        return (low + (tokens + 0.5) * (high - low) / self.bins).astype(np.float32)

    def to_tokens(self, action: np.ndarray | int) -> np.ndarray:
        """An environment action to action tokens [dims] (the bin that holds each value)."""
        if self.kind == "discrete":
            return np.asarray([int(action)], dtype=np.int64)
        low, high = np.asarray(self.low, np.float64), np.asarray(self.high, np.float64)
        frac = (np.asarray(action, np.float64) - low) / (high - low)
        return np.clip((frac * self.bins).astype(np.int64), 0, self.bins - 1)


@dataclass
class Observation:
    """What the policy sees at one step."""

    image: np.ndarray  # uint8 [V, H, W, 3]: one or more camera views
    instruction: str  # the task's language instruction (BabyAI mission, LIBERO language)
    task: str  # task name, the key of per-task success rates and DWR weights
    step: int  # steps taken in this episode so far


@dataclass
class StepResult:
    """The outcome of one ``EmbodiedEnv.step``."""

    obs: Observation  # observation after the step (the final one when the episode ended)
    reward: float
    terminated: bool  # the episode ended in the task's own terms (success or failure): no bootstrap
    truncated: bool  # the episode hit its time limit: bootstrap from the value of ``obs``
    success: bool  # the task was achieved (meaningful when terminated or truncated)
    info: dict[str, Any] = field(default_factory=dict)


class EmbodiedEnv(Protocol):
    """One non-vectorised environment, owned by one rollout worker."""

    action_space: ActionSpace
    tasks: tuple[str, ...]  # task names this env can reset into

    def reset(self, *, task: str | None = None, seed: int | None = None) -> Observation:
        """Start an episode of ``task`` (a member of ``tasks``; None picks the first)."""
        ...

    def step(self, action: np.ndarray | int) -> StepResult:
        """Apply one action (as ``ActionSpace.to_env`` returns it)."""
        ...

    def close(self) -> None:
        """Release simulator resources."""
        ...
