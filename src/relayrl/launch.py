"""Placement: start or join Ray, create the executors as actors and wire them together.

The embodied workload also builds its environments here (``ENVS``, ``build_env``), because a
rollout worker actor gets a factory and builds (and after a crash rebuilds) its env itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from relayrl.config import Config, EnvConfig
from relayrl.envs.embodied import EmbodiedEnv, Observation, StepResult
from relayrl.envs.latency import LatencyEnv
from relayrl.executors.generator import Generator
from relayrl.executors.inference_service import ActReply, InferenceService
from relayrl.executors.replay_buffer import ReplayBuffer
from relayrl.executors.rewarder import Rewarder
from relayrl.executors.rollout_worker import RolloutWorker
from relayrl.executors.trainer import Trainer
from relayrl.executors.vla_trainer import VLATrainer
from relayrl.models.vla import VLAConfig, VLAPolicy


@dataclass
class Executors:
    """Ray actor handles of one LLM run."""

    generator: Any
    rewarder: Any
    trainer: Any

    def all(self) -> dict[str, Any]:
        """Every executor by name."""
        return {"generator": self.generator, "rewarder": self.rewarder, "trainer": self.trainer}

    def traced(self) -> dict[str, Any]:
        """The executors that record spans (all of them)."""
        return self.all()

    def receivers(self) -> dict[str, Any]:
        """Weight-sync receivers by name."""
        return {"generator": self.generator}


@dataclass
class EmbodiedExecutors:
    """Ray actor handles of one embodied run, and what the controller needs to know of its env."""

    trainer: Any
    inference_service: Any
    replay_buffer: Any
    workers: list[Any]
    evaluators: list[Any]  # rollout workers that play evaluation episodes only
    tasks: tuple[str, ...]  # the tasks episodes are drawn from

    def all(self) -> dict[str, Any]:
        """Every actor by name."""
        workers = {f"rollout_worker_{i}": w for i, w in enumerate(self.workers)}
        evaluators = {f"evaluator_{i}": w for i, w in enumerate(self.evaluators)}
        return {**self.traced(), "replay_buffer": self.replay_buffer, **workers, **evaluators}

    def traced(self) -> dict[str, Any]:
        """The executors that record spans."""
        return {"trainer": self.trainer, "inference_service": self.inference_service}

    def receivers(self) -> dict[str, Any]:
        """Weight-sync receivers by name."""
        return {"inference_service": self.inference_service}


def start_ray(cfg: Config) -> None:
    """Join ``cfg.ray.address`` or start an embedded single-node Ray on loopback."""
    if ray.is_initialized():
        return
    if cfg.ray.address is not None:
        ray.init(address=cfg.ray.address, log_to_driver=True)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=cfg.ray.num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
    )


def place_executors(cfg: Config) -> Executors:
    """Create the generator, rewarder and trainer actors.

    Actors reserve no Ray CPUs: each sets its own torch thread count, and fractional reservations
    on a 2-CPU node can leave a later task unschedulable.
    """
    actor = ray.remote(num_cpus=0, max_restarts=0)
    return Executors(
        generator=actor(Generator).options(name=None).remote(cfg),
        rewarder=actor(Rewarder).remote(cfg),
        trainer=actor(Trainer).remote(cfg),
    )


def pick_transport(requested: str, trainer_node: str, receiver_nodes: list[str]) -> str:
    """The weight-sync transport for a placement: shm on one host, dist across hosts."""
    one_host = all(node == trainer_node for node in receiver_nodes)
    if requested == "auto":
        return "shm" if one_host else "dist"
    if requested == "shm" and not one_host:
        raise ValueError(
            "sync.transport=shm needs the trainer and its receivers on one host; "
            "they were placed on different nodes: use sync.transport=dist or auto"
        )
    return requested


def connect_weight_sync(cfg: Config, ex: Executors | EmbodiedExecutors) -> str:
    """Open the trainer's publisher for the run's receivers, rendezvous all, return the
    transport."""
    receivers = ex.receivers()
    (trainer_node, trainer_ip), *nodes = ray.get(
        [ex.trainer.node.remote(), *(h.node.remote() for h in receivers.values())]
    )
    transport = pick_transport(cfg.sync.transport, trainer_node, [node for node, _ in nodes])
    address = ray.get(ex.trainer.open_sync.remote(transport, list(receivers), trainer_ip))
    ray.get([h.open_sync.remote(address, name) for name, h in receivers.items()])
    ray.get(
        [ex.trainer.connect_sync.remote(), *(h.connect_sync.remote() for h in receivers.values())]
    )
    return transport


def stop_executors(executors: Executors | EmbodiedExecutors) -> None:
    """Kill the actors of a run (the Ray instance stays up for the next run).

    The rewarder is asked first to stop its scoring processes, and the trainer to close its
    weight-sync publisher (shm files in /dev/shm), which a kill would leave behind.
    """
    closing = [executors.trainer.close_sync.remote()]
    if isinstance(executors, Executors):
        closing.append(executors.rewarder.close.remote())
    for ref in closing:
        with contextlib.suppress(Exception):  # it may already be dead; the kill below still runs
            ray.get(ref, timeout=30)
    for handle in executors.all().values():
        ray.kill(handle)


# The instruction every observation carries in an instruction-blind control run (env.blind).
BLIND_INSTRUCTION = "go to the object"


class BlindEnv:
    """``env`` with every instruction replaced by ``BLIND_INSTRUCTION``: the control run that shows
    how much of a policy's success comes from reading the instruction."""

    def __init__(self, env: EmbodiedEnv):
        self.env = env
        self.action_space = env.action_space
        self.tasks = env.tasks

    def reset(self, *, task: str | None = None, seed: int | None = None) -> Observation:
        """Start an episode of the wrapped env."""
        return dataclasses.replace(
            self.env.reset(task=task, seed=seed), instruction=BLIND_INSTRUCTION
        )

    def step(self, action: np.ndarray | int) -> StepResult:
        """Step the wrapped env."""
        result = self.env.step(action)
        obs = dataclasses.replace(result.obs, instruction=BLIND_INSTRUCTION)
        return dataclasses.replace(result, obs=obs)

    def close(self) -> None:
        """Close the wrapped env."""
        self.env.close()


