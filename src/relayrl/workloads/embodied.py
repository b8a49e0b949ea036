"""The embodied workload (AcceRL): rollout workers step one env each and ask inference-service
replicas for actions; segments reach the trainer group (sync: collected in lockstep; async:
streamed through the replay buffer), which recomputes values and GAE and applies GIPO.

With ``imagination.episodes_per_real > 0`` (AcceRL-WM, async mode) the world-model roles join
(``relayrl.workloads.embodied_world_model``): each worker hands its real episodes to ``B_wm`` and
steps ``WorldModelEnv`` slots beside its real envs (``relayrl.executors.imagination``), their
segments going to ``B_img``; every super-batch takes ``imagination.real_ratio`` of its env steps
from the replay buffer and the rest from ``B_img``; after every policy step the world-model
trainer runs its round (T_obs, T_reward) beside the loop. Imagined env steps keep books of
their own, as real ones do: generated (put into ``B_img``) = trained + dropped (stale, overflow)
+ in flight (resident, prefetched).

Samples are env steps; ``relayrl.workloads.embodied_summary`` keeps their books and writes the
summary's sections.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

import ray

from relayrl.channels.act_socket import SocketServiceClient
from relayrl.config import Config
from relayrl.envs.embodied import EmbodiedEnv
from relayrl.executors.inference_service import InferenceService
from relayrl.executors.replay_buffer import ReplayBuffer
from relayrl.executors.rollout_worker import Collected, RolloutWorker
from relayrl.executors.vla_trainer import VLATrainer
from relayrl.executors.worker_side import ServiceClient, TaskSampler, build_env, set_worker_id
from relayrl.launch import form_trainer_group, publish_weights
from relayrl.models.vla import VLAPolicy, vla_config
from relayrl.observability.books import Books
from relayrl.observability.metrics import MetricsLog, RunTally, say
from relayrl.recovery import Recovery, alive
from relayrl.roles import Group, Placed, Role, ray_resources
from relayrl.types import LoopEnd
from relayrl.workloads import embodied_eval
from relayrl.workloads.embodied_summary import EmbodiedStats, books, summary_sections
from relayrl.workloads.embodied_world_model import EmbodiedWorldModel
from relayrl.workloads.retired_workers import RetiredWorkers
from relayrl.workloads.saved_models import check_saved_vla
from relayrl.workloads.task_choice import TaskChoice

SERVICE_SEED = 2 * 10**6  # inference replica i samples actions from seed run.seed + this + i


class EmbodiedWorkload:
    """Roles ``trainer`` (ranks), ``inference_service`` (replicas), ``replay_buffer``,
    ``rollout_worker`` and ``evaluator`` (``embodied_eval``: players of evaluation episodes with a
    copy of the policy, never trained on)."""

    family = "segments"  # fed by controller.run_lockstep / run_streaming: act -> step -> train

    def __init__(self, cfg: Config, make_env: Callable[[int], EmbodiedEnv] | None = None):
        self.cfg = cfg
        # seed -> env; replaces the env that cfg.env describes
        self.make_env = make_env or functools.partial(build_env, cfg.env)
        self.env_given = make_env is not None  # the evaluators play it too
        self.placed = Placed()  # the role table once placed
        self.retired = RetiredWorkers(cfg.rollout.workers)  # dead workers' books, workers' ids
        self.recovery: Recovery | None = None  # set once weight sync is connected
        self.run_dir = None  # set by relayrl.job.train
        self.wm: EmbodiedWorldModel | None = None  # with imagination, once placed
        greedy = "greedy" if cfg.env.eval_greedy else "sampled"
        self.legend = {"eval_label": f"evaluation success ({greedy})"}

    def place(self) -> None:
        """Place the role table (``table``); rollout workers are spread over the inference
        replicas in turn.

        One env is built here first to learn its views, action space and tasks. Each worker gets
        its own seed and a factory it rebuilds its env with after a crash.
        """
        cfg = self.cfg
        probe = self.make_env(cfg.run.seed)
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
        self.tasks = tasks
        vla = vla_config(
            cfg.vla, image_size=cfg.env.image_size, views=views, dims=space.dims, vocab=space.vocab
        )
        if cfg.vla.path is not None:
            check_saved_vla(cfg.vla.path, vla)
        self.vla = vla
        if cfg.imagination is not None:
            self.wm = EmbodiedWorldModel(cfg, views=views, dims=space.dims, vocab=space.vocab)
        self.choice = TaskChoice(cfg, tasks)
        self.placed = Placed.place(cfg.placement, self.table())
        form_trainer_group(self.trainer)
        if self.wm is not None:
            self.wm.wire(self.placed)

    def table(self) -> list[Role]:
        """The role table (once ``place`` has probed the env): the trainer ranks, the inference
        replicas (they receive the weights), the replay buffer, the rollout workers and the
        evaluators, and with imagination the world-model trainer, its replicas (they receive its
        weights) and ``B_img``. Inference replicas, workers and evaluators are replaced; a
        replacement samples from seeds of its own, and a worker's gets an id of its own."""
        cfg = self.cfg
        ranks, replicas = cfg.trainer.ranks, cfg.inference.replicas
        trainer = ray_resources(cfg.trainer.resources)
        rollout = ray_resources(cfg.rollout.resources)
        # Threaded: a blocking get must not hold up the workers' puts, nor workers waiting for
        # room (one thread each) the get that makes room.
        waiting = cfg.rollout.workers if cfg.replay.wait_at is not None else 0
        worker_state = "counters, reset seeds, task sampler (not the episode in progress)"
        rows = [
            Role(
                "trainer",
                VLATrainer,
                ranks,
                lambda r, _: ((cfg, self.vla), {"rank": r, "world": ranks}),
                **trainer,
                keeps="model, optimizer, schedule, version, RNG (each rank writes its own part)",
                saved="own_files",
                traced=True,
                close="close_sync",
            ),
            Role(
                "inference_service",
                InferenceService,
                replicas,
                self._service,
                **ray_resources(cfg.inference.resources),
                receives="trainer",
                replaced=True,
                keeps="sampling generator",
                saved="state_dict",
                traced=True,
            ),
            Role(
                "replay_buffer",
                ReplayBuffer,
                1,
                lambda i, k: (
                    (cfg.replay.capacity_steps,),
                    {"max_staleness": cfg.max_staleness, "wait_at": cfg.replay.wait_at},
                ),
                **trainer,
                keeps="its segments and books",
                saved="state_dict",
                options={"max_concurrency": 4 + waiting},
            ),
            Role(
                "rollout_worker",
                RolloutWorker,
                cfg.rollout.workers,
                self._worker,
                **rollout,
                replaced=True,
                keeps=worker_state,
                saved="state_dict",
                options={"max_concurrency": 2},  # stop(), stats()
                renew=self._renew_worker,
            ),
            embodied_eval.evaluator_role(self),
        ]
        return rows + (self.wm.table() if self.wm is not None else [])

    @property
    def trainer(self) -> Group:
        """The trainer ranks."""
        return self.placed["trainer"]

    @property
    def services(self) -> Group:
        """The inference replicas."""
        return self.placed["inference_service"]

    @property
    def workers(self) -> Group:
        """The rollout workers."""
        return self.placed["rollout_worker"]

    @property
    def evaluators(self) -> Group:
        """The evaluators (``relayrl.executors.evaluator.Evaluator``)."""
        return self.placed["evaluator"]

    @property
    def replay_buffer(self) -> Any:
        """The replay buffer (None before placement)."""
        found = self.placed["replay_buffer"]
        return found[0] if len(found) else None

    def _service(self, i: int, incarnation: int) -> tuple[tuple, dict[str, Any]]:
        """Inference replica ``i``'s constructor arguments; its initial weights are replaced by
        the trainer's before any action. Its ``incarnation``-th replacement samples from seeds of
        its own."""
        cfg = self.cfg
        return (VLAPolicy(self.vla),), {
            "max_batch": cfg.inference.max_batch,
            "max_wait_ms": cfg.inference.max_wait_ms,
            "threads": cfg.ray.threads_per_executor,
            "sync_timeout_s": cfg.sync.timeout_s,
            "early_drain": cfg.experiment.early_drain,
            "seed": cfg.run.seed + SERVICE_SEED + i + incarnation * cfg.inference.replicas,
        }

    def _worker(self, i: int, incarnation: int) -> tuple[tuple, dict[str, Any]]:
        """Rollout worker ``i``'s constructor arguments, with its own seeds and worker id; its
        ``incarnation``-th replacement gets an id and seeds of its own."""
        cfg = self.cfg
        worker_id = i + incarnation * cfg.rollout.workers
        seed = cfg.run.seed + 1 + worker_id
        return (worker_id, functools.partial(self.make_env, seed + 1000)), {
            "segment_len": cfg.rollout.segment_len,
            "seed": seed,
            "envs": cfg.rollout.envs_per_worker,
            "task_sampler": TaskSampler(self.tasks, seed),
            "max_consecutive_errors": cfg.rollout.max_consecutive_errors,
            "env_threads": cfg.rollout.env_threads,
        }

    def _renew_worker(self, worker: Any, index: int, incarnation: int) -> None:
        """A replaced rollout worker goes on under its new id, drawing tasks as the others do."""
        self.retired.renew(index, incarnation)
        ray.get(self.choice.push([worker]))

    async def retire(self, index: int) -> int | None:
        """Keep dead rollout worker ``index``'s books (``RetiredWorkers.retire``); returns the
        env steps it took that no books count."""
        return await self.retired.retire(index, self.replay_buffer, self.service_of(index))

    async def revive(self, recovery: Recovery, err: BaseException) -> None:
        """After a lockstep round failed with ``err``: replace the inference replicas and rollout
        workers that died (a worker that lived keeps its observation and open segment, taken
        under the same weights); re-raise ``err`` when none died."""
        dead = [(self.services, s) for s, a in enumerate(self.services) if not await alive(a)]
        dead += [(self.workers, i) for i, a in enumerate(self.workers) if not await alive(a)]
        if not dead:
            raise err
        for group, i in dead:
            unfinished = await self.retire(i) if group is self.workers else 0
            await recovery.replace(group, i, err, unfinished=unfinished)

    def note(self, collected: Sequence[Collected]) -> None:
        """Remember the workers' books as of the last segment each collected in lockstep."""
        self.retired.note(collected)

    def service_of(self, worker: int) -> Any:
        """The inference replica that answers rollout worker ``worker``."""
        return self.services[worker % len(self.services)]

    def service_client(self, worker: int) -> ServiceClient | SocketServiceClient:
        """What rollout worker ``worker`` calls for an action in async mode: its replica's
        socket (Ray calls from another node), or Ray calls (``experiment.inference_transport``)."""
        if self.cfg.experiment.inference_transport == "socket":
            return SocketServiceClient(self.service_of(worker))
        return ServiceClient(self.service_of(worker))

    def groups(self) -> list[Group]:
        """Every role group, in table order."""
        return self.placed.all()

    def receivers(self) -> dict[str, Any]:
        """Every inference replica receives the weights."""
        return self.placed.receivers()

    async def snapshot(self) -> dict[str, Any]:
        """For a run checkpoint: the state of every role the table saves through the controller
        (inference and world-model replicas, buffers, workers, evaluators, the world-model
        trainer) by executor name, the task choice (DWR, curriculum) and the dead workers'
        books. It changes nothing: ``settle`` and ``realign`` go around it."""
        parts = await self.placed.snapshot()
        parts["task_choice"] = self.choice.state_dict()
        parts["retired_workers"] = self.retired.state_dict()
        return parts

    async def settle(self) -> None:
        """Before a checkpoint: end the world-model round in progress, so the world-model
        trainer holds still while it is saved."""
        await self.finish_world_model()

    async def realign(self, parts: dict[str, Any]) -> None:
        """After a checkpoint: reload each rollout worker from the state ``parts`` holds for it.
        That state leaves out the episode in progress, so the run goes on exactly as a resume
        from this checkpoint would, each worker starting a fresh episode from the seed the
        checkpoint records."""
        workers = self.workers.named()
        await asyncio.gather(*(w.load_state_dict.remote(parts[n]) for n, w in workers.items()))
        await asyncio.gather(*self._report_loaded(parts))

    def restore(self, parts: dict[str, Any]) -> None:
        """Load what ``snapshot`` saved."""
        self.placed.restore(parts)
        self.choice.load_state_dict(parts["task_choice"])
        # A worker goes on under the id its books were kept by (a replacement's is not i).
        self.retired.load_state_dict(parts["retired_workers"])
        ray.get(
            [
                w.__ray_call__.remote(set_worker_id, worker_id)
                for w, worker_id in zip(self.workers, self.retired.ids, strict=True)
            ]
        )
        ray.get(self._report_loaded(parts))
        if self.wm is not None:  # the replicas serve the world model the checkpoint holds
            self.wm.serve()

    def _report_loaded(self, parts: dict[str, Any]) -> list:
        """Tell each rollout worker's inference replica the env steps the worker was loaded with
        from ``parts``: the load dropped its open segment's steps, which its replica would count
        (and a fresh replica knows nothing of it) if it died before its next request."""
        return [
            self.service_of(i).report.remote(worker_id, parts[name]["counts"]["env_steps"])
            for i, (name, worker_id) in enumerate(
                zip(self.workers.names, self.retired.ids, strict=True)
            )
        ]

    async def prefetched(self, tally: RunTally) -> tuple[int, int | None]:
        """Real and imagined env steps the buffers handed out that no trainer rank has received
        yet (a fetch ahead; imagined None without imagination), less those ``tally`` books as
        dropped at a resume; only exact while no worker puts."""
        ranks = await asyncio.gather(*(r.stats.remote() for r in self.trainer))
        buffer = await self.replay_buffer.stats.remote()
        real = buffer.unreceived(ranks, booked=tally.dropped_resume)
        return real, (await self.wm.unreceived(ranks, tally) if self.wm is not None else None)

    def buffers(self) -> list[Any]:
        """The replay buffer, and ``B_img`` with imagination."""
        return [self.replay_buffer, *([self.wm.buffer] if self.wm is not None else [])]

    def fetch(self, version: int) -> list[Any]:
        """Refs to the next super-batch's parts for a trainer at ``version``: the real segments
        (``replay.batch_steps``, or ``imagination.real_ratio`` of it), then the imagined ones."""
        steps = self.cfg.replay.batch_steps
        if self.wm is not None:
            return self.wm.fetch(self.replay_buffer, steps, version)
        return [self.replay_buffer.get.remote(steps, version)]

    async def after_step(self, step: int) -> dict[str, float]:
        """After policy step ``step``: the world-model round (``EmbodiedWorldModel.after_step``)."""
        return await self.wm.after_step(step) if self.wm is not None else {}

    async def finish_world_model(self) -> dict[str, float]:
        """Wait for the world-model round in progress (if any) and publish its version."""
        return await self.wm.finish() if self.wm is not None else {}

    def prepare(self, log: MetricsLog) -> dict:
        """Publish version 0, check ``env.eval_tasks``, evaluate, and give the workers their
        first task weights."""
        cfg = self.cfg
        ray.get(publish_weights(self.trainer, self.receivers()))
        if self.wm is not None:  # the replicas serve the world-model trainer's version 0 first
            self.wm.serve()
        if cfg.env.eval_tasks is not None:
            unknown = sorted(set(cfg.env.eval_tasks) - set(self.tasks))
            if unknown or not cfg.env.eval_tasks:
                raise ValueError(
                    f"env.eval_tasks={cfg.env.eval_tasks} must be a non-empty subset of the env's "
                    f"tasks {list(self.tasks)}; unknown: {unknown}"
                )
        say(f"evaluating {cfg.env.eval_episodes} episodes before RL")
        start = asyncio.run(self.evaluate())
        log.log(0, {f"eval/{k}": v for k, v in start.items() if k != "per_task"})
        ray.get(self.choice.push(self.workers))
        return {"eval": {"start": start}}

    async def evaluate(self) -> dict:
        """The run's evaluation protocol played with the trainer's current policy by the
        evaluators (``relayrl.workloads.embodied_eval``)."""
        return await embodied_eval.evaluate(self)

    async def episode_feedback(self, step: int) -> dict[str, float]:
        """Feed the workers' finished episodes to the task choice (``TaskChoice.feedback``)."""
        return await self.choice.feedback(self.workers, step)

    def finish(self, tally: RunTally, loop: LoopEnd, rl_wall: float) -> dict:
        """Evaluate again; the eval, dwr and curriculum sections, and the rollout, perf,
        staleness, replay and books sections (``embodied_summary.summary_sections``)."""
        end = asyncio.run(self.evaluate())
        return summary_sections(
            self.cfg, tally, self._stats(), self.retired.books, loop, rl_wall
        ) | {
            "eval": {"end": end},
            **self.choice.summary(),
        }

    def partial_books(self, tally: RunTally) -> dict[str, Books]:
        """The books of a run that stopped early, asked of the executors (the env steps are
        counted where they are played); raises if an executor does not answer."""
        found = self._stats(timeout=self.cfg.sync.timeout_s, whole=False)
        return books(tally, found, self.retired.books, found.unreceived(tally))

    def _stats(self, timeout: float | None = None, *, whole: bool = True) -> EmbodiedStats:
        """The executors' stats now: those the books need, and unless ``whole`` is false the
        inference and world-model replicas' and the world-model trainer's; raises if one does
        not answer within ``timeout`` seconds."""

        def get(refs: Any) -> Any:
            return ray.get(refs, timeout=timeout)

        wm = self.wm
        served = whole and wm is not None
        return EmbodiedStats(
            workers=get([w.stats.remote() for w in self.workers]),
            trainers=get([r.stats.remote() for r in self.trainer]),
            services=get([s.stats.remote() for s in self.services]) if whole else (),
            buffer=get(self.replay_buffer.stats.remote()),
            imagined_buffer=get(wm.buffer.stats.remote()) if wm is not None else None,
            world_model=get(wm.trainer[0].stats.remote()) if served else None,
            wm_services=get([s.stats.remote() for s in wm.services]) if served else (),
        )
