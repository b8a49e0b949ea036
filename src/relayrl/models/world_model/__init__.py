"""The world model: an observation model M_obs (the next frame from the last K frames and
actions) and a reward model M_reward (the success probability of a frame given the instruction),
both in pixel space, so they know nothing of the policy. See docs/world_model.md.

Observation backends are chosen by name from ``OBS_BACKENDS``; a new backend is one subclass of
``ObservationModel`` added to that dict. A saved model is a Hugging Face style folder:
``model.safetensors`` (the ``state_dict``, with the weight version in its metadata) and
``config.json`` (the config dataclass, plus which model it is)::

    model = build_obs_model(ObsModelConfig(backend="deterministic", image_size=56))
    save_pretrained(model, "wm/observation", version=3)
    model = load_pretrained("wm/observation")
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from relayrl.models.vla import require_files
from relayrl.models.world_model.base import ObservationModel, ObsModelConfig, Transitions
from relayrl.models.world_model.deterministic import DeterministicObsModel
from relayrl.models.world_model.diffusion import DiffusionObsModel
from relayrl.models.world_model.imagine import (
    PAD_ACTION,
    Imagined,
    Policy,
    context_window,
    imagine,
    start_context,
)
from relayrl.models.world_model.reward_model import SuccessLabels, SuccessModel, SuccessModelConfig
from relayrl.models.world_model.rewards import imagined_reward, imagined_termination

if TYPE_CHECKING:
    from relayrl.config import WorldModelConfig

OBS_BACKENDS: dict[str, type[ObservationModel]] = {
    "deterministic": DeterministicObsModel,
    "diffusion": DiffusionObsModel,
}


def build_obs_model(cfg: ObsModelConfig) -> ObservationModel:
    """A fresh observation model of the backend ``cfg.backend`` names."""
    if cfg.backend not in OBS_BACKENDS:
        raise ValueError(
            f"unknown observation backend {cfg.backend!r}; allowed: {', '.join(OBS_BACKENDS)}"
        )
    return OBS_BACKENDS[cfg.backend](cfg)


def world_model_configs(
    section: WorldModelConfig,
    *,
    image_size: int,
    instruction_tokens: int,
    views: int,
    dims: int,
    vocab: int,
) -> tuple[ObsModelConfig, SuccessModelConfig]:
    """The world model's sizes: a run's ``world_model`` section plus what the env decides (image
    size, views, action tokens) and the policy's instruction length, so both models read what the
    policy reads."""
    shared = {
        k: v for k, v in section.model_dump().items() if k in ObsModelConfig.__dataclass_fields__
    }
    obs = ObsModelConfig(
        image_size=image_size, views=views, action_dims=dims, action_vocab=vocab, **shared
    )
    reward = SuccessModelConfig(
        image_size=image_size,
        views=views,
        channels=section.channels,
        hidden=section.reward_hidden,
        instruction_tokens=instruction_tokens,
        failure_head=section.failure_head,
    )
    return obs, reward


def save_pretrained(
    model: ObservationModel | SuccessModel, path: str | Path, *, version: int = 0
) -> Path:
    """Write ``model`` to the folder ``path`` (``model.safetensors`` with ``version`` in its
    metadata, and ``config.json``); returns the folder."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    kind = "success" if isinstance(model, SuccessModel) else "observation"
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"version": str(version)})
    config = {"model": kind, **asdict(model.cfg)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_pretrained(path: str | Path) -> ObservationModel | SuccessModel:
    """The model ``save_pretrained`` wrote to the folder ``path``, on the CPU."""
    folder = Path(path)
    config = json.loads((folder / "config.json").read_text())
    kind = config.pop("model")
    if kind == "success":
        model: ObservationModel | SuccessModel = SuccessModel(SuccessModelConfig(**config))
    else:
        model = build_obs_model(ObsModelConfig(**config))
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model


def pretrained_mismatch(path: str | Path, wanted: ObsModelConfig | SuccessModelConfig) -> list[str]:
    """``field=saved (this run: wanted)`` for every config field in which the model saved in the
    folder ``path`` differs from ``wanted``, if its weights do not fit a model of ``wanted``
    (settings that leave every weight's shape alone, such as sampling steps, may differ); raises
    ``FileNotFoundError`` naming what is missing."""
    folder = require_files(
        path,
        ("config.json", "model.safetensors"),
        "a saved world model part",
        "relayrl wm pretrain writes both",
    )
    saved = json.loads((folder / "config.json").read_text())
    saved.pop("model", None)
    fresh = (
        SuccessModel(wanted) if isinstance(wanted, SuccessModelConfig) else build_obs_model(wanted)
    )
    shapes = {k: list(v.shape) for k, v in fresh.state_dict().items()}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    if stored == shapes:
        return []
    differ = [
        f"{k}={saved.get(k)!r} (this run: {v!r})"
        for k, v in asdict(wanted).items()
        if saved.get(k) != v
    ]
    return differ or ["the weights' shapes (the saved config.json does not say why)"]


def saved_version(path: str | Path) -> int:
    """The weight version ``save_pretrained`` recorded in the folder ``path``."""
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return int(f.metadata()["version"])


__all__ = [
    "OBS_BACKENDS",
    "PAD_ACTION",
    "Imagined",
    "ObsModelConfig",
    "ObservationModel",
    "Policy",
    "SuccessLabels",
    "SuccessModel",
    "SuccessModelConfig",
    "Transitions",
    "build_obs_model",
    "context_window",
    "imagine",
    "imagined_reward",
    "imagined_termination",
    "load_pretrained",
    "pretrained_mismatch",
    "save_pretrained",
    "saved_version",
    "start_context",
    "world_model_configs",
]
