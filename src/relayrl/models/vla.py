"""A small vision-language-action policy: camera views and an instruction in, action tokens out.

Architecture, in the order data flows:

1. Instruction: lowercased words to ids (``tokenize``); the model owns this word-level tokenizer.
   Words of the built-in vocabulary (BabyAI's mission language and common manipulation words) get
   their own id, any other word one of ``hash_buckets`` ids by a stable hash, so new instructions
   never fail and never collide with the built-in words.
2. Image encoder: each view goes through a patch stem (a ``patch_size`` stride convolution; with
   minigrid's 8-pixel tiles and ``patch_size=8`` one patch is one grid cell) and ``conv_layers``
   residual 3x3 convolutions, each modulated by FiLM (per-channel scale and shift) from the mean of
   the instruction's word embeddings. Conditioning the pixels on the instruction early, with
   orthogonal init, is what made a GoTo agent learn in minutes where adding the instruction
   vector late did not learn at all. Each view yields its patch tokens plus one summary token, a
   linear map of the whole flattened feature map: where a patch sits is built into that token, so
   the action queries can use the target's position from the first update, before attention has
   learned where to look (with small position embeddings and uniform attention a query sees only
   the mean of the patches). With ``patch_tokens=False`` a view yields its summary token only:
   the sequence shrinks from ~60 tokens to ~8 and an update costs ~3.5x less on a CPU (BabyAI:
   37 ms instead of 129 ms for forward and backward of 256 samples on one thread), and the
   FiLM-conditioned summary alone is enough to learn BabyAI GoToLocal S7N4.
3. Backbone: a pre-norm transformer encoder over [instruction tokens, image patch and summary
   tokens of every view, D action queries].
4. Action head, slimmed to the action vocabulary: D learned action queries (one per action
   dimension) read the fused sequence through the backbone, and one shared linear layer maps each
   query's state to ``action_vocab`` logits. Queries rather than one linear head per dimension keep
   the head size independent of D (7 continuous dimensions x 256 bins cost one 256-way layer, not
   seven) and let each dimension attend to the patches it needs. Each dimension is one token with
   its own token-level log-prob, as the losses in ``relayrl.algorithms`` expect.
5. Critic, chosen by ``value_head``: ``ActionAwareValueHead`` (attention pooling over all
   backbone states, conditioned on the policy's action distribution and the episode step) or
   ``AcceValueHead`` (AcceRL's: softmax pooling of the action-token states plus a step
   embedding), detached by default.
"""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from relayrl.models.value_heads import AcceValueHead, ActionAwareValueHead

if TYPE_CHECKING:
    from relayrl.config import VLAModelConfig

PAD_ID = 0
# Built-in words get fixed ids 1..len(WORDS); every other word is hashed into the ids after them.
# One string per group reads better than sixty quoted words, hence the split.
WORDS = (  # noqa: SIM905
    # BabyAI mission grammar
    "go to the a an put next pick up open and then after you your object on left right in front "
    "of behind door ball box key red green blue purple yellow grey "
    # manipulation instructions (LIBERO, MetaWorld)
    "turn close push pull move place it into onto top bottom drawer cabinet bowl plate mug "
    "cup stove microwave basket button handle lid window shelf table white black"
).split()
_WORD_IDS = {word: i + 1 for i, word in enumerate(WORDS)}


def _action_aware_attention(cfg: VLAConfig) -> nn.Module:
    return ActionAwareValueHead(
        cfg.d_model,
        cfg.heads,
        cfg.action_dims,
        cfg.action_vocab,
        cfg.max_episode_steps,
        detach=cfg.detach_value,
    )


def _acce(cfg: VLAConfig) -> nn.Module:
    return AcceValueHead(
        cfg.d_model, cfg.action_dims, cfg.max_episode_steps, detach=cfg.detach_value
    )


# ``VLAConfig.value_head`` -> the critic head built for that config; every head is called as
# ``head(hidden, padding, action_logits, steps)``.
VALUE_HEADS = {"action_aware_attention": _action_aware_attention, "acce": _acce}


