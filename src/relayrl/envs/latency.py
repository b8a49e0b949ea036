"""A wrapper that makes any ``EmbodiedEnv`` slow in a controlled way: a random sleep after every
step, to study how rollout workers and the inference service behave when simulators straggle.

Distributions, each parameterised by its mean ``mean_ms``:

- ``constant``: every delay is ``mean_ms``.
- ``uniform``: uniform on [0, 2 * ``mean_ms``].
- ``lognormal``: ``exp(N(mu, sigma^2))`` with ``mu = ln(mean_ms) - sigma^2 / 2`` so that its mean is
  ``mean_ms``; ``sigma`` (of the underlying normal) sets how heavy the tail is: the 99th
  percentile is ``exp(mu + 2.326 sigma)``, about 6.2x the mean at ``sigma=1``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from relayrl.envs.embodied import EmbodiedEnv, Observation, StepResult


def _constant(rng: np.random.Generator, mean_ms: float, sigma: float) -> float:
    return mean_ms


def _uniform(rng: np.random.Generator, mean_ms: float, sigma: float) -> float:
    return float(rng.uniform(0.0, 2.0 * mean_ms))


def _lognormal(rng: np.random.Generator, mean_ms: float, sigma: float) -> float:
    return float(rng.lognormal(math.log(mean_ms) - sigma**2 / 2, sigma))


DELAYS: dict[str, Callable[[np.random.Generator, float, float], float]] = {
    "constant": _constant,
    "uniform": _uniform,
    "lognormal": _lognormal,
}


class LatencyEnv:
    """``env`` with a random sleep after each ``step`` (none after ``reset``).

    ``delays_ms`` holds the most recent ``history`` delays slept, oldest first.
    """

    def __init__(
        self,
        env: EmbodiedEnv,
        *,
        dist: str = "lognormal",
        mean_ms: float,
        sigma: float = 1.0,
        seed: int | None = None,
        history: int = 10_000,
    ) -> None:
        if dist not in DELAYS:
            raise ValueError(f"dist must be one of {sorted(DELAYS)}, got {dist!r}")
        if not (math.isfinite(mean_ms) and mean_ms >= 0):
            raise ValueError(f"mean_ms must be a finite number >= 0, got {mean_ms}")
        if dist == "lognormal" and mean_ms == 0:
            raise ValueError("mean_ms must be > 0 for dist='lognormal' (use 'constant' for none)")
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"sigma must be a finite number >= 0, got {sigma}")
        self.env = env
        self.action_space = env.action_space
        self.tasks = env.tasks
        self.dist, self.mean_ms, self.sigma = dist, float(mean_ms), float(sigma)
        self.delays_ms: deque[float] = deque(maxlen=history)
        self._draw = DELAYS[dist]
        self._rng = np.random.default_rng(seed)

    def sample_delay(self) -> float:
        """Draw one delay in milliseconds without sleeping."""
        return self._draw(self._rng, self.mean_ms, self.sigma)

    def reset(self, *, task: str | None = None, seed: int | None = None) -> Observation:
        """Start an episode of the wrapped env, with no delay."""
        return self.env.reset(task=task, seed=seed)

    def step(self, action: np.ndarray | int) -> StepResult:
        """Step the wrapped env, then sleep for one drawn delay."""
        result = self.env.step(action)
        delay = self.sample_delay()
        self.delays_ms.append(delay)
        time.sleep(delay / 1000)
        return result

    def close(self) -> None:
        """Close the wrapped env."""
        self.env.close()
