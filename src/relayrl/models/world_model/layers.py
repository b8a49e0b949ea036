"""Building blocks the observation backends share: a small conditioned U-Net, the action
embedding, and sinusoidal embeddings of scalars (noise levels)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relayrl.models.world_model.base import ObsModelConfig


def _groups(channels: int) -> int:
    """The most GroupNorm groups, up to 8, that divide ``channels``."""
    return next(g for g in (8, 4, 2, 1) if channels % g == 0)


class AdaGroupNorm(nn.Module):
    """GroupNorm whose per-channel scale and shift come from a conditioning vector (as DIAMOND
    conditions its U-Net on the actions and the noise level)."""

    def __init__(self, channels: int, cond_dim: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(_groups(channels), channels, affine=False)
        self.proj = nn.Linear(cond_dim, 2 * channels)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        """``x`` [B, C, H, W] normalised, then scaled and shifted by ``cond`` [B, cond_dim]."""
        scale, shift = self.proj(cond)[..., None, None].chunk(2, dim=1)
        return self.norm(x) * (1 + scale) + shift


class ResBlock(nn.Module):
    """Two conditioned 3x3 convolutions with a residual connection; starts as the identity."""

    def __init__(self, in_channels: int, out_channels: int, cond_dim: int) -> None:
        super().__init__()
        self.norm1 = AdaGroupNorm(in_channels, cond_dim)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = AdaGroupNorm(out_channels, cond_dim)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)
        self.skip = (
            nn.Identity()
            if in_channels == out_channels
            else nn.Conv2d(in_channels, out_channels, 1)
        )

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        """[B, in, H, W] and [B, cond_dim] to [B, out, H, W]."""
        h = self.conv1(F.silu(self.norm1(x, cond)))
        h = self.conv2(F.silu(self.norm2(h, cond)))
        return self.skip(x) + h


class UNet(nn.Module):
    """A U-Net of ``levels`` stride-2 down-samplings, ``channels`` wide at every resolution,
    each block modulated by a conditioning vector; the output layer starts at zero."""

    def __init__(
        self, in_channels: int, out_channels: int, channels: int, levels: int, cond_dim: int
    ) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, channels, 3, padding=1)
        self.down_blocks = nn.ModuleList(
            ResBlock(channels, channels, cond_dim) for _ in range(levels)
        )
        self.downs = nn.ModuleList(
            nn.Conv2d(channels, channels, 3, stride=2, padding=1) for _ in range(levels)
        )
        self.middle = ResBlock(channels, channels, cond_dim)
        self.up_blocks = nn.ModuleList(
            ResBlock(2 * channels, channels, cond_dim) for _ in range(levels)
        )
        self.out_norm = nn.GroupNorm(_groups(channels), channels)
        self.out = nn.Conv2d(channels, out_channels, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        """[B, in, H, W] and [B, cond_dim] to [B, out, H, W]."""
        h = self.stem(x)
        skips = []
        for block, down in zip(self.down_blocks, self.downs, strict=True):
            h = block(h, cond)
            skips.append(h)
            h = down(h)
        h = self.middle(h, cond)
        for block in self.up_blocks:
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
            h = block(torch.cat([h, skips.pop()], dim=1), cond)
        return self.out(F.silu(self.out_norm(h)))


class ActionEmbedding(nn.Module):
    """The K context actions [B, K, D] (tokens or continuous values) to one vector [B, out]."""

    def __init__(self, cfg: ObsModelConfig, out_dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        dims = cfg.action_dims
        if cfg.continuous_actions:
            self.embed: nn.Module = nn.Linear(dims, out_dim)
        else:
            # One table for all dimensions; dimension d's tokens start at d * vocab.
            self.embed = nn.Embedding(dims * cfg.action_vocab, out_dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.context_frames * out_dim, out_dim), nn.SiLU(), nn.Linear(out_dim, out_dim)
        )

    def forward(self, actions: Tensor) -> Tensor:
        """int64 tokens (or float32 values) [B, K, D] to [B, out]."""
        if self.cfg.continuous_actions:
            per_step = self.embed(actions)
        else:
            offsets = torch.arange(self.cfg.action_dims, device=actions.device)
            per_step = self.embed(actions + offsets * self.cfg.action_vocab).sum(dim=2)
        return self.mlp(per_step.flatten(1))


def sinusoidal(values: Tensor, dim: int) -> Tensor:
    """Scalars [B] to [B, dim] sines and cosines at frequencies from 1 to 1000 (the transformer's
    position code, for noise levels)."""
    freqs = torch.exp(torch.linspace(0, math.log(1000.0), dim // 2, device=values.device))
    angles = values.float()[:, None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)