def _babyai(ec: EnvConfig, seed: int) -> EmbodiedEnv:
    from relayrl.envs.babyai import BabyAIEnv

    return BabyAIEnv(
        ec.tasks,
        image_size=ec.image_size,
        distractor_fails=ec.distractor_fails,
        max_steps=ec.max_steps,
        seed=seed,
    )


def _metaworld(ec: EnvConfig, seed: int) -> EmbodiedEnv:
    from relayrl.envs.metaworld import MetaWorldEnv

    tasks = "MT10" if ec.tasks == ["MT10"] else ec.tasks
    return MetaWorldEnv(tasks, image_size=ec.image_size, max_steps=ec.max_steps, seed=seed)


def _libero(ec: EnvConfig, seed: int) -> EmbodiedEnv:
    from relayrl.envs.libero import LiberoEnv

    return LiberoEnv(ec.suite, image_size=ec.image_size, max_steps=ec.max_steps, seed=seed)


ENVS: dict[str, Callable[[EnvConfig, int], EmbodiedEnv]] = {
    "babyai": _babyai,
    "metaworld": _metaworld,
    "libero": _libero,
}


def build_env(ec: EnvConfig, seed: int) -> EmbodiedEnv:
    """The env ``ec`` names, seeded, with the blind and latency wrappers it asks for."""
    env = ENVS[ec.name](ec, seed)
    if ec.blind:
        env = BlindEnv(env)
    if ec.latency != "none":
        env = LatencyEnv(
            env, dist=ec.latency, mean_ms=ec.latency_mean_ms, sigma=ec.latency_sigma, seed=seed
        )
    return env


class TaskSampler:
    """A rollout worker's choice of task at each reset: weighted draws, uniform until the
    controller pushes dynamic weights (``set_task_weights``)."""

    def __init__(self, tasks: Sequence[str], seed: int):
        self.tasks = list(tasks)
        self.weights = [1.0] * len(self.tasks)
        self._rng = random.Random(seed)

    def __call__(self) -> str:
        return self._rng.choices(self.tasks, self.weights)[0]


