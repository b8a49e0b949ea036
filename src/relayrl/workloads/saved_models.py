"""Before an embodied run places its roles: a model it starts from (``vla.path``,
``world_model.path``) must have the sizes this run's settings give, or the run is refused in one
line naming the field, before any executor loads it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from relayrl.config import ConfigError
from relayrl.models.vla import VLAConfig, saved_vla_config, vla_mismatch
from relayrl.models.world_model import ObsModelConfig, SuccessModelConfig, pretrained_mismatch


def check_saved_vla(path: str, wanted: VLAConfig) -> None:
    """Raise ``ConfigError`` unless ``vla.path`` holds a saved policy of ``wanted``'s sizes."""
    _refuse_mismatch(
        "vla.path",
        path,
        "the saved policy",
        "vla and env",
        lambda: vla_mismatch(saved_vla_config(path), wanted),
    )


def check_saved_world_model(path: str, obs: ObsModelConfig, reward: SuccessModelConfig) -> None:
    """Raise ``ConfigError`` unless ``world_model.path`` holds models whose weights fit this
    run's ``obs`` and ``reward`` configs."""
    for part, wanted in (("observation", obs), ("reward", reward)):
        found = functools.partial(pretrained_mismatch, Path(path) / part, wanted)
        _refuse_mismatch("world_model.path", path, f"{part}/", "world_model and env", found)


def _refuse_mismatch(
    field: str, path: str, what: str, settings: str, differ: Callable[[], list[str]]
) -> None:
    """``ConfigError`` naming ``field`` if ``differ()`` fails or lists sizes of the model saved
    at ``path`` that differ from the run's ``settings``."""
    try:
        found = differ()
    except (FileNotFoundError, TypeError, ValueError) as err:
        raise ConfigError(f"{field}={path!r}: {err}") from err
    if found:
        raise ConfigError(
            f"{field}={path!r}: {what} has other sizes than this run's {settings} settings: "
            f"{', '.join(found)}"
        )
