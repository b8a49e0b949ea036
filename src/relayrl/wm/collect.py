"""``relayrl wm collect``: real episodes for pretraining the world model, never from the target
task's solved policy.

The target levels are the ones the config evaluates (``env.eval_tasks``, else ``env.tasks``).
By default collection plays the config's other levels (babyai.yaml: the curriculum's S5N2 and
S6N3, not its target S7N4); a target level is accepted only with ``--policy random``, so no
trajectory on the target task comes from a policy that solves it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from relayrl.config import Config
from relayrl.data.trajectories import Episode, TrajectoryWriter
from relayrl.envs.embodied import EmbodiedEnv
from relayrl.executors.worker_side import ENVS
from relayrl.wm.policies import POLICY_NAMES, EpisodePolicy, episode_policy

SEED_STRIDE = 100_000
"""Episode i of a collection with ``--seed s`` resets with seed ``s * SEED_STRIDE + i``, so two
collections with different seeds never share a start state."""

DEFAULT_NOISE = 0.3


def target_levels(cfg: Config) -> list[str]:
    """The levels the config's evaluations play: the target task."""
    return list(cfg.env.eval_tasks or cfg.env.tasks)


def collection_levels(cfg: Config, levels: list[str] | None, policy: str) -> list[str]:
    """The levels to collect on: ``levels``, or the config's levels other than the target; a
    ValueError when a target level would be played by anything but the random policy."""
    targets = target_levels(cfg)
    if not levels:
        levels = [t for t in cfg.env.tasks if t not in targets]
        if not levels:
            raise ValueError(
                f"--level: the config's env.tasks {cfg.env.tasks} are all target levels "
                f"(env.eval_tasks={cfg.env.eval_tasks}); name other levels with --level"
            )
    on_target = [level for level in levels if level in targets]
    if on_target and policy != "random":
        raise ValueError(
            f"--level {on_target[0]} is a target level of the config (evaluated: {targets}); "
            f"with --policy {policy} its trajectories could come from a policy that solves the "
            "target task; allowed there: --policy random"
        )
    return list(dict.fromkeys(levels))


def collect(
    cfg: Config,
    out: str | Path,
    *,
    episodes: int,
    policy: str = "random",
    levels: list[str] | None = None,
    noise: float | None = None,
    seed: int = 0,
    command: str = "",
) -> dict[str, Any]:
    """Play ``episodes`` episodes, levels in turn, with ``policy`` (random, noisy_scripted or a
    VLA checkpoint folder) and write them to ``out``; returns the manifest."""
    if not 1 <= episodes <= SEED_STRIDE:
        raise ValueError(f"--episodes must be in [1, {SEED_STRIDE}], got {episodes}")
    if noise is not None and policy != "noisy_scripted":
        raise ValueError(f"--noise {noise}: only --policy noisy_scripted reads it")
    noise = DEFAULT_NOISE if noise is None else noise
    if not 0 <= noise <= 1:
        raise ValueError(f"--noise must be in [0, 1], got {noise}")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    levels = collection_levels(cfg, levels, policy)
    env = ENVS[cfg.env.name](cfg.env.model_copy(update={"tasks": levels}), seed)
    unknown = [level for level in levels if level not in env.tasks]
    if unknown:
        raise ValueError(f"--level {unknown[0]}: not a task of env {cfg.env.name} ({env.tasks})")
    actor = episode_policy(policy, env.action_space, noise=noise, seed=seed)
    space = env.action_space
    producer = {
        "command": command,
        "env": cfg.env.model_dump(),
        "levels": levels,
        "target_levels": target_levels(cfg),
        "policy": policy if policy in POLICY_NAMES else str(Path(policy).resolve()),
        "noise": noise if policy == "noisy_scripted" else None,
        "seed": seed,
        "episode_seed": f"{seed} * {SEED_STRIDE} + episode index",
        "action_space": {"kind": space.kind, "dims": space.dims, "vocab": space.vocab},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    writer = TrajectoryWriter(out, producer=producer)
    bar = tqdm(range(episodes), desc="collect", unit="ep", disable=not cfg.log.progress)
    successes = 0
    try:
        for i in bar:
            task = levels[i % len(levels)]
            episode = play_episode(env, actor, task=task, seed=seed * SEED_STRIDE + i)
            writer.add(episode)
            successes += episode.success
            bar.set_postfix(
                success=f"{successes / (i + 1):.2f}", steps=episode.steps, refresh=False
            )
    finally:
        env.close()
    return writer.close()


def play_episode(
    env: EmbodiedEnv,
    actor: EpisodePolicy,
    *,
    task: str,
    seed: int,
    max_steps: int | None = None,
    **reset_options: Any,
) -> Episode:
    """One real episode of ``task`` from ``env.reset(task, seed, **reset_options)`` (a LIBERO
    ``init_state``, say), played by ``actor`` until the env ends it (or, if given, ``max_steps``
    steps cut it: truncated)."""
    obs = env.reset(task=task, seed=seed, **reset_options)
    actor.reset(env)
    frames, actions, rewards = [obs.image], [], []
    result = None
    while max_steps is None or len(actions) < max_steps:
        tokens = actor.act(obs)
        result = env.step(env.action_space.to_env(tokens))
        obs = result.obs
        frames.append(obs.image)
        actions.append(np.asarray(tokens, dtype=np.int64))
        rewards.append(result.reward)
        if result.terminated or result.truncated:
            break
    ended = result is not None and (result.terminated or result.truncated)
    return Episode(
        frames=np.stack(frames),
        actions=np.stack(actions),
        rewards=np.asarray(rewards, dtype=np.float32),
        instruction=obs.instruction,
        task=task,
        seed=seed,
        success=bool(result is not None and result.success),
        terminated=bool(result is not None and result.terminated),
        truncated=bool(result is not None and (result.truncated or not ended)),
    )
