"""Losses and advantages: pure tensor functions, picked by name from ``LOSSES``/``ADVANTAGES``."""

from relayrl.algorithms.advantages import (
    ADVANTAGES,
    dr_grpo_advantages,
    frac_zero_signal_groups,
    grpo_advantages,
)
from relayrl.algorithms.losses import (
    LOSSES,
    aipo_clamp_loss,
    aipo_loss,
    masked_mean,
    ppo_clip_loss,
)

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "aipo_clamp_loss",
    "aipo_loss",
    "dr_grpo_advantages",
    "frac_zero_signal_groups",
    "grpo_advantages",
    "masked_mean",
    "ppo_clip_loss",
]
