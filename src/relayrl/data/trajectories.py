"""Offline trajectories of an embodied env on disk: compressed numpy shards and a JSON manifest.

A folder written by ``TrajectoryWriter`` (``relayrl wm collect``) holds::

    manifest.json        what produced the episodes (command, config, levels, policy, seeds) and
                         their counts
    shard-00000.npz ...  episodes_per_shard episodes each, concatenated:
      frames          uint8 [sum(T_i + 1), V, H, W, 3]  o_0 .. o_T of every episode
      actions         int64 [sum(T_i), D]               the action tokens a_0 .. a_{T-1}
      rewards         float32 [sum(T_i)]                 the env's rewards
      frame_offsets   int64 [E + 1]                      episode i's frames are
                                                         frames[frame_offsets[i]:frame_offsets[i+1]]
                                                         (its actions start at frame_offsets[i] - i)
      instructions, tasks  str [E]
      seeds           int64 [E]                          the reset seed: env.reset(task, seed)
                                                         gives o_0 again
      success, terminated, truncated  bool [E]           how the episode ended

``np.savez_compressed`` shrinks BabyAI's flat-coloured frames about tenfold, and loading needs no
pickle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "relayrl-trajectories/1"


@dataclass
class Episode:
    """One real episode: T + 1 frames, T actions and how it ended."""

    frames: np.ndarray  # uint8 [T + 1, V, H, W, 3]: o_0 .. o_T
    actions: np.ndarray  # int64 [T, D]: a_t leads from o_t to o_{t+1}
    rewards: np.ndarray  # float32 [T]
    instruction: str
    task: str
    seed: int  # env.reset(task=task, seed=seed) starts this episode again
    success: bool
    terminated: bool
    truncated: bool

    @property
    def steps(self) -> int:
        """Env steps (transitions) in the episode, T."""
        return len(self.actions)


class TrajectoryWriter:
    """Writes episodes into ``out`` as shards of ``episodes_per_shard``; ``close`` writes the
    manifest, with ``producer`` (what made the episodes) in it."""

    def __init__(self, out: str | Path, *, producer: dict[str, Any], episodes_per_shard: int = 64):
        if episodes_per_shard < 1:
            raise ValueError(f"episodes_per_shard must be >= 1, got {episodes_per_shard}")
        self.out = Path(out)
        if self.out.is_dir() and any(self.out.iterdir()):
            raise FileExistsError(f"{self.out} is not empty; choose a new folder for the episodes")
        self.out.mkdir(parents=True, exist_ok=True)
        self.producer = producer
        self.episodes_per_shard = episodes_per_shard
        self._pending: list[Episode] = []
        self._shards: list[dict[str, Any]] = []
        self._per_task: dict[str, dict[str, int]] = {}

    def add(self, episode: Episode) -> None:
        """Queue one episode; a full shard is written at once."""
        self._pending.append(episode)
        counts = self._per_task.setdefault(
            episode.task, {"episodes": 0, "steps": 0, "successes": 0}
        )
        counts["episodes"] += 1
        counts["steps"] += episode.steps
        counts["successes"] += int(episode.success)
        if len(self._pending) == self.episodes_per_shard:
            self._flush()

    def close(self) -> dict[str, Any]:
        """Write the last shard and the manifest; returns the manifest."""
        if self._pending:
            self._flush()
        manifest = {
            "format": FORMAT,
            "episodes": sum(s["episodes"] for s in self._shards),
            "steps": sum(s["steps"] for s in self._shards),
            "successes": sum(c["successes"] for c in self._per_task.values()),
            "per_task": self._per_task,
            "shards": self._shards,
            "producer": self.producer,
        }
        (self.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest

    def _flush(self) -> None:
        episodes, self._pending = self._pending, []
        name = f"shard-{len(self._shards):05d}.npz"
        lengths = [len(e.frames) for e in episodes]
        np.savez_compressed(
            self.out / name,
            frames=np.concatenate([e.frames for e in episodes]),
            actions=np.concatenate([e.actions for e in episodes]).astype(np.int64),
            rewards=np.concatenate([e.rewards for e in episodes]).astype(np.float32),
            frame_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            instructions=np.array([e.instruction for e in episodes], dtype=np.str_),
            tasks=np.array([e.task for e in episodes], dtype=np.str_),
            seeds=np.array([e.seed for e in episodes], dtype=np.int64),
            success=np.array([e.success for e in episodes]),
            terminated=np.array([e.terminated for e in episodes]),
            truncated=np.array([e.truncated for e in episodes]),
        )
        steps = sum(e.steps for e in episodes)
        self._shards.append({"file": name, "episodes": len(episodes), "steps": steps})


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of a trajectory folder; a clear error when ``folder`` is not one."""
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} holds no manifest.json: not a folder written by relayrl wm collect"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def load_episodes(folder: str | Path) -> list[Episode]:
    """Every episode of a trajectory folder, in the order they were written."""
    manifest = read_manifest(folder)
    episodes = []
    for shard in manifest["shards"]:
        with np.load(Path(folder) / shard["file"], allow_pickle=False) as z:
            offsets = z["frame_offsets"]
            frames, actions, rewards = z["frames"], z["actions"], z["rewards"]
            for i in range(len(offsets) - 1):
                start, end = int(offsets[i]), int(offsets[i + 1])
                episodes.append(
                    Episode(
                        frames=frames[start:end],
                        actions=actions[start - i : end - i - 1],
                        rewards=rewards[start - i : end - i - 1],
                        instruction=str(z["instructions"][i]),
                        task=str(z["tasks"][i]),
                        seed=int(z["seeds"][i]),
                        success=bool(z["success"][i]),
                        terminated=bool(z["terminated"][i]),
                        truncated=bool(z["truncated"][i]),
                    )
                )
    return episodes
