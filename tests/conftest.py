"""Shared fixtures: a tiny model config and one embedded Ray instance per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.config import Config, load_config

QUIET = ["log.progress=false", "log.tensorboard=false"]
TINY = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.intermediate_size=64",
    "warm_start.max_steps=0",
    *QUIET,
]


def shm_files() -> set[str]:
    """The weight-sync shared-memory files present now."""
    return {p.name for p in Path("/dev/shm").glob("relayrl-sync-*")}


def tiny_config(*overrides: str) -> Config:
    """A config small enough for unit tests: a 1-layer, 32-wide Llama and no warm start (an
    embodied one only turns the progress bar and TensorBoard off)."""
    base = QUIET if "workload=embodied" in overrides else TINY
    return load_config(None, [*base, *overrides])


@pytest.fixture(scope="session")
def ray_session():
    """One embedded Ray instance for every test that needs it (start-up costs seconds)."""
    import ray

    from relayrl.launch import start_ray

    start_ray(tiny_config())
    yield ray
    ray.shutdown()
