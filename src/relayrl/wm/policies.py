"""The policies ``relayrl wm`` plays: a uniform random one, a noisy scripted BabyAI demonstrator
(collection only: it reads the simulator's state), and a saved VLA policy checkpoint.

Two shapes: ``EpisodePolicy`` plays one real env episode by episode (collection and the real-env
arm of evaluation); a batched ``relayrl.models.world_model.Policy`` (frames, instructions, steps
-> action tokens) is what imagination calls. ``RandomPolicy`` and ``CheckpointPolicy`` are both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from relayrl.envs.embodied import ActionSpace, EmbodiedEnv, Observation
from relayrl.models.vla import VLAPolicy, load_vla_weights, saved_vla_config

POLICY_NAMES = ("random", "noisy_scripted")
"""The built-in policy names; anything else is read as the folder of a VLA checkpoint."""


class EpisodePolicy(Protocol):
    """Plays a real env: ``reset`` when an episode begins, then ``act`` on each observation."""

    def reset(self, env: EmbodiedEnv) -> None:
        """An episode of ``env`` has just been reset."""
        ...

    def act(self, obs: Observation) -> np.ndarray:
        """Action tokens int64 [D] for ``obs``."""
        ...


class RandomPolicy:
    """Uniform action tokens, from its own seeded generator."""

    def __init__(self, space: ActionSpace, seed: int) -> None:
        self.space = space
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self, env: EmbodiedEnv) -> None:
        """Nothing to prepare."""

    def act(self, obs: Observation) -> np.ndarray:
        """Uniform tokens [D]."""
        return self(torch.from_numpy(obs.image[None]), [obs.instruction], torch.zeros(1))[0].numpy()

    def __call__(self, frames: Tensor, instructions: list[str], steps: Tensor) -> Tensor:
        """Uniform tokens int64 [B, D]."""
        shape = (frames.shape[0], self.space.dims)
        return torch.randint(0, self.space.vocab, shape, generator=self.generator)


class NoisyScriptedPolicy:
    """minigrid's BabyAI bot (``BabyAIEnv.expert``), replaced by a uniform random action with
    probability ``noise`` at each step (and whenever the bot asks for an action outside the
    env's space); the bot keeps advising from wherever the noise took the agent."""

    def __init__(self, space: ActionSpace, noise: float, seed: int) -> None:
        self.space = space
        self.noise = noise
        self.rng = np.random.default_rng(seed)
        self._bot: Any = None
        self._taken: int | None = None
        self.advice: int | None = None
        """The bot's own action at the last ``act`` (before the noise), or None where it asked
        for one outside the env's space: the label for behaviour cloning."""

    def reset(self, env: EmbodiedEnv) -> None:
        """Start the bot on the new episode."""
        expert = getattr(env, "expert", None)
        if expert is None:
            raise ValueError(
                f"--policy noisy_scripted needs an env with a scripted expert (babyai); "
                f"{type(env).__name__} has none"
            )
        self._bot, self._taken = expert(), None

    def act(self, obs: Observation) -> np.ndarray:
        """The bot's action, or with probability ``noise`` a random one."""
        suggested = int(self._bot.replan(self._taken))
        self.advice = suggested if 0 <= suggested < self.space.vocab else None
        if self.rng.random() < self.noise or self.advice is None:
            suggested = int(self.rng.integers(self.space.vocab))
        self._taken = suggested
        return np.asarray([suggested], dtype=np.int64)


class CheckpointPolicy:
    """A VLA policy saved by an embodied run (``RUN_DIR/checkpoint``: ``model.safetensors`` and
    ``vla_config.json``), sampling its actions from a seeded generator (or, with ``greedy``,
    taking the most likely)."""

    def __init__(self, path: str | Path, seed: int, *, greedy: bool = False) -> None:
        self.policy = load_vla_checkpoint(path)
        self.generator = torch.Generator().manual_seed(seed)
        self.greedy = greedy

    def reset(self, env: EmbodiedEnv) -> None:
        """Nothing to prepare: the policy is memoryless."""

    def act(self, obs: Observation) -> np.ndarray:
        """Action tokens [D] (sampled, or the most likely with ``greedy``)."""
        steps = torch.tensor([obs.step])
        return self(torch.from_numpy(obs.image[None]), [obs.instruction], steps)[0].numpy()

    def __call__(self, frames: Tensor, instructions: list[str], steps: Tensor) -> Tensor:
        """Action tokens int64 [B, D] (sampled, or the most likely with ``greedy``)."""
        with torch.no_grad():
            actions, _, _ = self.policy.act(
                frames, instructions, steps.long(), greedy=self.greedy, generator=self.generator
            )
        return actions


def load_vla_checkpoint(path: str | Path) -> VLAPolicy:
    """The VLA policy in the folder ``path`` (``vla_config.json`` and ``model.safetensors``, as
    an embodied run's ``checkpoint/`` holds them), in eval mode on the CPU."""
    try:
        config = saved_vla_config(path)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"--policy {path}: not random or noisy_scripted, and {err}"
        ) from err
    policy = VLAPolicy(config)
    policy.load_state_dict(load_vla_weights(path, config))
    return policy.eval()


def episode_policy(name: str, space: ActionSpace, *, noise: float, seed: int) -> EpisodePolicy:
    """The policy ``--policy name`` names: random, noisy_scripted or a checkpoint folder."""
    if name == "random":
        return RandomPolicy(space, seed)
    if name == "noisy_scripted":
        return NoisyScriptedPolicy(space, noise, seed)
    return CheckpointPolicy(name, seed)
