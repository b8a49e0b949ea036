"""The observation model's interface, M_obs: the next frame from the last K frames and actions.

Every backend is one subclass of ``ObservationModel`` that implements two methods in *model
space* (floats in [-1, 1], channels first, the views' RGB channels stacked):

- ``model_loss(context [B, K, C, H, W], actions [B, K, D], target [B, C, H, W]) -> scalar``
- ``generate(context [B, K, C, H, W], actions [B, K, D], generator) -> [B, C, H, W]``

with ``C = 3 * views``. The base class owns what callers see: pixel frames as the embodied env
gives them (``Observation.image``, uint8 [V, H, W, 3], stacked over K and batched), argument
checks that name the argument, and the conversion to and from model space. ``predict`` returns
the dtype it was given: uint8 frames in, uint8 frames out (what the policy reads), floats in
[0, 1] in, floats out.

Actions are what the policy emits: action tokens int64 [B, K, D] of ``action_vocab`` each (a
discrete space is one token; a continuous one is D binned tokens, ``ActionSpace``); with
``continuous_actions`` they are raw floats [B, K, D] instead. ``actions[:, -1]`` is the action
taken in the last context frame, the one that leads to the predicted frame.

All of a model's state is in its parameters (``state_dict``), so weight sync publishes it as it
does the policy's, and ``save_pretrained`` writes it as safetensors beside a ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn


@dataclass
class ObsModelConfig:
    """Every knob of an observation model; backends read the ones they need."""

    backend: str = "diffusion"
    """Key of ``OBS_BACKENDS`` that builds the model."""
    image_size: int = 56
    """Height and width of each view in pixels (square images)."""
    views: int = 1
    """Camera views per frame."""
    context_frames: int = 4
    """Past frames (and actions) the next frame is predicted from, K."""
    action_dims: int = 1
    """Action values per step, D (``ActionSpace.dims``)."""
    action_vocab: int = 3
    """Vocabulary of each action token (``ActionSpace.vocab``); unused with continuous actions."""
    continuous_actions: bool = False
    """Actions are floats [B, K, D] (raw controls) instead of int64 tokens."""
    channels: int = 32
    """Channels of the convolutional network, at every resolution."""
    levels: int = 2
    """Down-sampling levels of the U-Net; ``image_size`` must be a multiple of 2**levels."""
    cond_dim: int = 64
    """Width of the action (and noise-level) embedding that modulates every block."""
    denoising_steps: int = 3
    """diffusion: Euler steps from ``sigma_max`` to 0 when sampling."""
    sigma_data: float = 0.5
    """diffusion: standard deviation of the data in model space (EDM's sigma_data)."""
    sigma_min: float = 2e-3
    """diffusion: smallest noise level of training and sampling."""
    sigma_max: float = 5.0
    """diffusion: largest noise level, where sampling starts."""
    rho: float = 7.0
    """diffusion: curvature of Karras's sampling schedule."""
    train_sigma_loc: float = -0.4
    """diffusion: mean of log(sigma) when training (log-normal sigma, EDM's P_mean)."""
    train_sigma_scale: float = 1.2
    """diffusion: standard deviation of log(sigma) when training (EDM's P_std)."""
    context_noise: float = 0.3
    """diffusion: context frames get Gaussian noise of a level drawn uniformly from
    [0, context_noise] when training (none when sampling), so the model learns to correct its own
    errors in autoregressive rollouts; 0 turns it off."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"ObsModelConfig.{f.name} must be a positive int, got {value!r}")
        for name in ("sigma_data", "sigma_min", "sigma_max", "rho", "train_sigma_scale"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ObsModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.cond_dim % 2:
            raise ValueError(f"ObsModelConfig.cond_dim must be even, got {self.cond_dim}")
        if self.context_noise < 0:
            raise ValueError(f"ObsModelConfig.context_noise must be >= 0, got {self.context_noise}")
        if self.sigma_min >= self.sigma_max:
            raise ValueError(
                f"ObsModelConfig.sigma_min={self.sigma_min} must be < sigma_max={self.sigma_max}"
            )
        if self.image_size % 2**self.levels:
            raise ValueError(
                f"ObsModelConfig.image_size={self.image_size} must be a multiple of "
                f"2**levels={2**self.levels}"
            )

    @property
    def frame_channels(self) -> int:
        """Channels of one frame in model space: RGB of every view."""
        return 3 * self.views


@dataclass
class Transitions:
    """A batch of real transitions for ``ObservationModel.loss``."""

    context: Tensor  # uint8 or float in [0, 1], [B, K, V, H, W, 3]: frames o_{t-K+1} .. o_t
    actions: Tensor  # int64 tokens (or floats) [B, K, D]: a_{t-K+1} .. a_t
    next_frame: Tensor  # same dtype as context, [B, V, H, W, 3]: o_{t+1}


class ObservationModel(nn.Module):
    """M_obs: predicts the next frame from the last K frames and actions (see the module doc)."""

    def __init__(self, cfg: ObsModelConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def loss(self, batch: Transitions) -> Tensor:
        """The training loss (a scalar with gradients) on a batch of real transitions."""
        self._check(batch.context, batch.actions)
        expected = self._frame_shape()
        if tuple(batch.next_frame.shape) != (batch.context.shape[0], *expected):
            raise ValueError(
                f"next_frame must be [B, {', '.join(map(str, expected))}], got "
                f"{list(batch.next_frame.shape)}"
            )
        device = self._device()
        context = to_model_space(batch.context.to(device))
        target = to_model_space(batch.next_frame.to(device))
        return self.model_loss(context, self._actions(batch.actions), target)

    @torch.no_grad()
    def predict(
        self, context: Tensor, actions: Tensor, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """The next frame [B, V, H, W, 3] after ``context`` frames [B, K, V, H, W, 3] and
        ``actions`` [B, K, D], in the dtype of ``context`` (a sample, for a stochastic backend,
        drawn from ``generator``)."""
        self._check(context, actions)
        model_context = to_model_space(context.to(self._device()))
        out = self.generate(model_context, self._actions(actions), generator)
        return from_model_space(out, self.cfg.views, like=context)

    def model_loss(self, context: Tensor, actions: Tensor, target: Tensor) -> Tensor:
        """The backend's loss in model space (see the module doc)."""
        raise NotImplementedError

    def generate(
        self, context: Tensor, actions: Tensor, generator: torch.Generator | None
    ) -> Tensor:
        """The backend's next frame in model space (see the module doc)."""
        raise NotImplementedError

    def _frame_shape(self) -> tuple[int, ...]:
        return (self.cfg.views, self.cfg.image_size, self.cfg.image_size, 3)

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def _actions(self, actions: Tensor) -> Tensor:
        """Actions on the model's device: int64 tokens, or float32 continuous values."""
        dtype = torch.float32 if self.cfg.continuous_actions else torch.int64
        return actions.to(self._device(), dtype)

    def _check(self, context: Tensor, actions: Tensor) -> None:
        """Raise a ValueError naming the argument when an input has the wrong shape or dtype."""
        cfg = self.cfg
        shape = (cfg.context_frames, *self._frame_shape())
        if context.dim() != 6 or tuple(context.shape[1:]) != shape:
            raise ValueError(
                f"context must be [B, {', '.join(map(str, shape))}] (K frames of "
                f"[V, H, W, 3]), got {list(context.shape)}"
            )
        if context.dtype != torch.uint8 and not context.is_floating_point():
            raise ValueError(f"context must be uint8 or float in [0, 1], got {context.dtype}")
        batch = context.shape[0]
        expected = (batch, cfg.context_frames, cfg.action_dims)
        if tuple(actions.shape) != expected:
            raise ValueError(
                f"actions must be [B, K, D] = {list(expected)}, got {list(actions.shape)}"
            )
        if cfg.continuous_actions != actions.is_floating_point():
            kind = "float" if cfg.continuous_actions else "integer token"
            raise ValueError(f"actions must be {kind}s for this model, got {actions.dtype}")
        if not cfg.continuous_actions and (actions.min() < 0 or actions.max() >= cfg.action_vocab):
            raise ValueError(
                f"action tokens must be in [0, action_vocab={cfg.action_vocab}), got "
                f"[{int(actions.min())}, {int(actions.max())}]"
            )


def to_unit(frames: Tensor) -> Tensor:
    """Pixels as float32 in [0, 1]: uint8 divided by 255, floats as given."""
    if frames.dtype == torch.uint8:
        return frames.float() / 255.0
    return frames.float()


def to_model_space(frames: Tensor) -> Tensor:
    """Frames [..., V, H, W, 3] (uint8 or float in [0, 1]) to model space [..., 3V, H, W] in
    [-1, 1], each view's RGB channels next to each other."""
    x = to_unit(frames) * 2 - 1
    x = x.movedim(-1, -3)  # [..., V, 3, H, W]
    return x.flatten(-4, -3)


def from_model_space(x: Tensor, views: int, *, like: Tensor) -> Tensor:
    """Model-space frames [B, 3V, H, W] back to pixels [B, V, H, W, 3] in the dtype of ``like``:
    uint8 rounded, or float in [0, 1]."""
    unit = ((x.clamp(-1, 1) + 1) / 2).unflatten(1, (views, 3)).movedim(-3, -1)
    if like.dtype == torch.uint8:
        return (unit * 255).round().to(like.device, torch.uint8)
    return unit.to(like.device, like.dtype)
