"""The ``deterministic`` backend: a conditioned conv encoder-decoder regresses the next frame.

The U-Net sees the K context frames stacked on channels, is modulated by the embedded actions,
and predicts the change from the last frame (so it starts as "copy the last frame"); the loss is
the mean squared error in model space. One forward pass per prediction: cheap, and blurry where
the future is uncertain (it predicts the mean of the possible next frames).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relayrl.models.world_model.base import ObservationModel, ObsModelConfig
from relayrl.models.world_model.layers import ActionEmbedding, UNet


class DeterministicObsModel(ObservationModel):
    """M_obs as one regression pass of a conditioned U-Net."""

    def __init__(self, cfg: ObsModelConfig) -> None:
        super().__init__(cfg)
        c = cfg.frame_channels
        self.actions = ActionEmbedding(cfg, cfg.cond_dim)
        self.net = UNet(cfg.context_frames * c, c, cfg.channels, cfg.levels, cfg.cond_dim)

    def _forward(self, context: Tensor, actions: Tensor) -> Tensor:
        """The unclamped next frame [B, C, H, W] from model-space context [B, K, C, H, W]."""
        return context[:, -1] + self.net(context.flatten(1, 2), self.actions(actions))

    def model_loss(self, context: Tensor, actions: Tensor, target: Tensor) -> Tensor:
        """Mean squared error of the predicted next frame."""
        return F.mse_loss(self._forward(context, actions), target)

    def generate(
        self, context: Tensor, actions: Tensor, generator: torch.Generator | None
    ) -> Tensor:
        """The predicted next frame (``generator`` is unused: there is no sampling)."""
        return self._forward(context, actions).clamp(-1, 1)
