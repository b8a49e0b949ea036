"""M_reward: the probability that a frame shows the instruction achieved and, with the failure
head, the probability that it ends the episode unsuccessfully.

A small convolutional classifier. The instruction is read as the policy reads it (the word ids
of ``relayrl.models.vla.tokenize_instructions``), averaged into one vector that modulates every
convolution (FiLM, as the policy's encoder does: conditioning the pixels on the instruction early
is what lets one frame be a success for one instruction and a failure for another). The final
feature map is flattened, so where things are in the frame reaches the output directly.

The failure head is a second logit of the same classifier: a failure frame is the last frame of an
episode the env ended without success (BabyAI's ``env.distractor_fails``, a robot dropping the
object). Imagined episodes end on it as real ones do; without it every imagined episode that does
not succeed runs to the step cap, so imagination overrates a policy that fails early.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relayrl.models.vla import PAD_ID, instruction_vocab, tokenize_instructions
from relayrl.models.world_model.base import to_unit


@dataclass
class SuccessModelConfig:
    """Every size knob of ``SuccessModel``."""

    image_size: int = 56
    """Height and width of each view in pixels; must be a multiple of 4."""
    views: int = 1
    """Camera views per frame."""
    channels: int = 32
    """Channels of the two stride-2 convolutions."""
    hidden: int = 64
    """Width of the instruction embedding and of the classifier's hidden layer."""
    instruction_tokens: int = 16
    """Most instruction words kept (as the policy's ``VLAConfig.instruction_tokens``)."""
    hash_buckets: int = 128
    """Ids for words outside the built-in vocabulary (as the policy's)."""
    failure_head: bool = False
    """A second output: the probability that the frame ends the episode unsuccessfully."""

    def __post_init__(self) -> None:
        if not isinstance(self.failure_head, bool):
            raise ValueError(
                f"SuccessModelConfig.failure_head must be a bool, got {self.failure_head!r}"
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "failure_head":
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"SuccessModelConfig.{f.name} must be a positive int, got {value!r}"
                )
        if self.image_size % 4:
            raise ValueError(
                f"SuccessModelConfig.image_size={self.image_size} must be a multiple of 4"
            )


@dataclass
class SuccessLabels:
    """A batch of labelled frames for ``SuccessModel.loss``."""

    frames: Tensor  # uint8 or float in [0, 1], [B, V, H, W, 3]
    instruction_ids: Tensor  # int64 [B, S], from ``SuccessModel.tokenize``
    success: Tensor  # bool or float in {0, 1}, [B]
    failure: Tensor | None = None  # bool [B]: the frame ends its episode unsuccessfully


class SuccessModel(nn.Module):
    """M_reward: success (and, with the failure head, failure) logits of frames given
    instructions."""

    def __init__(self, cfg: SuccessModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c, h = cfg.channels, cfg.hidden
        self.word_embedding = nn.Embedding(instruction_vocab(cfg.hash_buckets), h, PAD_ID)
        self.convs = nn.ModuleList(
            [nn.Conv2d(3 * cfg.views, c, 4, stride=2, padding=1), nn.Conv2d(c, c, 4, 2, 1)]
        )
        self.films = nn.ModuleList(nn.Linear(h, 2 * c) for _ in self.convs)
        for film in self.films:
            nn.init.zeros_(film.weight)
            nn.init.zeros_(film.bias)
        self.hidden = nn.Linear(c * (cfg.image_size // 4) ** 2, h)
        self.out = nn.Linear(h, 1 + cfg.failure_head)

    def tokenize(self, instructions: list[str]) -> Tensor:
        """Instructions to word ids int64 [B, S], as the policy tokenizes them."""
        ids = tokenize_instructions(
            instructions,
            hash_buckets=self.cfg.hash_buckets,
            max_tokens=self.cfg.instruction_tokens,
        )
        return ids.to(self.out.weight.device)

    def forward(self, frames: Tensor, instruction_ids: Tensor) -> Tensor:
        """Success logits [B] of ``frames`` [B, V, H, W, 3] (uint8, or float in [0, 1]) given
        ``instruction_ids`` int64 [B, S]."""
        return self.logits(frames, instruction_ids)[:, 0]

    def logits(self, frames: Tensor, instruction_ids: Tensor) -> Tensor:
        """Logits [B, 1 + failure_head]: success, then failure with the failure head."""
        shape = (self.cfg.views, self.cfg.image_size, self.cfg.image_size, 3)
        if frames.dim() != 5 or tuple(frames.shape[1:]) != shape:
            raise ValueError(
                f"frames must be [B, {', '.join(map(str, shape))}], got {list(frames.shape)}"
            )
        if instruction_ids.dim() != 2 or instruction_ids.shape[0] != frames.shape[0]:
            raise ValueError(
                f"instruction_ids must be [B={frames.shape[0]}, S], got "
                f"{list(instruction_ids.shape)}"
            )
        device = self.out.weight.device
        ids = instruction_ids.to(device)
        keep = (ids != PAD_ID).unsqueeze(-1).float()
        mission = (self.word_embedding(ids) * keep).sum(1) / keep.sum(1).clamp(min=1)
        x = to_unit(frames.to(device)) * 2 - 1
        x = x.movedim(-1, -3).flatten(1, 2)  # [B, 3V, H, W]
        for conv, film in zip(self.convs, self.films, strict=True):
            scale, shift = film(mission)[..., None, None].chunk(2, dim=1)
            x = F.silu(conv(x) * (1 + scale) + shift)
        return self.out(F.silu(self.hidden(x.flatten(1))))

    @torch.no_grad()
    def success_prob(self, frames: Tensor, instruction_ids: Tensor) -> Tensor:
        """The probability [B] in [0, 1] that each frame shows its instruction achieved."""
        return torch.sigmoid(self(frames, instruction_ids).float())

    @torch.no_grad()
    def probs(self, frames: Tensor, instruction_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(success, failure) probabilities [B] each; failure is 0 without the failure head."""
        p = torch.sigmoid(self.logits(frames, instruction_ids).float())
        failure = p[:, 1] if self.cfg.failure_head else torch.zeros_like(p[:, 0])
        return p[:, 0], failure

    def loss(self, batch: SuccessLabels) -> Tensor:
        """Binary cross-entropy of the success logits against the labels, plus that of the
        failure logits with the failure head (which needs ``batch.failure``)."""
        logits = self.logits(batch.frames, batch.instruction_ids)
        loss = F.binary_cross_entropy_with_logits(logits[:, 0], batch.success.to(logits).float())
        if not self.cfg.failure_head:
            return loss
        if batch.failure is None:
            raise ValueError("a reward model with the failure head needs SuccessLabels.failure")
        return loss + F.binary_cross_entropy_with_logits(
            logits[:, 1], batch.failure.to(logits).float()
        )
