"""Shared fixtures: a tiny model config and one embedded Ray instance per test session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relayrl.config import Config, load_config
from relayrl.executors.generator import decode_completions
from relayrl.types import RolloutBatch

QUIET = ["log.progress=false", "log.tensorboard=false", "log.report=false"]
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


def text_batch(tokenizer, completions: list[str], answers: list[str], finished: list[bool]):
    """One group: prompt "1+2=" then each completion, with EOS where it ``finished``, decoded as
    the generator decodes."""
    prompt = tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    rows = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    rows = [r + [tokenizer.eos_token_id] * done for r, done in zip(rows, finished, strict=True)]
    width = len(prompt) + max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), dtype=np.int64)
    versions = np.full((len(rows), width), -1)
    for i, row in enumerate(rows):
        tokens[i, : len(prompt) + len(row)] = prompt + row
        versions[i, len(prompt) : len(prompt) + len(row)] = 0
    return RolloutBatch(
        tokens=tokens,
        prompt_len=np.full(len(rows), len(prompt)),
        completion_len=np.array([len(r) for r in rows]),
        logprobs=np.zeros((len(rows), width), dtype=np.float32),
        versions=versions,
        finished=np.array(finished),
        group_size=len(rows),
        answers=answers,
        completions=decode_completions(tokenizer, rows),
    )


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
