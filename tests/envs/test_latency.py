"""Latency wrapper: the drawn delays have the requested mean and tail, and steps pass through."""

from __future__ import annotations

import math

import numpy as np
import pytest

from relayrl.envs.embodied import ActionSpace, Observation, StepResult
from relayrl.envs.latency import LatencyEnv


class CountingEnv:
    """An env whose reward is the action it was given, to check that steps pass through."""

    action_space = ActionSpace("discrete", 4)
    tasks = ("count",)

    def __init__(self) -> None:
        self.closed = False

    def reset(self, *, task: str | None = None, seed: int | None = None) -> Observation:
        return Observation(np.zeros((1, 2, 2, 3), np.uint8), "count", "count", 0)

    def step(self, action: np.ndarray | int) -> StepResult:
        obs = Observation(np.zeros((1, 2, 2, 3), np.uint8), "count", "count", 1)
        return StepResult(obs, float(action), False, False, False)

    def close(self) -> None:
        self.closed = True


def draws(n: int, **kwargs) -> np.ndarray:
    env = LatencyEnv(CountingEnv(), seed=0, **kwargs)
    return np.array([env.sample_delay() for _ in range(n)])


@pytest.mark.parametrize(
    ("dist", "sigma"), [("constant", 1.0), ("uniform", 1.0), ("lognormal", 0.5), ("lognormal", 1.0)]
)
def test_empirical_mean_matches_requested(dist, sigma):
    d = draws(100_000, dist=dist, mean_ms=20.0, sigma=sigma)
    # standard error of the mean is at most 20 * sqrt(e - 1) / sqrt(1e5) = 0.083 ms
    assert d.mean() == pytest.approx(20.0, abs=0.5)
    assert (d >= 0).all()


def test_uniform_spans_zero_to_twice_the_mean():
    d = draws(20_000, dist="uniform", mean_ms=5.0)
    assert d.min() >= 0 and d.max() <= 10.0
    assert d.min() < 0.1 and d.max() > 9.9


def test_lognormal_tail_matches_formula_and_grows_with_sigma():
    p99 = {}
    for sigma in (0.5, 1.5):
        d = draws(100_000, dist="lognormal", mean_ms=10.0, sigma=sigma)
        p99[sigma] = np.quantile(d, 0.99)
        mu = math.log(10.0) - sigma**2 / 2
        assert p99[sigma] == pytest.approx(math.exp(mu + 2.3263 * sigma), rel=0.05)
    # hand-derived: 10 * exp(-0.125 + 1.163) = 28.2 ms and 10 * exp(-1.125 + 3.489) = 106.4 ms
    assert p99[0.5] == pytest.approx(28.2, rel=0.05)
    assert p99[1.5] == pytest.approx(106.4, rel=0.05)


def test_same_seed_same_delays():
    assert np.array_equal(
        draws(10, dist="lognormal", mean_ms=3.0), draws(10, dist="lognormal", mean_ms=3.0)
    )


def test_step_passes_through_and_records_delays():
    inner = CountingEnv()
    env = LatencyEnv(inner, dist="constant", mean_ms=0.5, history=2)
    assert env.action_space == inner.action_space and env.tasks == ("count",)
    assert env.reset().step == 0
    assert [env.step(a).reward for a in (3, 1, 2)] == [3.0, 1.0, 2.0]
    assert list(env.delays_ms) == [0.5, 0.5]  # only the last ``history`` are kept
    env.close()
    assert inner.closed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dist": "pareto", "mean_ms": 1.0}, "dist must be one of"),
        ({"mean_ms": -1.0}, "mean_ms must be a finite number >= 0, got -1.0"),
        ({"mean_ms": math.inf}, "mean_ms must be a finite number"),
        ({"dist": "lognormal", "mean_ms": 0.0}, "mean_ms must be > 0 for dist='lognormal'"),
        ({"mean_ms": 1.0, "sigma": -0.1}, "sigma must be a finite number >= 0"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatencyEnv(CountingEnv(), **kwargs)
