"""Imagination: play a policy inside the world model from real start frames, a batch of episodes
stepped together.

Each step asks the policy for action tokens on the newest frame, predicts the next frame with
M_obs from the last K frames and actions, judges it with M_reward, and ends an episode by
``imagined_termination`` (success at the threshold, failure at the failure head's threshold, or
cut at the step cap), rewarding it by
``imagined_reward``. Only the episodes still running are stepped; an ended one keeps its last
frame and gets reward 0 from then on.

A context shorter than K (an episode's first steps) is padded on the left with copies of its
first frame and with ``PAD_ACTION``: ``context_window`` builds windows that way for training and
``imagine`` is given them, so the model sees the same padding in both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from relayrl.models.world_model.base import ObservationModel
from relayrl.models.world_model.reward_model import SuccessModel
from relayrl.models.world_model.rewards import imagined_reward, imagined_termination

PAD_ACTION = 0
"""The action token that stands for the steps before an episode began."""

Policy = Callable[[Tensor, list[str], Tensor], Tensor]
"""``policy(frames uint8 [B, V, H, W, 3], instructions, steps int64 [B]) -> action tokens int64
[B, D]``: what imagination asks for an action."""


def context_window(frames: np.ndarray, actions: np.ndarray, t: int, k: int) -> tuple:
    """Frames o_{t-k+1} .. o_t [k, V, H, W, 3] and actions a_{t-k+1} .. a_t [k, D] of one episode
    (``frames`` [T + 1, ...], ``actions`` [T, D], 0 <= t < T), padded before o_0 with o_0 and
    ``PAD_ACTION``: the context that predicts o_{t+1}."""
    idx = np.arange(t - k + 1, t + 1)
    window = frames[np.maximum(idx, 0)]
    acts = np.where((idx >= 0)[:, None], actions[np.maximum(idx, 0)], PAD_ACTION)
    return window, acts.astype(np.int64)


def start_context(frames: np.ndarray, actions: np.ndarray, t: int, k: int) -> tuple:
    """What ``imagine`` starts from at o_t of a real episode: frames o_{t-k+1} .. o_t [k, ...]
    and the k - 1 actions before a_t [k - 1, D], padded as ``context_window`` pads."""
    idx = np.arange(t - k + 1, t + 1)
    window = frames[np.maximum(idx, 0)]
    before = idx[1:] - 1
    acts = np.where((before >= 0)[:, None], actions[np.maximum(before, 0)], PAD_ACTION)
    return window, acts.reshape(k - 1, actions.shape[1]).astype(np.int64)


@dataclass
class Imagined:
    """A batch of B imagined episodes of at most T steps."""

    frames: Tensor  # uint8 [B, T + 1, V, H, W, 3]: the real start frame, then predictions
    actions: Tensor  # int64 [B, T, D]
    rewards: Tensor  # float32 [B, T]: imagined_reward; 0 after an episode ended
    probs: Tensor  # float32 [B, T + 1]: M_reward's success probability of each frame
    succeeded: Tensor  # bool [B, T]: ended in success at this step
    failed: Tensor  # bool [B, T]: ended in failure at this step (the failure head)
    truncated: Tensor  # bool [B, T]: cut at the step cap at this step
    lengths: Tensor  # int64 [B]: steps each episode took

    @property
    def terminated(self) -> Tensor:
        """bool [B, T]: ended at this step, in success or in failure."""
        return self.succeeded | self.failed

    @property
    def success(self) -> Tensor:
        """bool [B]: the episode ended in success."""
        return self.succeeded.any(dim=1)

    @property
    def failure(self) -> Tensor:
        """bool [B]: the episode ended in failure."""
        return self.failed.any(dim=1)


@torch.no_grad()
def imagine(
    obs_model: ObservationModel,
    reward_model: SuccessModel,
    policy: Policy,
    frames: Tensor,
    past_actions: Tensor,
    instructions: list[str],
    *,
    threshold: float,
    max_steps: int,
    terminal_reward: float,
    fail_threshold: float = 1.0,
    start_steps: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Imagined:
    """Imagined episodes from real start contexts: ``frames`` uint8 [B, K, V, H, W, 3] (the last
    is the start frame) and the K - 1 ``past_actions`` int64 [B, K - 1, D] before it (as
    ``start_context`` gives them), one instruction each; ``start_steps`` [B] are the episodes'
    step counts at the start frame (0 by default), what the policy is told. Episodes end in
    failure where the reward model's failure head reaches ``fail_threshold``."""
    batch, k = frames.shape[:2]
    if k != obs_model.cfg.context_frames or len(instructions) != batch:
        raise ValueError(
            f"frames must be [B, K={obs_model.cfg.context_frames}, ...] with one instruction "
            f"each, got {list(frames.shape)} and {len(instructions)} instructions"
        )
    if tuple(past_actions.shape[:2]) != (batch, k - 1):
        raise ValueError(f"past_actions must be [B, K - 1, D], got {list(past_actions.shape)}")
    ids = reward_model.tokenize(instructions)
    steps0 = torch.zeros(batch, dtype=torch.int64) if start_steps is None else start_steps.long()
    context, past = frames.clone(), past_actions.long().clone()
    prob = reward_model.success_prob(frames[:, -1], ids).cpu()
    out_frames, out_probs = [frames[:, -1].clone()], [prob.clone()]
    out_actions, out_rewards, out_succ, out_fail, out_trunc = [], [], [], [], []
    running = torch.ones(batch, dtype=torch.bool)
    lengths = torch.zeros(batch, dtype=torch.int64)
    dims = past.shape[-1]
    for step in range(max_steps):
        if not running.any():
            break
        live = running.nonzero().squeeze(1)
        live_list = live.tolist()
        tokens = policy(
            context[live, -1], [instructions[i] for i in live_list], steps0[live] + step
        ).long()
        action_window = torch.cat([past[live], tokens.view(-1, 1, dims)], dim=1)
        nxt = obs_model.predict(context[live], action_window, generator=generator).cpu()
        next_prob, next_fail = (p.cpu() for p in reward_model.probs(nxt, ids[live]))
        succeeded, failed, truncated = imagined_termination(
            next_prob,
            lengths[live] + 1,
            threshold=threshold,
            max_steps=max_steps,
            next_fail=next_fail,
            fail_threshold=fail_threshold,
        )
        reward = imagined_reward(prob[live], next_prob, succeeded, terminal_reward=terminal_reward)

        frame_t = out_frames[-1].clone()
        frame_t[live] = nxt
        action_t = torch.full((batch, dims), PAD_ACTION, dtype=torch.int64)
        action_t[live] = tokens
        reward_t = torch.zeros(batch)
        reward_t[live] = reward.float()
        for out, ended in ((out_succ, succeeded), (out_fail, failed), (out_trunc, truncated)):
            ended_t = torch.zeros(batch, dtype=torch.bool)
            ended_t[live] = ended
            out.append(ended_t)
        out_frames.append(frame_t)
        out_actions.append(action_t)
        out_rewards.append(reward_t)

        context[live] = torch.cat([context[live, 1:], nxt[:, None]], dim=1)
        past[live] = action_window[:, 1:]
        prob[live] = next_prob
        out_probs.append(prob.clone())
        lengths[live] += 1
        running[live] = ~(succeeded | failed | truncated)
    return Imagined(
        frames=torch.stack(out_frames, 1),
        actions=_stack(out_actions, (batch, 0, dims), torch.int64),
        rewards=_stack(out_rewards, (batch, 0), torch.float32),
        probs=torch.stack(out_probs, 1),
        succeeded=_stack(out_succ, (batch, 0), torch.bool),
        failed=_stack(out_fail, (batch, 0), torch.bool),
        truncated=_stack(out_trunc, (batch, 0), torch.bool),
        lengths=lengths,
    )


def _stack(items: list[Tensor], empty: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """``items`` stacked on dim 1, or an empty tensor of shape ``empty`` when there are none."""
    return torch.stack(items, 1) if items else torch.zeros(empty, dtype=dtype)
