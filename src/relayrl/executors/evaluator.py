"""Evaluation: one protocol per workload, played alike by in-run evaluations (the start, every
``log.eval_every`` steps, the end) and by ``relayrl eval RUN`` on the saved checkpoint, so the two
report the same numbers, task by task, for the same weights and seed.

LLM (``heldout_result``): greedy completions of the task's held-out split (fixed by the task's
seed), one per problem, scored by the rewarder; in a run by generator replica 0 (which serves the
trainer's newest weights when the run ends) and rewarder replica 0, in ``relayrl eval`` by the
same executors in process.

Embodied: the ``Evaluator`` plays whole episodes with its own copy of the policy and returns what
each did; in a run ``env.eval_workers`` of them (the ``evaluator`` role) share the episodes, in
``relayrl eval`` one plays them all. The protocol (``EvalProtocol``), fixed by the config and a
seed:

- the tasks are ``env.eval_tasks``, else the env's tasks; the episodes are ``env.eval_episodes``
  split over them in turn (task k plays ``n // T`` plus one for the first ``n % T`` tasks), or a
  given number per task;
- ``seeded`` (every env but LIBERO): episode i of a task is ``reset(task, seed=S + i)`` with
  ``S = seed * SEED_STRIDE``, under the env's own episode limit;
- ``libero`` (LIBERO's own evaluation, as OpenVLA runs it): episode i of a task starts from the
  task's benchmark init state i, after the env's wait steps, under the suite's step cap;
- actions are the most likely ones (``env.eval_greedy``) or sampled from a generator seeded with
  the episode's seed, so an episode's outcome depends on the weights, the task and i only: not on
  which evaluator plays it, in which order, or in which process;
- the env is the run's without its simulated latency; an env that raises ends its episode as a
  failure, counted in ``env_errors``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.config import Config
from relayrl.envs.embodied import EmbodiedEnv
from relayrl.executors.worker_side import build_env
from relayrl.models.vla import VLAConfig, VLAPolicy
from relayrl.types import EvaluatorStats

PROTOCOLS = ("libero", "seeded")
SEED_STRIDE = 100_003  # the episodes of two protocol seeds never meet
LIBERO_EPISODES = 50  # init states per LIBERO task: the most episodes a task can play


@dataclass(frozen=True)
class EvalEpisode:
    """One episode of the protocol: ``task``, its index ``i`` within the task, and the seed its
    reset and its sampled actions use."""

    task: str
    i: int
    seed: int
    init_state: int | None  # libero: the benchmark init state it starts from


@dataclass(frozen=True)
class Outcome:
    """What one evaluation episode did."""

    task: str
    i: int
    success: bool
    steps: int
    error: str | None = None  # the env's error, if it raised


@dataclass(frozen=True)
class EvalProtocol:
    """Which episodes an evaluation plays and how it chooses actions (see the module
    docstring)."""

    name: str
    seed: int
    greedy: bool
    tasks: tuple[str, ...]
    episodes: tuple[int, ...]  # per task, in the order of ``tasks``

    @classmethod
    def of(
        cls,
        cfg: Config,
        env_tasks: Sequence[str],
        *,
        seed: int | None = None,
        greedy: bool | None = None,
        tasks: Sequence[str] | None = None,
        episodes: int | None = None,
        name: str | None = None,
    ) -> EvalProtocol:
        """The run's protocol (``seed`` None: ``run.seed``; ``greedy`` None: ``env.eval_greedy``;
        ``tasks`` None: ``env.eval_tasks``, else ``env_tasks``; ``episodes`` None:
        ``env.eval_episodes`` split over the tasks, else that many per task)."""
        name = protocol_name(cfg, name)
        chosen = list(tasks or cfg.env.eval_tasks or env_tasks)
        unknown = [t for t in chosen if t not in env_tasks]
        if unknown:
            raise ValueError(f"tasks {unknown} are not tasks of this env; allowed: {env_tasks}")
        if episodes is not None and episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {episodes}")
        n, k = cfg.env.eval_episodes, len(chosen)
        counts = [episodes] * k if episodes else [n // k + (j < n % k) for j in range(k)]
        if name == "libero" and max(counts) > LIBERO_EPISODES:
            raise ValueError(
                f"episodes must be <= {LIBERO_EPISODES} per task under the libero protocol (a "
                f"task has {LIBERO_EPISODES} init states), got {max(counts)}"
            )
        return cls(
            name=name,
            seed=cfg.run.seed if seed is None else seed,
            greedy=cfg.env.eval_greedy if greedy is None else greedy,
            tasks=tuple(chosen),
            episodes=tuple(counts),
        )

    def plan(self) -> list[EvalEpisode]:
        """Every episode, task by task."""
        base = self.seed * SEED_STRIDE
        return [
            EvalEpisode(task, i, base + i, i if self.name == "libero" else None)
            for task, count in zip(self.tasks, self.episodes, strict=True)
            for i in range(count)
        ]

    def deal(self, players: int) -> list[list[EvalEpisode]]:
        """The episodes dealt in turn to ``players`` evaluators."""
        plan = self.plan()
        return [plan[p::players] for p in range(players)]

    def report(self, outcomes: Sequence[Outcome]) -> dict[str, Any]:
        """Per-task episodes, successes, success rate and mean steps; the mean over tasks."""
        tasks: dict[str, Any] = {}
        for task in self.tasks:
            mine = [o for o in outcomes if o.task == task]
            if not mine:
                continue
            tasks[task] = {
                "episodes": len(mine),
                "successes": sum(o.success for o in mine),
                "success_rate": sum(o.success for o in mine) / len(mine),
                "mean_steps": sum(o.steps for o in mine) / len(mine),
            }
        rates = [t["success_rate"] for t in tasks.values()]
        return {
            "protocol": self.name,
            "seed": self.seed,
            "greedy": self.greedy,
            "tasks": tasks,
            "success_rate": sum(rates) / max(len(rates), 1),
            "episodes": len(outcomes),
            "env_errors": sum(o.error is not None for o in outcomes),
        }


class Evaluator:
    """Plays evaluation episodes (``play``) in one env with its own copy of the policy.

    ``make_env`` builds the env (again after an error); ``vla`` sizes the policy; ``threads``
    sets torch's intra-op threads (None leaves torch's setting). A Ray actor in a run, a plain
    object in ``relayrl eval``.
    """

    name = "evaluator"

    def __init__(
        self, make_env: Callable[[], EmbodiedEnv], vla: VLAConfig, threads: int | None = None
    ):
        if threads is not None:
            torch.set_num_threads(threads)
        self.make_env = make_env
        self.env = make_env()
        self.policy = VLAPolicy(vla).eval()
        self.played = 0

    def play(
        self,
        episodes: Sequence[EvalEpisode],
        greedy: bool,
        policy: Mapping[str, Any] | None = None,
    ) -> list[Outcome]:
        """Play ``episodes``, first loading ``policy`` if given (``{"version": int, "weights":
        state dict}``, as ``policy_weights`` returns it); what each did, in order."""
        if policy is not None:
            self.policy.load_state_dict(policy["weights"])
        return [self._episode(e, greedy) for e in episodes]

    def _episode(self, episode: EvalEpisode, greedy: bool) -> Outcome:
        generator = torch.Generator().manual_seed(episode.seed)
        options = {} if episode.init_state is None else {"init_state": episode.init_state}
        steps = 0
        try:
            obs = self.env.reset(task=episode.task, seed=episode.seed, **options)
            while True:
                with torch.no_grad():
                    actions, _, _ = self.policy.act(
                        torch.from_numpy(obs.image[None]),
                        [obs.instruction],
                        torch.tensor([obs.step]),
                        greedy=greedy,
                        generator=generator,
                    )
                result = self.env.step(self.env.action_space.to_env(actions[0].numpy()))
                steps += 1
                if result.terminated or result.truncated:
                    break
                obs = result.obs
        except Exception as err:  # a crashed simulator fails the episode, not the evaluation
            with contextlib.suppress(Exception):
                self.env.close()
            self.env = self.make_env()
            self.played += 1
            return Outcome(episode.task, episode.i, False, steps, f"{type(err).__name__}: {err}")
        self.played += 1
        return Outcome(episode.task, episode.i, bool(result.success), steps)

    def stats(self) -> EvaluatorStats:
        """Episodes played since the start."""
        return EvaluatorStats(episodes=self.played)

    def close(self) -> None:
        """Release the env."""
        self.env.close()


def protocol_name(cfg: Config, name: str | None = None) -> str:
    """``name`` checked against the run's env (None: libero for LIBERO runs, else seeded)."""
    name = name or ("libero" if cfg.env.name == "libero" else "seeded")
    if name not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {list(PROTOCOLS)}, got {name!r}")
    if name == "libero" and cfg.env.name != "libero":
        raise ValueError(
            f"protocol 'libero' needs env.name=libero; this run's env is {cfg.env.name!r}"
        )
    return name


def eval_env(cfg: Config, protocol: str, seed: int) -> Callable[[], EmbodiedEnv]:
    """The factory of the env an evaluation under ``protocol`` plays: the run's env without its
    latency (libero: under the suite's step cap)."""
    update: dict[str, Any] = {"latency": "none"}
    if protocol == "libero":
        update["max_steps"] = None
    return functools.partial(build_env, cfg.env.model_copy(update=update), seed)


def heldout_result(task: str, score: dict[str, Any], version: int | None, time_s: float) -> dict:
    """The LLM protocol's result: held-out accuracy (the rewarder's mean reward over the
    greedy completions, ``score`` its summary), overall and under the task's name, with the
    policy ``version`` and what it took."""
    accuracy, n = score["reward_mean"], score["samples"]
    return {
        "accuracy": accuracy,
        "n": n,
        "version": version,
        "time_s": time_s,
        "per_task": {task: {"n": n, "accuracy": accuracy}},
    }
