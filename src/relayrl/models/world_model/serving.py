"""The world model as one servable module: M_obs and M_reward under one state dict and one
version, and the batch function an ``InferenceService`` answers imagination requests with.

A request asks for the next frame of one imagined episode (its last K frames and actions, and its
instruction); the reply holds the predicted frame and M_reward's success and failure probabilities
of it. A
request without actions only asks for the probability of its last frame (an imagined episode's
real start frame). Requests of one batch are answered by one M_obs pass and one M_reward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from relayrl.models.world_model.base import ObservationModel
from relayrl.models.world_model.reward_model import SuccessModel


class WorldModel(nn.Module):
    """M_obs (``obs``) and M_reward (``reward``) as one module: the world-model trainer publishes
    its ``state_dict`` as one version, and a world-model service serves it."""

    def __init__(self, obs: ObservationModel, reward: SuccessModel):
        super().__init__()
        self.obs = obs
        self.reward = reward


@dataclass
class WMRequest:
    """One imagination request."""

    context: np.ndarray  # uint8 [K, V, H, W, 3]: o_{t-K+1} .. o_t
    actions: np.ndarray | None  # int64 [K, D]: a_{t-K+1} .. a_t; None: judge o_t only
    instruction: str


@dataclass
class WMReply:
    """The world model's answer to one ``WMRequest``."""

    frame: np.ndarray | None  # uint8 [V, H, W, 3]: the predicted o_{t+1}; None if judged only
    prob: float  # M_reward's success probability of the predicted frame (or of o_t)
    fail: float  # its failure probability (0 without the failure head)
    version: int  # world-model version of the weights that answered


def world_model_replies(
    model: WorldModel,
    requests: list[WMRequest],
    greedy: bool,
    generator: torch.Generator,
    version: int,
) -> list[WMReply]:
    """The world model's ``BatchFn`` (see ``relayrl.executors.inference_service``): one M_obs
    pass over the requests with actions, one M_reward pass over every judged frame. ``greedy``
    does not apply (the diffusion backend samples from ``generator``)."""
    stepped = [i for i, r in enumerate(requests) if r.actions is not None]
    frames: dict[int, np.ndarray] = {}
    with torch.no_grad():
        if stepped:
            context = torch.from_numpy(np.stack([requests[i].context for i in stepped]))
            actions = torch.from_numpy(np.stack([requests[i].actions for i in stepped]))
            predicted = model.obs.predict(context, actions.long(), generator=generator)
            frames = dict(zip(stepped, predicted.cpu().numpy(), strict=True))
        judged = np.stack(
            [frames[i] if i in frames else r.context[-1] for i, r in enumerate(requests)]
        )
        ids = model.reward.tokenize([r.instruction for r in requests])
        probs, fails = (p.cpu().numpy() for p in model.reward.probs(torch.from_numpy(judged), ids))
    return [
        WMReply(frames.get(i), float(probs[i]), float(fails[i]), version)
        for i in range(len(requests))
    ]