@dataclass
class VLAConfig:
    """Every size knob of ``VLAPolicy``; the defaults fit BabyAI on a CPU."""

    image_size: int = 56
    """Height and width of each view in pixels (square images)."""
    views: int = 1
    """Camera views per observation."""
    patch_size: int = 8
    """Stride and kernel of the patch stem; ``image_size`` must be a multiple of it."""
    channels: int = 32
    """Channels of the convolutional image encoder."""
    conv_layers: int = 2
    """FiLM-conditioned residual 3x3 convolutions after the patch stem."""
    patch_tokens: bool = True
    """Give the backbone every patch of every view; False gives it only each view's summary token,
    which cuts the backbone's sequence from ~60 tokens to ~8 (about 3x less compute per sample)."""
    d_model: int = 64
    """Width of the transformer backbone."""
    layers: int = 1
    """Transformer encoder layers."""
    heads: int = 4
    """Attention heads (backbone and value head); must divide ``d_model``."""
    ff_mult: int = 2
    """Feed-forward width as a multiple of ``d_model``."""
    instruction_tokens: int = 16
    """Most instruction words kept; longer instructions are truncated."""
    hash_buckets: int = 128
    """Ids for words outside the built-in vocabulary (stable crc32 hash)."""
    action_dims: int = 1
    """Action tokens per step, D (``ActionSpace.dims``)."""
    action_vocab: int = 3
    """Vocabulary of each action token (``ActionSpace.vocab``)."""
    max_episode_steps: int = 64
    """Largest distinct step index of the critic's step embedding; later steps share it."""
    detach_value: bool = True
    """Detach the backbone states and logits the critic reads, so the value loss trains only it."""
    value_head: str = "action_aware_attention"
    """Critic head, a key of ``VALUE_HEADS``; checkpoints saved before it existed get the default,
    the head they were trained with."""

    def __post_init__(self) -> None:
        for name in (f.name for f in fields(self) if f.type == "int" and f.name != "conv_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"VLAConfig.{name} must be a positive int, got {value!r}")
        if self.conv_layers < 0:
            raise ValueError(f"VLAConfig.conv_layers must be >= 0, got {self.conv_layers}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"VLAConfig.image_size={self.image_size} must be a multiple of "
                f"patch_size={self.patch_size}"
            )
        if self.d_model % self.heads:
            raise ValueError(f"VLAConfig.heads={self.heads} must divide d_model={self.d_model}")
        if self.value_head not in VALUE_HEADS:
            raise ValueError(
                f"VLAConfig.value_head must be one of {sorted(VALUE_HEADS)}, "
                f"got {self.value_head!r}"
            )

    @property
    def instruction_vocab(self) -> int:
        """Instruction ids: padding, the built-in words and the hash buckets."""
        return instruction_vocab(self.hash_buckets)


def vla_config(
    section: VLAModelConfig, *, image_size: int, views: int, dims: int, vocab: int
) -> VLAConfig:
    """The VLA policy's sizes: a run's ``vla`` section plus what the env decides (image size,
    views, action tokens)."""
    return VLAConfig(
        image_size=image_size,
        views=views,
        action_dims=dims,
        action_vocab=vocab,
        **section.model_dump(exclude={"path"}),
    )


class VLAPolicy(nn.Module):
    """Actor-critic over image views and an instruction, with token-level action log-probs."""

    def __init__(self, cfg: VLAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, c = cfg.d_model, cfg.channels
        grid = cfg.image_size // cfg.patch_size
        self.word_embedding = nn.Embedding(cfg.instruction_vocab, d, padding_idx=PAD_ID)
        self.word_position = nn.Parameter(torch.zeros(cfg.instruction_tokens, d))
        self.stem = nn.Conv2d(3, c, cfg.patch_size, stride=cfg.patch_size)
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(cfg.conv_layers))
        self.films = nn.ModuleList(nn.Linear(d, 2 * c) for _ in range(cfg.conv_layers))
        if cfg.patch_tokens:
            self.patch_proj = nn.Linear(c, d)
            self.patch_position = nn.Parameter(torch.zeros(cfg.views * grid * grid, d))
        self.summary = nn.Linear(grid * grid * c, d)
        self.summary_position = nn.Parameter(torch.zeros(cfg.views, d))
        self.action_queries = nn.Parameter(torch.zeros(cfg.action_dims, d))
        layer = nn.TransformerEncoderLayer(
            d, cfg.heads, cfg.ff_mult * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.backbone = nn.TransformerEncoder(
            layer, cfg.layers, norm=nn.LayerNorm(d), enable_nested_tensor=False
        )
        self.action_head = nn.Linear(d, cfg.action_vocab)
        self.value_head = VALUE_HEADS[cfg.value_head](cfg)
        self._init_weights()

    def _init_weights(self) -> None:
        """Orthogonal init (gain sqrt 2 before ReLUs) and a near-uniform initial policy."""
        patch = [self.patch_proj] if self.cfg.patch_tokens else []
        for module in [self.stem, *self.convs, *patch, self.summary]:
            nn.init.orthogonal_(module.weight, gain=math.sqrt(2))
            nn.init.zeros_(module.bias)
        for film in self.films:
            nn.init.orthogonal_(film.weight)
            nn.init.zeros_(film.bias)
        for module in self.backbone.modules():
            if isinstance(module, nn.Linear):
                nn.init.orthogonal_(module.weight)
                nn.init.zeros_(module.bias)
        patch = [self.patch_position] if self.cfg.patch_tokens else []
        positions = (self.word_position, *patch, self.summary_position)
        for param in (*positions, self.action_queries):
            nn.init.normal_(param, std=1.0)
        nn.init.orthogonal_(self.action_head.weight, gain=0.01)
        nn.init.zeros_(self.action_head.bias)

    def tokenize(self, instructions: list[str]) -> Tensor:
        """Instructions to word ids int64 [B, S], right-padded with 0 to the longest (at most
        ``instruction_tokens``; longer ones are truncated)."""
        ids = tokenize_instructions(
            instructions,
            hash_buckets=self.cfg.hash_buckets,
            max_tokens=self.cfg.instruction_tokens,
        )
        return ids.to(self.action_queries.device)

    def forward(
        self, images: Tensor, instruction_ids: Tensor, steps: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Action logits [B, D, vocab] and values [B] from images uint8 [B, V, H, W, 3],
        instruction ids int64 [B, S] (from ``tokenize``) and episode steps int [B]."""
        self._check_inputs(images, instruction_ids, steps)
        batch = images.shape[0]
        pad = instruction_ids == PAD_ID
        words = self.word_embedding(instruction_ids)
        keep = (~pad).unsqueeze(-1).float()
        mission = (words * keep).sum(1) / keep.sum(1).clamp(min=1)
        patches = self._encode_images(images, mission)
        queries = self.action_queries.expand(batch, -1, -1)
        words = words + self.word_position[: words.shape[1]]
        tokens = torch.cat([words, patches, queries], dim=1)
        padding = torch.cat([pad, pad.new_zeros(batch, patches.shape[1] + queries.shape[1])], 1)
        hidden = self.backbone(tokens, src_key_padding_mask=padding)
        logits = self.action_head(hidden[:, -self.cfg.action_dims :])
        values = self.value_head(hidden, padding, logits, steps)
        return logits, values

    @torch.no_grad()
    def act(
        self,
        images: Tensor,
        instructions: list[str],
        steps: Tensor,
        *,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Sampled (from ``generator``; or greedy) actions int64 [B, D], their token log-probs
        float32 [B, D] and values float32 [B]."""
        logits, values = self(images, self.tokenize(instructions), steps)
        logp_all = logits.float().log_softmax(-1)
        if greedy:
            actions = logp_all.argmax(-1)
        else:
            probs = logp_all.exp().flatten(0, 1)
            actions = torch.multinomial(probs, 1, generator=generator).view(logp_all.shape[:2])
        logprobs = logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return actions, logprobs, values.float()

    def evaluate_actions(
        self, images: Tensor, instruction_ids: Tensor, steps: Tensor, actions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """For the trainer, with gradients: log-probs [B, D] of ``actions`` int64 [B, D], the
        entropy [B, D] of each dimension's distribution and values [B]."""
        expected = (images.shape[0], self.cfg.action_dims)
        if actions.shape != expected:
            raise ValueError(f"actions must have shape {expected}, got {tuple(actions.shape)}")
        logits, values = self(images, instruction_ids, steps)
        logp_all = logits.log_softmax(-1)
        logprobs = logp_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logprobs, entropy, values

    def _encode_images(self, images: Tensor, mission: Tensor) -> Tensor:
        """Image tokens [B, V * (g * g + 1), d] (the patches of every view, then one summary token
        per view; without ``patch_tokens`` only the V summary tokens) from images uint8
        [B, V, H, W, 3] and the instruction summary [B, d] that modulates every convolution."""
        batch, views = images.shape[:2]
        x = images.flatten(0, 1).permute(0, 3, 1, 2).float() / 255.0
        x = torch.relu(self.stem(x))
        for conv, film in zip(self.convs, self.films, strict=True):
            scale, shift = film(mission).repeat_interleave(views, 0).chunk(2, dim=-1)
            h = conv(x) * (1 + scale[..., None, None]) + shift[..., None, None]
            x = x + torch.relu(h)
        summary = torch.relu(self.summary(x.flatten(1))).view(batch, views, -1)
        summary = summary + self.summary_position
        if not self.cfg.patch_tokens:
            return summary
        patches = x.flatten(2).transpose(1, 2).reshape(batch, -1, x.shape[1])
        patches = self.patch_proj(patches) + self.patch_position
        return torch.cat([patches, summary], dim=1)

    def _check_inputs(self, images: Tensor, instruction_ids: Tensor, steps: Tensor) -> None:
        """Raise a ValueError naming the argument when an input has the wrong shape or dtype."""
        cfg = self.cfg
        shape = (cfg.views, cfg.image_size, cfg.image_size, 3)
        if images.dtype != torch.uint8 or images.dim() != 5 or tuple(images.shape[1:]) != shape:
            raise ValueError(
                f"images must be uint8 [B, {', '.join(map(str, shape))}], got "
                f"{images.dtype} {list(images.shape)}"
            )
        batch = images.shape[0]
        if instruction_ids.dim() != 2 or instruction_ids.shape[0] != batch:
            raise ValueError(
                f"instruction_ids must be [B={batch}, S], got {list(instruction_ids.shape)}"
            )
        if instruction_ids.shape[1] > cfg.instruction_tokens:
            raise ValueError(
                f"instruction_ids has {instruction_ids.shape[1]} tokens, more than "
                f"instruction_tokens={cfg.instruction_tokens}"
            )
        if tuple(steps.shape) != (batch,):
            raise ValueError(f"steps must have shape [B={batch}], got {list(steps.shape)}")


def save_vla_checkpoint(
    path: str | Path, state: dict[str, Tensor], cfg: VLAConfig, version: int
) -> Path:
    """Write ``model.safetensors`` (``state``, tagged with ``version``) and ``vla_config.json``
    into the folder ``path``: what ``saved_vla_config`` and ``load_vla_weights`` read back."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"version": str(version)})
    (out / "vla_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    return out


def saved_vla_config(path: str | Path) -> VLAConfig:
    """The ``VLAConfig`` of the saved policy in the folder ``path`` (``vla_config.json`` and
    ``model.safetensors``, as an embodied run's ``RUN_DIR/checkpoint`` holds them); raises
    ``FileNotFoundError`` naming what is missing."""
    folder = require_files(
        path,
        ("vla_config.json", "model.safetensors"),
        "a saved VLA policy",
        "an embodied run's RUN_DIR/checkpoint holds both",
    )
    return VLAConfig(**json.loads((folder / "vla_config.json").read_text()))


def require_files(path: str | Path, names: tuple[str, ...], what: str, hint: str) -> Path:
    """The folder ``path``; ``FileNotFoundError`` naming which of ``names`` it lacks to be
    ``what``, with ``hint`` on where such a folder comes from."""
    folder = Path(path)
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not {what}: {' and '.join(missing)} missing ({hint})")
    return folder


def vla_mismatch(saved: VLAConfig, wanted: VLAConfig) -> list[str]:
    """``field=saved (wanted)`` for every size in which ``saved`` differs from ``wanted``."""
    mine, theirs = asdict(wanted), asdict(saved)
    return [f"{k}={theirs[k]!r} (this run: {v!r})" for k, v in mine.items() if theirs[k] != v]


def load_vla_weights(path: str | Path, wanted: VLAConfig) -> dict[str, Tensor]:
    """The state dict of the saved policy in the folder ``path``; raises ``ValueError`` naming
    every size in which it differs from ``wanted``."""
    differ = vla_mismatch(saved_vla_config(path), wanted)
    if differ:
        raise ValueError(f"the VLA policy saved in {path} has other sizes: {', '.join(differ)}")
    return load_file(str(Path(path) / "model.safetensors"))


def tokenize_instructions(instructions: list[str], *, hash_buckets: int, max_tokens: int) -> Tensor:
    """Instructions to word ids int64 [B, S], right-padded with ``PAD_ID`` to the longest (at most
    ``max_tokens``; longer ones are truncated): the ids every instruction-reading model shares."""
    if isinstance(instructions, str):
        raise TypeError("instructions must be a list of strings, got a single str")
    rows = [_instruction_ids(s, hash_buckets, max_tokens) for s in instructions]
    width = max(max((len(row) for row in rows), default=0), 1)
    return torch.tensor([row + (PAD_ID,) * (width - len(row)) for row in rows], dtype=torch.int64)


@functools.lru_cache(maxsize=4096)
def _instruction_ids(text: str, hash_buckets: int, max_tokens: int) -> tuple[int, ...]:
    """One instruction's word ids, truncated to ``max_tokens`` (cached: a task suite repeats a
    few instructions, which a batch of 1,024 steps would otherwise tokenize one by one)."""
    return tuple(_word_id(w, hash_buckets) for w in _words(text))[:max_tokens]


def instruction_vocab(hash_buckets: int) -> int:
    """Instruction ids: padding, the built-in words and ``hash_buckets`` hash buckets."""
    return 1 + len(_WORD_IDS) + hash_buckets


def _words(text: str) -> list[str]:
    """Lowercased alphanumeric words of ``text``."""
    return re.findall(r"[a-z0-9]+", text.lower())


def _word_id(word: str, hash_buckets: int) -> int:
    """The id of a built-in word, or a stable hash bucket after the built-in ids."""
    known = _WORD_IDS.get(word)
    if known is not None:
        return known
    return 1 + len(_WORD_IDS) + zlib.crc32(word.encode()) % hash_buckets
