"""What a rollout worker actor holds, free of torch so that a worker starts without it: the env
factory (``ENVS``, ``build_env``, the instruction-blind wrapper), its task sampler, and the
handles through which it calls the inference service, the replay buffer, a world-model service
and the world-model trainer; also the functions the controller runs inside actors with
``__ray_call__`` (Ray imports such a function's module in the actor: a function defined in
``launch`` or a workload would import torch into every worker and buffer).
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from relayrl.config import EnvConfig
from relayrl.envs.embodied import EmbodiedEnv, Observation, StepResult
from relayrl.envs.latency import LatencyEnv
from relayrl.types import ActReply

if TYPE_CHECKING:
    from relayrl.executors.rollout_worker import RolloutWorker


# The instruction every observation carries in an instruction-blind control run (env.blind).
BLIND_INSTRUCTION = "go to the object"


class BlindEnv:
    """``env`` with every instruction replaced by ``BLIND_INSTRUCTION``: the control run that shows
    how much of a policy's success comes from reading the instruction."""

    def __init__(self, env: EmbodiedEnv):
        self.env = env
        self.action_space = env.action_space
        self.tasks = env.tasks

    def reset(
        self, *, task: str | None = None, seed: int | None = None, **options: Any
    ) -> Observation:
        """Start an episode of the wrapped env (``options``: what its ``reset`` also takes)."""
        return dataclasses.replace(
            self.env.reset(task=task, seed=seed, **options), instruction=BLIND_INSTRUCTION
        )

    def __getattr__(self, name: str) -> Any:
        """What else the wrapped env offers (its step cap, its init states)."""
        if name.startswith("__") or name == "env":  # unpickling asks before env is set
            raise AttributeError(name)
        return getattr(self.env, name)

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
        view=ec.view,
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

    def state_dict(self) -> dict:
        """The weights and the random state, for a run checkpoint."""
        return {"weights": list(self.weights), "rng": self._rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.weights = list(state["weights"])
        self._rng.setstate(state["rng"])


def set_worker_id(worker: RolloutWorker, worker_id: int) -> None:
    """Run inside a rollout worker actor: the id its segments carry from now on."""
    worker.worker_id = worker_id


def node_of(actor: Any) -> tuple[str, str]:
    """Run inside any actor (``actor.__ray_call__.remote(node_of)``): its Ray node id and IP.
    Here, not in ``launch``, because Ray imports a called function's module in the actor."""
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def set_task_weights(worker: RolloutWorker, weights: list[float]) -> None:
    """Run inside a worker actor (``worker.__ray_call__.remote(set_task_weights, w)``): give its
    task sampler new weights; one attribute assignment, safe while ``run`` loops."""
    worker.task_sampler.weights = weights


class ServiceClient:
    """What a rollout worker actor calls for an action: the inference-service actor, blocking;
    the request names the worker and carries its env steps so far."""

    def __init__(self, service: Any):
        self.service = service

    def __call__(
        self, obs: Observation, worker: int, env_steps: int, seed: int | None = None
    ) -> ActReply:
        return ray.get(self.service.act.remote(obs, worker, env_steps, seed))

    def act_many(
        self, observations: list[Observation], worker: int, env_steps: int
    ) -> list[ActReply]:
        """The replies to ``observations``: one call each, all in flight at once."""
        return ray.get([self.service.act.remote(o, worker, env_steps) for o in observations])


class BufferSink:
    """Where a rollout worker actor puts its segments: the replay-buffer actor. After a put that
    leaves the buffer at its ``wait_at``, the worker waits for room (``wait_for_room``)."""

    POLL_S = 0.5  # how often a waiting worker looks at its stop flag

    def __init__(self, buffer: Any):
        self.buffer = buffer
        self.full = False

    def __call__(self, segment: Any) -> None:
        self.put_many([segment])

    def put_many(self, segments: list[Any]) -> None:
        """Put ``segments`` in one call, in order."""
        self.full = ray.get(self.buffer.put_many.remote(segments))

    def wait_for_room(self, stop: threading.Event) -> None:
        """After a put that filled the buffer to its ``wait_at``: wait until it has room again
        or ``stop`` is set."""
        while self.full and not stop.is_set():
            self.full = not ray.get(self.buffer.wait_for_room.remote(self.POLL_S))


class WorldModelClient:
    """What a rollout worker's ``WorldModelEnv``s step through: a world-model service replica.
    A request returns its reply's future at once, so every imagined env's request of a round is
    in flight together and the replica batches them."""

    def __init__(self, service: Any):
        self.service = service

    def submit(self, request: Any) -> Future:
        """Send ``request`` (a ``WMRequest``); the future of its ``WMReply``."""
        return self.service.act.remote(request).future()


class EpisodeSink:
    """Where a rollout worker hands its real episodes: the world-model trainer's ``B_wm``."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def __call__(self, episodes: list[Any]) -> None:
        ray.get(self.trainer.add_episodes.remote(episodes))


def policy_weights(trainer: Any) -> dict[str, Any]:
    """Run inside every trainer rank (``rank.__ray_call__.remote(policy_weights)``): its version
    and the policy's full weights, what ``save_pretrained`` writes (in a sharded group gathered
    onto rank 0, a collective: call it on every rank and take rank 0's)."""
    return {"version": trainer.version, "weights": trainer._full_model_state()}
