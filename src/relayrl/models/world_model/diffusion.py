"""The ``diffusion`` backend: an EDM denoiser of the next frame, conditioned on the past, as in
DIAMOND (Alonso et al., 2024, "Diffusion for World Modeling"), with the preconditioning of EDM
(Karras et al., 2022, "Elucidating the Design Space of Diffusion-Based Generative Models").

Denoiser, for a noisy next frame ``x`` at noise level ``sigma``::

    D(x, sigma) = c_skip * x + c_out * F(c_in * x, c_noise, context, actions)
    c_skip = sigma_data^2 / (sigma^2 + sigma_data^2)
    c_out  = sigma * sigma_data / sqrt(sigma^2 + sigma_data^2)
    c_in   = 1 / sqrt(sigma^2 + sigma_data^2)
    c_noise = log(sigma) / 4

F is a U-Net over [c_in * x, context / sigma_data] stacked on channels, modulated by the embedded
actions and noise levels. Training draws ``log sigma ~ N(train_sigma_loc, train_sigma_scale^2)``
(clipped to [sigma_min, sigma_max]) and regresses F on ``(y - c_skip * x) / c_out`` for the clean
frame ``y``: EDM's loss weighting, as DIAMOND writes it. Sampling runs ``denoising_steps`` Euler
steps down Karras's schedule from ``sigma_max`` to 0 (DIAMOND uses 3).

Where we differ from DIAMOND: the context frames are noise-augmented in training (a level drawn
uniformly from [0, context_noise], given to F as a second embedded level; 0 when sampling), as
GameNGen does, instead of DIAMOND's training on its own denoised frames over a sequence; there is
no offset noise and no quantisation of intermediate samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relayrl.models.world_model.base import ObservationModel, ObsModelConfig
from relayrl.models.world_model.layers import ActionEmbedding, UNet, sinusoidal


def karras_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float) -> Tensor:
    """Karras's noise levels [steps + 1]: ``steps`` levels from ``sigma_max`` down to
    ``sigma_min``, evenly spaced in ``sigma^(1/rho)``, then a final 0."""
    ramp = torch.linspace(0, 1, steps) if steps > 1 else torch.zeros(1)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    sigmas = (hi + ramp * (lo - hi)) ** rho
    return torch.cat([sigmas, torch.zeros(1)])


def preconditioning(sigma: Tensor, sigma_data: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """EDM's (c_in, c_skip, c_out, c_noise) for noise levels ``sigma`` [B], each [B, 1, 1, 1]
    (the formulas are in the module doc)."""
    s = sigma[:, None, None, None]
    total = s**2 + sigma_data**2
    return 1 / total.sqrt(), sigma_data**2 / total, s * sigma_data / total.sqrt(), s.log() / 4


class DiffusionObsModel(ObservationModel):
    """M_obs as an EDM-preconditioned denoiser sampled in a few Euler steps."""

    def __init__(self, cfg: ObsModelConfig) -> None:
        super().__init__(cfg)
        c, d = cfg.frame_channels, cfg.cond_dim
        self.actions = ActionEmbedding(cfg, d)
        self.noise_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.context_noise_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.net = UNet((cfg.context_frames + 1) * c, c, cfg.channels, cfg.levels, d)

    def denoise(
        self, noisy: Tensor, sigma: Tensor, context: Tensor, context_sigma: Tensor, actions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """F's raw output and the denoised frame D(x, sigma), both [B, C, H, W], for ``noisy``
        frames at levels ``sigma`` [B] given ``context`` [B, K, C, H, W] noised to
        ``context_sigma`` [B]."""
        c_in, c_skip, c_out, c_noise = preconditioning(sigma, self.cfg.sigma_data)
        d = self.cfg.cond_dim
        cond = (
            self.actions(actions)
            + self.noise_mlp(sinusoidal(c_noise.flatten(), d))
            + self.context_noise_mlp(sinusoidal(context_sigma, d))
        )
        x = torch.cat([c_in * noisy, context.flatten(1, 2) / self.cfg.sigma_data], dim=1)
        raw = self.net(x, cond)
        return raw, c_skip * noisy + c_out * raw

    def model_loss(self, context: Tensor, actions: Tensor, target: Tensor) -> Tensor:
        """EDM's denoising loss at one log-normal noise level per sample."""
        cfg = self.cfg
        batch = target.shape[0]
        log_sigma = cfg.train_sigma_loc + cfg.train_sigma_scale * torch.randn(
            batch, device=target.device
        )
        sigma = log_sigma.exp().clamp(cfg.sigma_min, cfg.sigma_max)
        noisy = target + sigma[:, None, None, None] * torch.randn_like(target)
        context_sigma = cfg.context_noise * torch.rand(batch, device=target.device)
        context = context + context_sigma[:, None, None, None, None] * torch.randn_like(context)
        raw, _ = self.denoise(noisy, sigma, context, context_sigma, actions)
        _, c_skip, c_out, _ = preconditioning(sigma, cfg.sigma_data)
        return F.mse_loss(raw, (target - c_skip * noisy) / c_out)

    def generate(
        self, context: Tensor, actions: Tensor, generator: torch.Generator | None
    ) -> Tensor:
        """A next frame sampled by Euler steps down Karras's schedule, from noise drawn from
        ``generator``."""
        cfg = self.cfg
        batch, _, c, h, w = context.shape
        sigmas = karras_sigmas(cfg.denoising_steps, cfg.sigma_min, cfg.sigma_max, cfg.rho)
        sigmas = sigmas.to(context.device)
        noise = torch.randn(
            batch, c, h, w, generator=generator, device=_generator_device(generator)
        )
        x = noise.to(context.device) * sigmas[0]
        clean = torch.zeros(batch, device=context.device)
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:], strict=True):
            _, denoised = self.denoise(x, sigma.expand(batch), context, clean, actions)
            x = x + (x - denoised) / sigma * (sigma_next - sigma)
        return x.clamp(-1, 1)


def _generator_device(generator: torch.Generator | None) -> torch.device:
    """The device a generator draws on (the CPU when there is none)."""
    return generator.device if generator is not None else torch.device("cpu")
