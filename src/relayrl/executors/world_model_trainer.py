"""World-model trainer: fine-tunes M_obs and M_reward on real experience and publishes them.

It holds ``B_wm`` (``RealEpisodes``): the newest real episodes the rollout workers finished, at
most ``world_model.buffer_steps`` transitions, the oldest evicted first. ``train(policy_step)``
takes ``world_model.train_steps`` gradient steps of M_obs when ``policy_step`` is a multiple of
``world_model.train_obs_every`` (T_obs) and of M_reward when it is one of
``world_model.train_reward_every`` (T_reward), each on ``world_model.batch_size`` samples drawn
from ``B_wm``: K-frame windows for M_obs, frames half of which are success frames (the last frame
of a successful episode, rare otherwise) for M_reward, or a quarter success and a quarter failure
frames with its failure head. A round that stepped either model bumps the world-model version,
and ``publish`` sends both models as one module (``WorldModel``) through weight sync, as the
policy trainer sends the policy.

It is a ``TrainerCore`` over that module, as the policy trainers are over the policy: each
gradient step is the core's ``GradientStep`` (one AdamW over both models, no clipping), so a nan
or inf loss or gradient norm takes no step, leaves both models and the optimizer state as they
were, and is counted (``skipped_nonfinite`` in ``stats``, ``world_model/skipped_nonfinite`` in a
round's metrics); the round goes on with its next step. Group, weight sync, version, state and
stats are the core's.

Models start from ``world_model.path`` (``relayrl wm pretrain``'s output) or fresh. As a Ray
actor create it with ``max_concurrency=2``: workers add episodes while a round trains (a lock
keeps ``B_wm`` whole).

With ``world_model.ranks`` > 1 the trainer is a data-parallel group (``relayrl.parallel``'s
rendezvous: rank 0 hosts it, every rank calls ``join_group``). The models are small, so every rank
holds both whole (a replicated core, not sharded). Rank 0 holds ``B_wm`` (the workers send it
their episodes) and draws each gradient step's batch; the batch goes to every rank (a broadcast),
each rank takes the loss on its block (``parallel.share``) weighted by its fraction of the batch,
and the core sums the gradients over ranks, so every rank takes the step one trainer takes on the
whole batch and the replicas stay equal. ``train`` is called on every rank; rank 0 alone
publishes.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relayrl import parallel
from relayrl.config import Config
from relayrl.data.trajectories import Episode
from relayrl.executors.trainer_core import GradientStep, TrainerCore
from relayrl.models.world_model import (
    ObsModelConfig,
    SuccessModel,
    SuccessModelConfig,
    Transitions,
    build_obs_model,
    load_pretrained,
    save_pretrained,
)
from relayrl.models.world_model.batches import (
    draw_frames,
    frame_index,
    labels,
    transition_index,
    transitions,
)
from relayrl.models.world_model.reward_model import SuccessLabels
from relayrl.models.world_model.serving import WorldModel
from relayrl.types import WorldModelStats


@dataclass
class WMStepResult:
    """What one ``train`` round did: control fields, and ``metrics`` for logging."""

    trained_obs: bool  # M_obs took at least one step this round
    trained_reward: bool  # M_reward did
    version: int  # the world-model version after the round
    skipped_nonfinite: int = 0  # steps of either model skipped for a nan or inf loss or norm
    metrics: dict[str, float] = field(default_factory=dict)


class RealEpisodes:
    """``B_wm``: real episodes, at most ``capacity_steps`` transitions, the oldest evicted first;
    an episode longer than the whole capacity is not kept."""

    def __init__(self, capacity_steps: int, seed: int):
        if capacity_steps < 1:
            raise ValueError(f"capacity_steps must be >= 1, got {capacity_steps}")
        self.capacity_steps = capacity_steps
        self.episodes: list[Episode] = []
        self.steps = 0
        self.added_steps = 0
        self.evicted_steps = 0
        self.rng = np.random.default_rng(seed)

    def add(self, episode: Episode) -> None:
        """Keep ``episode``, evicting the oldest ones to make room."""
        self.added_steps += episode.steps
        if episode.steps > self.capacity_steps or episode.steps == 0:
            self.evicted_steps += episode.steps
            return
        while self.steps + episode.steps > self.capacity_steps:
            old = self.episodes.pop(0)
            self.steps -= old.steps
            self.evicted_steps += old.steps
        self.episodes.append(episode)
        self.steps += episode.steps

    def transitions(self, n: int, k: int) -> Transitions:
        """``n`` transitions drawn uniformly (with replacement), as K-frame windows."""
        index = transition_index(self.episodes, np.arange(len(self.episodes)))
        return transitions(self.episodes, index[self.rng.integers(len(index), size=n)], k)

    def success_labels(self, n: int, model: SuccessModel) -> SuccessLabels | None:
        """``n`` labelled frames, drawn as ``draw_frames`` draws them (half success frames, or a
        quarter success and a quarter failure frames for a model with the failure head); None
        while no success frame is held."""
        index, outcome = frame_index(self.episodes, np.arange(len(self.episodes)))
        drawn = draw_frames(index, outcome, n, self.rng, model.cfg.failure_head)
        return None if drawn is None else labels(model, self.episodes, *drawn)

    def state_dict(self) -> dict:
        """The episodes, counters and sampling generator."""
        return {
            "episodes": list(self.episodes),
            "added_steps": self.added_steps,
            "evicted_steps": self.evicted_steps,
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.episodes = list(state["episodes"])
        self.steps = sum(e.steps for e in self.episodes)
        self.added_steps = state["added_steps"]
        self.evicted_steps = state["evicted_steps"]
        self.rng.bit_generator.state = state["rng"]


class WorldModelTrainer(TrainerCore):
    """Fine-tunes the world model on ``B_wm`` and publishes it; a Ray actor in a run."""

    name = "world_model_trainer"

    def __init__(
        self,
        cfg: Config,
        obs_cfg: ObsModelConfig,
        reward_cfg: SuccessModelConfig,
        rank: int = 0,
        world: int = 1,
    ):
        torch.set_num_threads(cfg.ray.threads_per_executor)
        torch.manual_seed(cfg.run.seed)
        wm = cfg.world_model
        self.wm = wm
        if wm.path is not None:
            obs, reward = (
                load_pretrained(Path(wm.path) / "observation"),
                load_pretrained(Path(wm.path) / "reward"),
            )
        else:
            obs, reward = build_obs_model(obs_cfg), SuccessModel(reward_cfg)
        model = WorldModel(obs, reward).train()
        # One AdamW over both models takes the steps one per model would: a step of one model
        # leaves the other's gradients None, and AdamW passes such parameters over (no decay, no
        # moment update, no step count). Weight decay is AdamW's default.
        gradient_step = GradientStep(model, lr=wm.lr, weight_decay=0.01)
        super().__init__(cfg, model, gradient_step, rank=rank, world=world, sharded=False)
        if world > 1:  # the replicas start equal; each rank draws noise of its own from here
            torch.manual_seed(cfg.run.seed + rank)
        self.buffer = RealEpisodes(wm.buffer_steps, seed=cfg.run.seed)
        self.updates = {"obs": 0, "reward": 0}
        self._lock = threading.Lock()  # B_wm: workers add while a round samples

    def add_episodes(self, episodes: list[Episode]) -> int:
        """Put real episodes into ``B_wm``; returns the transitions it holds."""
        with self._lock:
            for episode in episodes:
                self.buffer.add(episode)
            return self.buffer.steps

    def train(self, policy_step: int) -> WMStepResult:
        """The round due after policy step ``policy_step``: M_obs every T_obs steps, M_reward
        every T_reward, ``train_steps`` steps each; a model with nothing to learn from yet (no
        transition; no success frame for M_reward) waits for the next round."""
        wm = self.wm
        due_obs = wm.train_obs_every > 0 and policy_step % wm.train_obs_every == 0
        due_reward = wm.train_reward_every > 0 and policy_step % wm.train_reward_every == 0
        metrics: dict[str, float] = {}
        stepped = {"obs": 0, "reward": 0}
        skipped = self.skipped_nonfinite
        with self.tracer.span("train_world_model", self.version):
            k = self.model.obs.cfg.context_frames
            for _ in range(wm.train_steps if due_obs else 0):
                batch = self._draw(
                    lambda: self.buffer.transitions(wm.batch_size, k) if self.buffer.steps else None
                )
                if batch is None:
                    break
                loss = self._step(self.model.obs.loss, batch)
                if loss is not None:
                    metrics["world_model/loss_obs"] = loss
                    stepped["obs"] += 1
            for _ in range(wm.train_steps if due_reward else 0):
                found = self._draw(
                    lambda: self.buffer.success_labels(wm.batch_size, self.model.reward)
                )
                if found is None:
                    break
                loss = self._step(self.model.reward.loss, found)
                if loss is not None:
                    metrics["world_model/loss_reward"] = loss
                    stepped["reward"] += 1
        for part, steps in stepped.items():
            self.updates[part] += steps
        if stepped["obs"] or stepped["reward"]:
            self.bump_version()
        skipped = self.skipped_nonfinite - skipped
        metrics["world_model/version"] = float(self.version)
        metrics["world_model/buffer_steps"] = float(self.buffer.steps)
        metrics["world_model/skipped_nonfinite"] = float(skipped)
        return WMStepResult(
            trained_obs=stepped["obs"] > 0,
            trained_reward=stepped["reward"] > 0,
            version=self.version,
            skipped_nonfinite=skipped,
            metrics=metrics,
        )

    def _draw(self, draw: Callable[[], Any]) -> Any:
        """A gradient step's batch: what ``draw()`` gives on rank 0 (None: nothing to learn from
        yet), the same object on every rank."""
        if self.rank != 0:
            return parallel.broadcast_object(None)
        with self._lock:
            drawn = draw()
        return parallel.broadcast_object(drawn)

    def _step(self, loss_fn: Callable[[Any], torch.Tensor], batch: Any) -> float | None:
        """One ``GradientStep`` on ``batch`` with ``loss_fn`` (a mean loss over its samples);
        with ranks, each on its block, weighted by its fraction. Returns the loss of the whole
        batch, or None if the step was skipped (a nan or inf loss or gradient norm)."""
        if self.world == 1:
            loss = loss_fn(batch)
        else:
            fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
            size = len(next(iter(fields.values())))
            block = parallel.share(size, self.rank, self.world)
            mine = type(batch)(**{k: None if v is None else v[block] for k, v in fields.items()})
            weight = (block.stop - block.start) / size
            # A rank with no sample backpropagates nothing: its gradients come from the sum.
            loss = loss_fn(mine) * weight if weight else torch.zeros((), requires_grad=True)
        _, stepped = self.apply_gradients(loss)
        whole = parallel.global_metrics({"loss": float(loss.detach())}, {})["loss"]
        return whole if stepped else None

    def save_pretrained(self, directory: str) -> str:
        """Write both models as ``directory/observation`` and ``directory/reward`` (what
        ``world_model.path`` loads); returns the directory."""
        save_pretrained(self.model.obs, Path(directory) / "observation", version=self.version)
        save_pretrained(self.model.reward, Path(directory) / "reward", version=self.version)
        return directory

    def state_dict(self) -> dict:
        """The core's snapshot (both models, the optimizer, the version) plus the gradient steps
        per model and ``B_wm``."""
        with self._lock:
            extra = {"updates": dict(self.updates), "buffer": self.buffer.state_dict()}
            return super().state_dict() | copy.deepcopy(extra)

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        with self._lock:
            super().load_state_dict(state)
            self.updates = dict(state["updates"])
            self.buffer.load_state_dict(state["buffer"])

    def stats(self) -> WorldModelStats:
        """The core's counters plus the gradient steps per model and ``B_wm``'s books."""
        with self._lock:
            core = super().stats()
            return WorldModelStats(
                version=core.version,
                busy_s=core.busy_s,
                skipped_nonfinite=core.skipped_nonfinite,
                updates=dict(self.updates),
                buffer_steps=self.buffer.steps,
                buffer_episodes=len(self.buffer.episodes),
                added_steps=self.buffer.added_steps,
                evicted_steps=self.buffer.evicted_steps,
            )
