"""The world-model half of an imagining embodied run (AcceRL-WM,
``imagination.episodes_per_real > 0``), which ``relayrl.workloads.embodied`` composes.

Three roles join the table: the ``world_model_trainer`` (M_obs and M_reward, and ``B_wm``),
``world_model_service`` replicas (an ``InferenceService`` answering imagination requests) and
the ``imagined_buffer`` (``B_img``, a replay buffer of imagined segments). Each rollout worker
gets its imagination (``WorldModelEnv`` slots stepping through its replica, ``B_img``, ``B_wm``);
after every policy step the world-model trainer runs its round beside the loop, and the version
it trained is published to the replicas once the round ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import ray

from relayrl.config import Config
from relayrl.executors.imagination import Imagination, ImaginationSettings
from relayrl.executors.inference_service import InferenceService
from relayrl.executors.replay_buffer import ReplayBuffer
from relayrl.executors.worker_side import BufferSink, EpisodeSink, WorldModelClient
from relayrl.executors.world_model_trainer import WorldModelTrainer
from relayrl.launch import connect_weight_sync, form_trainer_group
from relayrl.models.world_model import SuccessModel, build_obs_model, world_model_configs
from relayrl.models.world_model.serving import WorldModel, world_model_replies
from relayrl.observability.metrics import RunTally
from relayrl.recovery import DEATHS, ExecutorFailed, alive, first_line
from relayrl.roles import Group, Placed, Role, ray_resources
from relayrl.types import TrainerStats
from relayrl.workloads.saved_models import check_saved_world_model

WM_SEED = 3 * 10**6  # world-model replica i, and worker i's imagination, from run.seed + this + i


class EmbodiedWorldModel:
    """The world-model roles of an embodied run whose env has ``views`` camera views and an
    action space of ``dims`` dimensions over ``vocab`` bins: their table rows, their wiring to
    the rollout workers, and the world-model rounds beside the policy loop. A ``world_model.path``
    of other sizes is refused here, before any role is placed."""

    def __init__(self, cfg: Config, *, views: int, dims: int, vocab: int):
        self.cfg = cfg
        self.obs_cfg, self.reward_cfg = world_model_configs(
            cfg.world_model,
            image_size=cfg.env.image_size,
            instruction_tokens=cfg.vla.instruction_tokens,
            views=views,
            dims=dims,
            vocab=vocab,
        )
        if cfg.world_model.path is not None:
            check_saved_world_model(cfg.world_model.path, self.obs_cfg, self.reward_cfg)
        self.placed = Placed()  # the workload's placed table, once ``wire`` is called
        self.sync: Any = None  # weight sync from the trainer's rank 0 to the replicas
        self.round: Any = None  # the world-model trainer's round in progress (a ref per rank)
        self.version = 0  # the world-model version the replicas were last handed

    @property
    def trainer(self) -> Group:
        """The world-model trainer ranks."""
        return self.placed["world_model_trainer"]

    @property
    def services(self) -> Group:
        """The world-model replicas."""
        return self.placed["world_model_service"]

    @property
    def buffer(self) -> Any:
        """``B_img``."""
        return self.placed["imagined_buffer"][0]

    def table(self) -> list[Role]:
        """The world-model trainer, its service replicas and ``B_img``: none is replaced (the
        trainer holds ``B_wm``, which would be lost with it)."""
        cfg, wm = self.cfg, self.cfg.world_model
        obs_cfg, reward_cfg = self.obs_cfg, self.reward_cfg
        resources = ray_resources(wm.resources)
        return [
            Role(
                "world_model_trainer",
                WorldModelTrainer,
                wm.ranks,
                lambda r, _: ((cfg, obs_cfg, reward_cfg), {"rank": r, "world": wm.ranks}),
                **resources,
                keeps="both models, optimizer, version, B_wm",
                saved="state_dict",
                traced=True,
                close="close_sync",
                options={"max_concurrency": 2},
            ),
            Role(
                "world_model_service",
                InferenceService,
                wm.replicas,
                lambda i, _: (
                    (WorldModel(build_obs_model(obs_cfg), SuccessModel(reward_cfg)),),
                    {
                        "max_batch": wm.max_batch,
                        "max_wait_ms": wm.max_wait_ms,
                        "threads": cfg.ray.threads_per_executor,
                        "sync_timeout_s": cfg.sync.timeout_s,
                        "seed": cfg.run.seed + WM_SEED + i,
                        "batch_fn": world_model_replies,
                        "name": "world_model_service",
                    },
                ),
                **resources,
                receives="world_model_trainer",
                keeps="sampling generator",
                saved="state_dict",
                traced=True,
            ),
            Role(
                "imagined_buffer",
                ReplayBuffer,
                1,
                lambda i, _: (
                    (cfg.imagination.buffer_steps,),
                    {"max_staleness": cfg.max_staleness},
                ),
                **ray_resources(cfg.trainer.resources),
                keeps="its segments and books",
                saved="state_dict",
                options={"max_concurrency": 4},
            ),
        ]

    def wire(self, placed: Placed) -> None:
        """Once ``placed`` holds the table: form the world-model trainer's group and give every
        rollout worker its imagination (``WorldModelEnv`` slots stepping through its replica,
        ``B_img``, ``B_wm``)."""
        self.placed = placed
        form_trainer_group(self.trainer)
        settings = ImaginationSettings.from_config(self.cfg)
        ray.get(
            [
                worker.set_imagination.remote(
                    Imagination(
                        settings,
                        WorldModelClient(self.services[i % len(self.services)]),
                        BufferSink(self.buffer),
                        EpisodeSink(self.trainer[0]),
                        seed=self.cfg.run.seed + WM_SEED + 1000 + i,
                    )
                )
                for i, worker in enumerate(placed["rollout_worker"])
            ]
        )

    def serve(self) -> None:
        """Connect the world-model replicas to the trainer's rank 0 (the ranks hold the same
        weights whole) and serve the version it holds."""
        publisher = Group(self.trainer.role, self.trainer.actors[:1])
        receivers = self.placed.receivers("world_model_trainer")
        self.sync = connect_weight_sync(self.cfg, publisher, receivers)
        ray.get(list(self.sync.publish().values()))
        self.version = ray.get(self.trainer[0].stats.remote()).version

    def fetch(self, replay_buffer: Any, steps: int, version: int) -> list[Any]:
        """Refs to a super-batch of ``steps`` env steps for a trainer at ``version``:
        ``imagination.real_ratio`` of them from ``replay_buffer``, then the rest from ``B_img``."""
        real = round(self.cfg.imagination.real_ratio * steps)
        parts = [replay_buffer.get.remote(real, version)] if real else []
        if steps - real:
            parts.append(self.buffer.get.remote(steps - real, version))
        return parts

    async def unreceived(self, ranks: Sequence[TrainerStats], tally: RunTally) -> int:
        """Imagined env steps ``B_img`` handed out that none of the trainer ranks (``ranks``:
        their stats) has received yet, less those ``tally`` books as dropped at a resume."""
        imagined = await self.buffer.stats.remote()
        return imagined.unreceived(ranks, imagined=True, booked=tally.imagined_dropped_resume)

    async def after_step(self, step: int) -> dict[str, float]:
        """After policy step ``step``: hand a finished round's version to the replicas and start
        the round due now; its metrics once it ends."""
        out: dict[str, float] = {}
        if self.round is not None:
            done, _ = await asyncio.to_thread(
                ray.wait, self.round, num_returns=len(self.round), timeout=0
            )
            if len(done) < len(self.round):
                return out
            out = await self.finish()
        self.round = [rank.train.remote(step) for rank in self.trainer]
        return out

    async def finish(self) -> dict[str, float]:
        """Wait for the round in progress (if any), publish the version it trained to the
        replicas; its metrics."""
        if self.round is None:
            return {}
        rounds, self.round = self.round, None
        try:
            found, *_ = await asyncio.gather(*rounds)  # every rank ends the round alike
        except DEATHS as err:  # not replaced: B_wm and the round would be lost with it
            for name, rank in self.trainer.named().items():
                if not await alive(rank):
                    raise ExecutorFailed(name, first_line(err)) from err
            raise
        if found.version > self.version:
            await asyncio.gather(*self.sync.publish().values())
            self.version = found.version
        return dict(found.metrics)
