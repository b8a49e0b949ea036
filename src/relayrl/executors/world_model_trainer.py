"""World-model trainer: fine-tunes M_obs and M_reward on real experience and publishes them.

It holds ``B_wm`` (``RealEpisodes``): the newest real episodes the rollout workers finished, at
most ``world_model.buffer_steps`` transitions, the oldest evicted first. ``train(policy_step)``
takes ``world_model.train_steps`` gradient steps of M_obs when ``policy_step`` is a multiple of
``world_model.train_obs_every`` (T_obs) and of M_reward when it is one of
``world_model.train_reward_every`` (T_reward), each on ``world_model.batch_size`` samples drawn
from ``B_wm``: K-frame windows for M_obs, frames half of which are success frames (the last frame
of a successful episode, rare otherwise) for M_reward, or a quarter success and a quarter failure
frames with its failure head. A round that trained either model bumps
the world-model version, and ``publish`` sends both models as one module (``WorldModel``) through
weight sync, as the policy trainer sends the policy.

Models start from ``world_model.path`` (``relayrl wm pretrain``'s output) or fresh. As a Ray
actor create it with ``max_concurrency=2``: workers add episodes while a round trains (a lock
keeps ``B_wm`` whole).

With ``world_model.ranks`` > 1 the trainer is a data-parallel group (``relayrl.parallel``'s
rendezvous: rank 0 hosts it, every rank calls ``join_group``). The models are small, so every rank
holds both whole (replicated, not sharded). Rank 0 holds ``B_wm`` (the workers send it their
episodes) and draws each gradient step's batch; the batch goes to every rank (a broadcast), each
rank takes the loss on its block (``parallel.share``) weighted by its fraction of the batch, and
the gradients are summed over ranks, so every rank takes the step one trainer takes on the whole
batch and the replicas stay equal. ``train`` is called on every rank; rank 0 alone publishes.
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
import torch.distributed as dist

from relayrl import parallel
from relayrl.config import Config
from relayrl.data.trajectories import Episode
from relayrl.models.world_model import (
    ObsModelConfig,
    SuccessModel,
    SuccessModelConfig,
    Transitions,
    build_obs_model,
    load_pretrained,
    save_pretrained,
)
from relayrl.models.world_model.reward_model import SuccessLabels
from relayrl.models.world_model.serving import WorldModel
from relayrl.observability.tracing import Span, Tracer
from relayrl.weight_sync import TRANSPORTS, Ticket
from relayrl.weight_sync.base import TrainerSide
from relayrl.wm.pretrain import (
    draw_frames,
    frame_index,
    labels,
    transition_index,
    transitions,
)


@dataclass
class WMStepResult:
    """What one ``train`` round did: control fields, and ``metrics`` for logging."""

    trained_obs: bool  # M_obs took its steps this round
    trained_reward: bool  # M_reward did
    version: int  # the world-model version after the round
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


class WorldModelTrainer:
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
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got rank={rank}")
        self.rank, self.world = rank, world
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
        self.model = WorldModel(obs, reward).train()
        if world > 1:  # the replicas start equal; each rank draws noise of its own from here
            torch.manual_seed(cfg.run.seed + rank)
        self.obs_opt = torch.optim.AdamW(obs.parameters(), lr=wm.lr)
        self.reward_opt = torch.optim.AdamW(reward.parameters(), lr=wm.lr)
        self.buffer = RealEpisodes(wm.buffer_steps, seed=cfg.run.seed)
        self.version = 0
        self.updates = {"obs": 0, "reward": 0}
        self.tracer = Tracer(self.name)
        self._lock = threading.Lock()  # B_wm: workers add while a round samples
        self.sync = TrainerSide(
            timeout_s=cfg.sync.timeout_s,
            bucket_bytes=cfg.sync.bucket_mb << 20,
            streams=cfg.sync.streams,
            in_place=False,
        )

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
        trained_obs = trained_reward = False
        with self.tracer.span("train_world_model", self.version):
            k = self.model.obs.cfg.context_frames
            for _ in range(wm.train_steps if due_obs else 0):
                batch = self._draw(
                    lambda: self.buffer.transitions(wm.batch_size, k) if self.buffer.steps else None
                )
                if batch is None:
                    break
                metrics["world_model/loss_obs"] = self._step(
                    self.model.obs, self.model.obs.loss, batch, self.obs_opt
                )
                trained_obs = True
            for _ in range(wm.train_steps if due_reward else 0):
                found = self._draw(
                    lambda: self.buffer.success_labels(wm.batch_size, self.model.reward)
                )
                if found is None:
                    break
                metrics["world_model/loss_reward"] = self._step(
                    self.model.reward, self.model.reward.loss, found, self.reward_opt
                )
                trained_reward = True
        self.updates["obs"] += trained_obs * wm.train_steps
        self.updates["reward"] += trained_reward * wm.train_steps
        if trained_obs or trained_reward:
            self.version += 1
        metrics["world_model/version"] = float(self.version)
        metrics["world_model/buffer_steps"] = float(self.buffer.steps)
        return WMStepResult(trained_obs, trained_reward, self.version, metrics)

    def _draw(self, draw: Callable[[], Any]) -> Any:
        """A gradient step's batch: what ``draw()`` gives on rank 0 (None: nothing to learn from
        yet), the same object on every rank."""
        if self.rank == 0:
            with self._lock:
                drawn = draw()
        else:
            drawn = None
        if self.world > 1:
            box = [drawn]
            dist.broadcast_object_list(box, src=0)
            drawn = box[0]
        return drawn

    def _step(
        self,
        model: torch.nn.Module,
        loss_fn: Callable[[Any], torch.Tensor],
        batch: Any,
        optimizer: torch.optim.Optimizer,
    ) -> float:
        """One optimizer step of ``model`` on ``batch`` (a mean loss over its samples); with
        ranks, each on its block, weighted by its fraction, gradients summed. Returns the loss
        of the whole batch."""
        optimizer.zero_grad()
        if self.world == 1:
            loss = loss_fn(batch)
            loss.backward()
        else:
            fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
            size = len(next(iter(fields.values())))
            block = parallel.share(size, self.rank, self.world)
            mine = type(batch)(**{k: None if v is None else v[block] for k, v in fields.items()})
            weight = (block.stop - block.start) / size
            loss = loss_fn(mine) * weight if weight else torch.zeros(())
            if weight:
                loss.backward()
            parallel.sum_gradients(list(model.parameters()))
            loss = loss.detach().reshape(1)
            dist.all_reduce(loss)
        optimizer.step()
        return float(loss.detach())

    def group_address(self) -> tuple[str, int]:
        """Rank 0: where the ranks' process group meets."""
        return parallel.group_address()

    def join_group(self, host: str, port: int) -> None:
        """Join the ranks' process group (every rank at once)."""
        parallel.join(host, port, self.rank, self.world, cuda=False)

    def open_sync(self, transport: str, receivers: list[str], host: str = "127.0.0.1") -> dict:
        """Create the weight-sync publisher; returns the address receivers attach to."""
        return self.sync.open(TRANSPORTS[transport], self.model, receivers, host)

    def connect_sync(self) -> None:
        """Rendezvous with the receivers (they call their ``connect_sync`` meanwhile)."""
        self.sync.publisher.connect()

    def publish(self) -> Ticket:
        """Publish both models as the current world-model version."""
        with self.tracer.span("publish", self.version):
            return self.sync.publish(self.version, self.model.state_dict())

    def close_sync(self) -> None:
        """Close the weight-sync publisher before the actor is killed."""
        self.sync.close()

    def sync_stats(self) -> dict:
        """Trainer-side stall of every publish and the receivers lost."""
        return self.sync.stats()

    def save_pretrained(self, directory: str) -> str:
        """Write both models as ``directory/observation`` and ``directory/reward`` (what
        ``world_model.path`` loads); returns the directory."""
        save_pretrained(self.model.obs, Path(directory) / "observation", version=self.version)
        save_pretrained(self.model.reward, Path(directory) / "reward", version=self.version)
        return directory

    def state_dict(self) -> dict:
        """A snapshot of both models, their optimizers, the version, counters and ``B_wm``."""
        with self._lock:
            return copy.deepcopy(
                {
                    "model": self.model.state_dict(),
                    "obs_opt": self.obs_opt.state_dict(),
                    "reward_opt": self.reward_opt.state_dict(),
                    "version": self.version,
                    "updates": dict(self.updates),
                    "buffer": self.buffer.state_dict(),
                    "torch_rng": torch.get_rng_state(),
                }
            )

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        with self._lock:
            self.model.load_state_dict(state["model"])
            self.obs_opt.load_state_dict(state["obs_opt"])
            self.reward_opt.load_state_dict(state["reward_opt"])
            self.version = state["version"]
            self.updates = dict(state["updates"])
            self.buffer.load_state_dict(state["buffer"])
            torch.set_rng_state(state["torch_rng"])

    def stats(self) -> dict:
        """Counters for the run summary: version, gradient steps per model, ``B_wm``'s books."""
        with self._lock:
            return {
                "version": self.version,
                "updates": dict(self.updates),
                "buffer_steps": self.buffer.steps,
                "buffer_episodes": len(self.buffer.episodes),
                "added_steps": self.buffer.added_steps,
                "evicted_steps": self.buffer.evicted_steps,
                "busy_s": self.tracer.busy_s(),
            }

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits
