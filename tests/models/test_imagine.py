"""Imagination steps only the running episodes, ends each by the threshold or the cap, and pays
the potential-based reward; context windows pad an episode's start with its first frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from relayrl.models.world_model import (
    PAD_ACTION,
    ObservationModel,
    ObsModelConfig,
    SuccessModel,
    SuccessModelConfig,
    context_window,
    imagine,
    start_context,
)
from relayrl.models.world_model.base import to_unit

SIZE, K = 8, 2


class Brighter(ObservationModel):
    """Every step adds 0.25 to every pixel (0.5 in model space)."""

    def __init__(self, cfg: ObsModelConfig) -> None:
        super().__init__(cfg)
        self.unused = nn.Parameter(torch.zeros(1))

    def generate(self, context: Tensor, actions: Tensor, generator) -> Tensor:
        return (context[:, -1] + 0.5).clamp(-1, 1)


class Brightness(SuccessModel):
    """The success probability of a frame is its mean brightness."""

    def success_prob(self, frames: Tensor, instruction_ids: Tensor) -> Tensor:
        return to_unit(frames).flatten(1).mean(1)

    def probs(self, frames: Tensor, instruction_ids: Tensor) -> tuple[Tensor, Tensor]:
        p = self.success_prob(frames, instruction_ids)
        return p, torch.zeros_like(p)


def models() -> tuple[Brighter, Brightness]:
    obs = Brighter(ObsModelConfig(backend="brighter", image_size=SIZE, context_frames=K))
    return obs, Brightness(SuccessModelConfig(image_size=SIZE, channels=2, hidden=2))


def recorder(calls: list) -> object:
    def policy(frames: Tensor, instructions: list[str], steps: Tensor) -> Tensor:
        calls.append(steps.tolist())
        return torch.zeros(len(instructions), 1, dtype=torch.int64)

    return policy


def starts(*brightness: float) -> Tensor:
    return torch.tensor(brightness).view(-1, 1, 1, 1, 1, 1).expand(-1, K, 1, SIZE, SIZE, 3)


def test_episodes_end_at_the_threshold_and_only_running_ones_are_stepped():
    obs, reward = models()
    calls: list = []
    # Brightness 0 needs 4 steps to reach 1.0 >= 0.9; brightness 0.5 needs 2.
    out = imagine(
        obs,
        reward,
        recorder(calls),
        starts(0.0, 0.5),
        torch.zeros(2, K - 1, 1, dtype=torch.int64),
        ["go to the ball", "go to the key"],
        threshold=0.9,
        max_steps=10,
        terminal_reward=1.0,
    )

    assert calls == [[0, 0], [1, 1], [2], [3]]
    assert out.lengths.tolist() == [4, 2]
    assert out.success.tolist() == [True, True]
    assert out.frames.shape == (2, 5, 1, SIZE, SIZE, 3)
    assert out.probs[0].tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert out.probs[1].tolist() == [0.5, 0.75, 1.0, 1.0, 1.0]  # ended: the last frame stays
    # The rewards sum to p(end) - p(start) plus the terminal reward; 0 after the end.
    assert out.rewards.sum(1).tolist() == [2.0, 1.5]
    assert out.rewards[1, 2:].tolist() == [0.0, 0.0]
    assert out.terminated.nonzero().tolist() == [[0, 3], [1, 1]]
    assert not out.truncated.any()


def test_the_step_cap_truncates_without_success():
    obs, reward = models()
    out = imagine(
        obs,
        reward,
        recorder([]),
        starts(0.0),
        torch.zeros(1, K - 1, 1, dtype=torch.int64),
        ["go to the ball"],
        threshold=1.0,
        max_steps=3,
        terminal_reward=1.0,
    )

    assert out.lengths.tolist() == [3]
    assert out.truncated[0].tolist() == [False, False, True]
    assert not out.success.any()
    assert out.rewards.sum().item() == pytest.approx(0.75)


def test_context_windows_pad_the_start_with_the_first_frame_and_the_pad_action():
    frames = np.arange(4).reshape(4, 1, 1, 1, 1) * np.ones((1, 1, 2, 2, 3), np.uint8)
    actions = np.array([[1], [2], [1]])

    window, acts = context_window(frames, actions, 0, 3)
    assert window[:, 0, 0, 0, 0].tolist() == [0, 0, 0]
    assert acts[:, 0].tolist() == [PAD_ACTION, PAD_ACTION, 1]
    window, acts = context_window(frames, actions, 2, 3)
    assert window[:, 0, 0, 0, 0].tolist() == [0, 1, 2]
    assert acts[:, 0].tolist() == [1, 2, 1]
    # imagine's start at o_2: the same frames, and the actions before a_2
    window, before = start_context(frames, actions, 2, 3)
    assert window[:, 0, 0, 0, 0].tolist() == [0, 1, 2]
    assert before[:, 0].tolist() == [1, 2]