def set_task_weights(worker: RolloutWorker, weights: list[float]) -> None:
    """Run inside a worker actor (``worker.__ray_call__.remote(set_task_weights, w)``): give its
    task sampler new weights; one attribute assignment, safe while ``run`` loops."""
    worker.task_sampler.weights = weights


class ServiceClient:
    """What a rollout worker actor calls for an action: the inference-service actor, blocking."""

    def __init__(self, service: Any):
        self.service = service

    def __call__(self, obs: Observation) -> ActReply:
        return ray.get(self.service.act.remote(obs))


class BufferSink:
    """Where a rollout worker actor puts its segments: the replay-buffer actor."""

    def __init__(self, buffer: Any):
        self.buffer = buffer

    def __call__(self, segment: Any) -> None:
        ray.get(self.buffer.put.remote(segment))


def vla_config(cfg: Config, views: int, dims: int, vocab: int) -> VLAConfig:
    """The VLA policy's sizes: ``cfg.vla`` plus what the env decides (views, action tokens)."""
    return VLAConfig(
        image_size=cfg.env.image_size,
        views=views,
        action_dims=dims,
        action_vocab=vocab,
        **cfg.vla.model_dump(),
    )


def place_embodied(cfg: Config, make_env: Callable[[int], EmbodiedEnv]) -> EmbodiedExecutors:
    """Create the trainer, inference service, replay buffer, rollout workers and evaluators.

    One env is built here first to learn its views, action space and tasks. Each worker gets its
    own seed and a factory it rebuilds its env with after a crash. Evaluators are rollout workers
    of their own seeds, so evaluation episodes are never trained on; in an evaluator a whole
    episode is one segment.
    """
    probe = make_env(cfg.run.seed)
    try:
        views = probe.reset().image.shape[0]
        space, tasks = probe.action_space, tuple(probe.tasks)
    finally:
        probe.close()
    if cfg.env.name == "libero" and cfg.env.tasks:
        unknown = sorted(set(cfg.env.tasks) - set(tasks))
        if unknown:
            raise ValueError(f"env.tasks {unknown} are not tasks of {cfg.env.suite}: {tasks}")
        tasks = tuple(cfg.env.tasks)
    vla = vla_config(cfg, views, space.dims, space.vocab)
    actor = ray.remote(num_cpus=0, max_restarts=0)
    seed = cfg.run.seed

    def worker(i: int, seed: int, segment_len: int) -> Any:
        return (
            actor(RolloutWorker)
            .options(max_concurrency=2)  # stop(), stats(), task weights served while run() loops
            .remote(
                i,
                functools.partial(make_env, seed + 1000),
                segment_len=segment_len,
                seed=seed,
                task_sampler=TaskSampler(tasks, seed),
                max_consecutive_errors=cfg.rollout.max_consecutive_errors,
            )
        )

    workers = [worker(i, seed + 1 + i, cfg.rollout.segment_len) for i in range(cfg.rollout.workers)]
    evaluators = [worker(i, seed + 10**6 + i, 10**9) for i in range(cfg.env.eval_workers)]
    return EmbodiedExecutors(
        trainer=actor(VLATrainer).remote(cfg, vla),
        # Its initial weights are replaced by the trainer's version 0 before the first action.
        inference_service=actor(InferenceService).remote(
            VLAPolicy(vla),
            max_batch=cfg.inference.max_batch,
            max_wait_ms=cfg.inference.max_wait_ms,
            threads=cfg.ray.threads_per_executor,
            sync_timeout_s=cfg.sync.timeout_s,
        ),
        # Threaded: the trainer's blocking get must not hold up the workers' puts.
        replay_buffer=actor(ReplayBuffer)
        .options(max_concurrency=4)
        .remote(cfg.replay.capacity_steps, max_staleness=cfg.max_staleness),
        workers=workers,
        evaluators=evaluators,
        tasks=tasks,
    )
