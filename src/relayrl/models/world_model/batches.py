"""Training batches of the world model, drawn from real episodes: K-frame transitions for M_obs,
labelled frames for M_reward.

Pretraining (``relayrl wm pretrain``) and the world-model trainer of a run draw them alike. A
success frame (the last frame of a successful episode) is one in tens, so M_reward's batches are
half success frames and half others, which keeps the classifier from answering "never"; with the
failure head a quarter are success frames and a quarter failure frames (the last frame of an
episode the env ended without success), while the data holds any.
"""

from __future__ import annotations

import numpy as np
import torch

from relayrl.data.trajectories import Episode
from relayrl.models.world_model.base import Transitions
from relayrl.models.world_model.imagine import context_window
from relayrl.models.world_model.reward_model import SuccessLabels, SuccessModel

OTHER, SUCCESS, FAILURE = 0, 1, 2
"""A frame's outcome: it does not end its episode, it ends it in success, or in failure."""


def transitions(episodes: list[Episode], index: np.ndarray, k: int) -> Transitions:
    """The transitions ``index`` [N, 2] (episode, step) names, as uint8 contexts."""
    contexts, actions, targets = [], [], []
    for e, t in index:
        frames, acts = context_window(episodes[e].frames, episodes[e].actions, int(t), k)
        contexts.append(frames)
        actions.append(acts)
        targets.append(episodes[e].frames[t + 1])
    return Transitions(
        torch.from_numpy(np.stack(contexts)),
        torch.from_numpy(np.stack(actions)),
        torch.from_numpy(np.stack(targets)),
    )


def transition_index(episodes: list[Episode], chosen: np.ndarray) -> np.ndarray:
    """[N, 2] (episode, step) of every transition of the ``chosen`` episodes."""
    rows = [(e, t) for e in chosen for t in range(episodes[e].steps)]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 2)


def frame_index(episodes: list[Episode], chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, 2] (episode, frame) of every frame of the ``chosen`` episodes, and each frame's
    outcome int8 [N]: ``SUCCESS`` (the last frame of a successful episode), ``FAILURE`` (the
    last frame of an episode the env ended without success) or ``OTHER``."""
    chosen = np.asarray(chosen, dtype=np.int64)
    lengths = np.array([len(episodes[e].frames) for e in chosen], dtype=np.int64)
    ends = np.cumsum(lengths)  # one past each episode's last frame
    frame = np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - lengths, lengths)
    index = np.stack([np.repeat(chosen, lengths), frame], axis=1)
    outcome = np.zeros(len(index), np.int8)
    outcome[ends - 1] = [
        SUCCESS if episodes[e].success else FAILURE if episodes[e].terminated else OTHER
        for e in chosen
    ]
    return index, outcome


def draw_frames(
    index: np.ndarray, outcome: np.ndarray, n: int, rng: np.random.Generator, failure_head: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """``n`` of the frames ``index`` [N, 2] of ``outcome`` [N] drawn with replacement for one
    M_reward step, and their outcomes: half success frames and half others, or with
    ``failure_head`` (and any failure frame held) a quarter success, a quarter failure and half
    others; None while no success frame, or no other frame, is held."""
    fails = np.flatnonzero(outcome == FAILURE) if failure_head else np.zeros(0, np.int64)
    wins = np.flatnonzero(outcome == SUCCESS)
    rest = np.flatnonzero(outcome == OTHER if len(fails) else outcome != SUCCESS)
    quarter = n // 4 if len(fails) else 0
    pools = [(wins, n // 2 - quarter), (fails, quarter), (rest, n - n // 2)]
    if not len(wins) or not len(rest):
        return None
    pos = np.concatenate([pool[rng.integers(len(pool), size=k)] for pool, k in pools if k])
    return index[pos], outcome[pos]


def labels(
    model: SuccessModel, episodes: list[Episode], index: np.ndarray, outcome: np.ndarray
) -> SuccessLabels:
    """``SuccessLabels`` for the frames ``index`` [N, 2] names, of ``outcome`` [N]; failure
    labels only for a model with the failure head."""
    frames = torch.from_numpy(np.stack([episodes[e].frames[t] for e, t in index]))
    ids = model.tokenize([episodes[e].instruction for e, _ in index])
    failure = torch.as_tensor(outcome == FAILURE) if model.cfg.failure_head else None
    return SuccessLabels(frames, ids, torch.as_tensor(outcome == SUCCESS), failure)
