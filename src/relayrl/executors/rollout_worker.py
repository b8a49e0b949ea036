"""Rollout worker: steps its environments and cuts their episodes into trajectory segments.

The worker never runs the policy: it asks a service for each action (``run``, async mode, until
stopped; ``collect``, lockstep mode, one env, until it closes a segment). A segment ends
when the episode ends or after ``segment_len`` steps; a longer episode is emitted in pieces whose
images overlap by one observation (the last image of a piece is the first of the next).

In ``run`` a worker may step ``envs`` environments: it asks for all their actions in one request
(``act_many`` where the service has it) and steps them together, each on its own thread, so that
the round trips to the service, and the worker processes, are ``envs`` times fewer. Each env plays
its own episodes and fills its own segments; the books are the worker's. With ``env_threads``
off the envs are stepped one after another on the calling thread instead: cheaper for an env that
holds the GIL anyway (BabyAI's renderer is pure Python), but a simulator whose GL context belongs
to the thread that made it (MuJoCo's EGL renderer) needs a thread of its own per env. The segments
one round closes go to the sink together (``put_many`` where the sink has it): one call per round.

An environment that raises in ``reset`` or ``step`` does not stop the worker: the episode ends, the
steps of its unfinished segment are counted as ``dropped_error_steps``, the env is closed and built
anew, and the worker carries on. Every env step is accounted for:
``env_steps == segment_steps + dropped_error_steps + open_steps`` (open steps of every env).

With imagination (``set_imagination``, AcceRL-WM; ``relayrl.executors.imagination``) the worker
also steps ``WorldModelEnv`` slots in ``run``, beside its real envs and in the same rounds: their
observations go into the same act request, their episodes through the same segmenter. Their
segments are tagged ``imagined`` with the world-model version of their last step and go to
``B_img``; their steps are not env steps and count in the imagination's books only. The worker
keeps each real episode's frames and actions, and hands the episodes a round finished to its
imagination (for ``B_wm`` and the cache imagined episodes start from).

The worker's books leave it with every request for an action (``run`` and ``collect``: its id
and ``env_steps``), besides the segments it closes (each carries the worker's books, and
``collect``'s ``Collected`` the last one's): a controller then knows how many steps a worker
that died took after the last segment it closed (all but a step in flight at the death, one per
env, which only the dead process knew of).

As a Ray actor, create it with ``max_concurrency=2`` so that ``stop``, ``stats`` and
``episode_results`` can be called while ``run`` loops.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from relayrl.data.trajectories import Episode
from relayrl.envs.embodied import EmbodiedEnv, Observation, StepResult
from relayrl.types import (
    ActReply,
    ImaginedCounts,
    Segment,
    TaskCounts,
    WorkerStats,
    segment_arrays,
)

if TYPE_CHECKING:  # imagination needs torch; a worker without it never imports it
    from relayrl.executors.imagination import Imagination


@dataclass
class EpisodeResult:
    """How one finished episode went (per-task success rates and DWR weights use these)."""

    worker: int
    episode: int
    task: str
    success: bool
    episode_return: float  # sum of rewards
    length: int  # env steps


ACT_SEED_STRIDE = 1_000_003  # the action seeds of two workers meet only a million steps apart


@dataclass(frozen=True)
class Collected:
    """What one ``collect`` call closed, without the segments themselves: what the controller
    reads while it hands the segments on by reference."""

    worker: int  # the worker's id
    steps: int  # env steps in the segments closed
    worker_env_steps: int  # the worker's books as of its last closed segment
    worker_dropped_error: int


@dataclass
class _OpenSegment:
    """A segment being filled; ``images`` and ``steps`` always hold one entry more than actions."""

    images: list[np.ndarray]
    steps: list[int]
    actions: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @classmethod
    def starting_at(cls, obs: Observation) -> _OpenSegment:
        return cls(images=[_copy_image(obs)], steps=[obs.step])


@dataclass
class _Slot:
    """One env of a worker and the episode it is playing (``obs`` None: the next observe
    resets)."""

    env: _EnvThread | _EnvInline
    imagined: bool = False  # a WorldModelEnv: its steps are imagined, not env steps
    obs: Observation | None = None
    open: _OpenSegment | None = None
    episode: int = -1
    task: str = ""
    instruction: str = ""
    episode_return: float = 0.0
    length: int = 0
    seed: int = 0
    # The whole real episode, kept only with imagination (B_wm and the imagination cache take it).
    frames: list[np.ndarray] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


class RolloutWorker:
    """Envs stepped in the worker's own loop: ``run`` (all of them, until stopped) or ``collect``
    (the first, until it closes a segment).

    ``worker_id`` tags the segments and results. ``make_env`` builds an environment (again after a
    crash); ``envs`` is how many the worker steps (``collect`` uses the first only).
    ``segment_len`` is the most steps in one segment (L). ``seed`` seeds the stream of
    per-episode reset seeds; give each worker its own. ``task_sampler`` picks the task at each
    reset (None lets the env choose its first task); DWR plugs in here. After
    ``max_consecutive_errors`` env errors with no successful step in between the worker gives up
    and raises, since the env is broken rather than flaky. The last ``errors_kept`` error messages
    are kept for ``stats``; up to ``results_kept`` undrained episode results are kept.
    ``env_threads`` steps each env on a thread of its own (see the module docstring).
    """

    name = "rollout_worker"

    def __init__(
        self,
        worker_id: int,
        make_env: Callable[[], EmbodiedEnv],
        *,
        segment_len: int,
        seed: int,
        envs: int = 1,
        task_sampler: Callable[[], str] | None = None,
        max_consecutive_errors: int = 10,
        errors_kept: int = 5,
        results_kept: int = 10_000,
        env_threads: bool = True,
    ):
        if segment_len < 1:
            raise ValueError(f"segment_len must be >= 1, got {segment_len}")
        if envs < 1:
            raise ValueError(f"envs must be >= 1, got {envs}")
        if max_consecutive_errors < 1:
            raise ValueError(f"max_consecutive_errors must be >= 1, got {max_consecutive_errors}")
        self.worker_id = worker_id
        self.seed = seed
        self.make_env = make_env
        self.segment_len = segment_len
        self.task_sampler = task_sampler
        self.max_consecutive_errors = max_consecutive_errors
        self._env_kind = _EnvThread if env_threads else _EnvInline
        self.slots = [_Slot(self._env_kind(make_env)) for _ in range(envs)]
        self._rng = random.Random(seed)
        self._episode = -1  # the worker's last episode number, over all its envs
        self._consecutive_errors = 0
        self._stop = threading.Event()
        # Guards what readers on other threads (a threaded Ray actor) copy while ``run`` writes.
        self._lock = threading.Lock()
        self._results: deque[EpisodeResult] = deque(maxlen=results_kept)
        self._errors: deque[str] = deque(maxlen=errors_kept)
        self._tasks: dict[str, dict[str, int]] = {}
        self._counts = {
            "env_steps": 0,
            "segments": 0,
            "segment_steps": 0,
            "episodes": 0,
            "env_errors": 0,
            "dropped_error_steps": 0,
        }
        self._busy_s = 0.0
        self._wait_s = 0.0
        self._sink_wait_s = 0.0
        self.imagination: Imagination | None = None
        self._finished: list[Episode] = []  # with imagination: real episodes ended, not handed on

    def set_imagination(self, imagination: Imagination) -> None:
        """Step ``imagination``'s ``WorldModelEnv`` slots beside the real envs in ``run`` from
        now on (see the module docstring)."""
        real = [slot for slot in self.slots if not slot.imagined]
        envs = imagination.make_envs(len(real), real[0].env.action_space, real[0].env.tasks)
        self.imagination = imagination
        # Inline: a world-model env's step only sends a request, and returns its reply's future.
        self.slots = real + [_Slot(_EnvInline(lambda e=env: e), imagined=True) for env in envs]

    def collect(
        self, service: Callable[[Observation, int, int, int], ActReply], segments: int = 1
    ) -> tuple[Collected, list[Segment]]:
        """Step the first env, asking ``service`` for each action, until it has closed
        ``segments`` segments; returns what they hold and the segments. Called between two
        weight updates (lockstep), every step of them is chosen by the same weights. As a Ray
        call with ``num_returns=2`` the caller reads the summary and hands the segments'
        reference on. ``service`` maps an observation, the worker's id, its env steps so far and
        a sampling seed (fixed by the worker's seed and those env steps, so that a run and its
        resume sample alike; ``worker_side.ServiceClient``) to an ``ActReply``. A ``service``
        with a ``close`` method is closed at the end."""
        if segments < 1:
            raise ValueError(f"segments must be >= 1, got {segments}")
        slots, closed = self.slots[:1], []
        try:
            while len(closed) < segments:
                obs = self._observe(slots[0])
                start = time.perf_counter()
                env_steps = self._counts["env_steps"]
                r = service(obs, self.worker_id, env_steps, self._act_seed(env_steps))
                self._wait_s += time.perf_counter() - start
                answer = (r.actions, r.logprobs, r.value, r.version)
                closed += self._step_slots(slots, [answer])
        finally:
            if hasattr(service, "close"):
                service.close()
        last = closed[-1]
        steps = sum(len(s) for s in closed)
        books = (last.worker_env_steps, last.worker_dropped_error)
        return Collected(self.worker_id, steps, *books), closed

    def _act_seed(self, env_steps: int) -> int:
        """The sampling seed of the action for the worker's ``env_steps``-th step."""
        return (self.seed * ACT_SEED_STRIDE + env_steps) % 2**63

    def run(
        self,
        service: Callable[[Observation, int, int], ActReply],
        sink: Callable[[Segment], object],
        *,
        max_segments: int | None = None,
    ) -> int:
        """Observe every env, ask ``service`` for their actions, step them, hand each closed
        segment to ``sink``; until ``stop()`` or at least ``max_segments`` segments (None: no
        limit; with several envs the last round may close a few more). Returns segments emitted.

        ``service`` maps an observation, the worker's id and its env steps so far to an
        ``ActReply`` (a Ray inference-service handle wrapped in a function, or an in-process
        callable, or a ``SocketServiceClient``); one with ``act_many`` (observations, worker,
        env steps -> replies) is asked for every env's action at once. ``sink`` takes a segment
        (e.g. puts it into the replay buffer); one with ``put_many`` takes the segments a round
        closed in one call, and one with ``wait_for_room(stop_event)`` is asked after each put
        (it returns when the buffer has room or the worker is stopped). Their errors are not
        contained: they propagate out of ``run``. An unfinished segment stays open and continues
        at the next ``run`` or ``collect``. A ``service`` with a ``close`` method is closed when
        ``run`` returns.
        """
        emitted = 0
        try:
            while not self._stop.is_set() and (max_segments is None or emitted < max_segments):
                slots = [slot for slot in self.slots if self._playing(slot)]
                observations = [self._observe(slot) for slot in slots]
                start = time.perf_counter()
                asked = (self.worker_id, self._counts["env_steps"])
                if hasattr(service, "act_many"):
                    replies = service.act_many(observations, *asked)
                else:
                    replies = [service(obs, *asked) for obs in observations]
                self._wait_s += time.perf_counter() - start
                answers = [(r.actions, r.logprobs, r.value, r.version) for r in replies]
                closed = self._step_slots(slots, answers)
                if self.imagination is not None:
                    if imagined := [s for s in closed if s.imagined]:
                        self.imagination.put(imagined)
                    closed = [s for s in closed if not s.imagined]
                if closed and hasattr(sink, "put_many"):
                    sink.put_many(closed)
                else:
                    for segment in closed:
                        sink(segment)
                emitted += len(closed)
                if closed and hasattr(sink, "wait_for_room"):
                    start = time.perf_counter()
                    sink.wait_for_room(self._stop)
                    self._sink_wait_s += time.perf_counter() - start
                if self.imagination is not None and self._finished:
                    self.imagination.real_episodes(self._finished)
                    self._finished = []
        finally:
            self._stop.clear()
            if hasattr(service, "close"):
                service.close()
        return emitted

    def stop(self) -> None:
        """Make ``run`` return after the step in progress (a stop before ``run`` ends the next
        ``run`` at once)."""
        self._stop.set()

    def episode_results(self) -> list[EpisodeResult]:
        """Episode results since the last call (oldest first), removing them from the worker."""
        with self._lock:
            results = list(self._results)
            self._results.clear()
        return results

    def stats(self) -> WorkerStats:
        """Counters since the start: env steps, segments and their steps, episodes, per-task
        episodes and successes, env errors and the steps they cost, recent error messages, steps
        of the open segment, busy seconds (in env reset/step), wait seconds on the service and on
        the sink (for room in the replay buffer), and what it imagined."""
        with self._lock:
            imagined = self.imagination.counts if self.imagination is not None else {}
            return WorkerStats(
                **self._counts,
                imagined=ImaginedCounts(**imagined),
                open_steps=self._open_steps(),
                tasks={task: TaskCounts(**counts) for task, counts in self._tasks.items()},
                last_errors=list(self._errors),
                busy_s=self._busy_s,
                wait_s=self._wait_s,
                sink_wait_s=self._sink_wait_s,
            )

    def state_dict(self) -> dict:
        """Counters, the episode count and the reset-seed stream. The envs and the open segments
        are not saved: a restored worker starts fresh episodes, and its books leave out the steps
        of the segments that were open (they were never emitted in that timeline)."""
        with self._lock:
            open_steps = self._open_steps()
            return {
                "counts": self._counts | {"env_steps": self._counts["env_steps"] - open_steps},
                "tasks": {task: dict(counts) for task, counts in self._tasks.items()},
                "episode": self._episode,
                "rng": self._rng.getstate(),
                "task_sampler": _sampler_state(self.task_sampler),
                "imagination": self._imagination_state(),
            }

    def _imagination_state(self) -> dict | None:
        """The imagination's state, and how many imagined episodes were in progress (a reload
        drops them, as it drops the real ones)."""
        if self.imagination is None:
            return None
        playing = sum(slot.imagined and slot.obs is not None for slot in self.slots)
        return self.imagination.state_dict() | {"playing": playing}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved and drop the episodes in progress (they were not
        saved)."""
        with self._lock:
            self._counts = dict(state["counts"])
            self._tasks = {task: dict(counts) for task, counts in state["tasks"].items()}
            self._episode = state["episode"]
            self._rng.setstate(state["rng"])
            if state.get("task_sampler") is not None:
                self.task_sampler.load_state_dict(state["task_sampler"])
            if self.imagination is not None and state.get("imagination") is not None:
                self.imagination.load_state_dict(state["imagination"])
            self._finished.clear()
            for slot in self.slots:
                slot.obs, slot.open = None, None

    def close(self) -> None:
        """Release the environments."""
        for slot in self.slots:
            slot.env.close()

    def _open_steps(self) -> int:
        """Env steps of the real envs' open segments."""
        return sum(
            len(slot.open.actions)
            for slot in self.slots
            if slot.open is not None and not slot.imagined
        )

    def _observe(self, slot: _Slot) -> Observation:
        while slot.obs is None:
            self._reset(slot)
        return slot.obs

    def _playing(self, slot: _Slot) -> bool:
        """Whether ``slot`` takes part in this round: a real env always, an imagined one while
        it plays an episode or can start one that is due."""
        if not slot.imagined or slot.obs is not None:
            return True
        start = self.imagination.start()
        if start is None:
            return False
        slot.episode, slot.seed = start
        # The world-model service is the run's, not this env's: its errors are not contained.
        obs = slot.env.reset(seed=slot.seed)
        slot.task, slot.instruction = obs.task, obs.instruction
        slot.episode_return, slot.length = 0.0, 0
        slot.obs, slot.open = obs, _OpenSegment.starting_at(obs)
        return True

    def _step_slots(self, slots: list[_Slot], answers: list[tuple]) -> list[Segment]:
        """Step each of ``slots`` with its answer: action tokens int [D], their behaviour
        log-probs float [D], the behaviour value and the policy version that chose them. The
        envs step at once, each on its own thread; an env that raises is contained (its episode
        ends, its open segment's steps are dropped, it is rebuilt). Returns the segments closed."""
        space = slots[0].env.action_space
        checked = []
        for action_tokens, logprobs, value, version in answers:
            tokens = np.asarray(action_tokens, dtype=np.int64)
            logp = np.asarray(logprobs, dtype=np.float32)
            if tokens.shape != (space.dims,) or logp.shape != (space.dims,):
                raise ValueError(
                    f"action_tokens {tokens.shape} and logprobs {logp.shape} must both have shape "
                    f"({space.dims},): one token per action dimension"
                )
            checked.append((tokens, logp, float(value), int(version)))
        start = time.perf_counter()
        pending = [
            slot.env.submit_step(space.to_env(c[0])) for slot, c in zip(slots, checked, strict=True)
        ]
        outcomes: list[StepResult | Exception] = []
        for future in pending:
            try:
                outcomes.append(future.result())
            except Exception as err:  # crash containment: the worker outlives its env
                outcomes.append(err)
        self._busy_s += time.perf_counter() - start
        closed = []
        for slot, answer, outcome in zip(slots, checked, outcomes, strict=True):
            if not isinstance(outcome, Exception):
                closed += self._record(slot, *answer, outcome)
        for slot, outcome in zip(slots, outcomes, strict=True):
            if isinstance(outcome, Exception):
                if slot.imagined:  # the world-model service failed, not an env of this worker
                    raise outcome
                self._on_env_error(slot, outcome, "step")
        return closed

    def _record(
        self,
        slot: _Slot,
        tokens: np.ndarray,
        logp: np.ndarray,
        value: float,
        version: int,
        result: StepResult,
    ) -> list[Segment]:
        """Book one env step of ``slot``; returns the segment it closed, if any."""
        if not slot.imagined:
            self._counts["env_steps"] += 1
            self._consecutive_errors = 0
        seg = slot.open
        seg.actions.append(tokens)
        seg.logprobs.append(logp)
        seg.values.append(value)
        seg.rewards.append(float(result.reward))
        seg.versions.append(version)
        seg.images.append(_copy_image(result.obs))
        seg.steps.append(result.obs.step)
        if self.imagination is not None and not slot.imagined:
            slot.frames.append(seg.images[-1])
            slot.actions.append(tokens)
            slot.rewards.append(float(result.reward))
        slot.episode_return += float(result.reward)
        slot.length += 1
        done = result.terminated or result.truncated
        closed = []
        if done or len(seg.actions) == self.segment_len:
            closed.append(self._close_segment(slot, seg, result, done))
            slot.open = None if done else _OpenSegment.starting_at(result.obs)
        if done and slot.imagined:
            slot.obs = None
        elif done:
            if self.imagination is not None:
                self._finished.append(self._episode_of(slot, result))
            self._finish_episode(slot, result.success)
        else:
            slot.obs = result.obs
        return closed

    def _reset(self, slot: _Slot) -> None:
        task = self.task_sampler() if self.task_sampler is not None else None
        start = time.perf_counter()
        seed = self._rng.randrange(2**31)
        try:
            obs = slot.env.reset(task=task, seed=seed)
        except Exception as err:  # crash containment, as in step
            self._on_env_error(slot, err, "reset")
            return
        finally:
            self._busy_s += time.perf_counter() - start
        self._episode += 1
        slot.episode = self._episode
        slot.task, slot.instruction = obs.task, obs.instruction
        slot.episode_return, slot.length = 0.0, 0
        slot.obs = obs
        slot.open = _OpenSegment.starting_at(obs)
        slot.seed = seed
        if self.imagination is not None:
            slot.frames, slot.actions, slot.rewards = [slot.open.images[0]], [], []

    def _episode_of(self, slot: _Slot, result: StepResult) -> Episode:
        """The slot's episode that ``result`` ended, as ``B_wm`` and the imagination cache keep
        episodes."""
        return Episode(
            frames=np.stack(slot.frames),
            actions=np.stack(slot.actions),
            rewards=np.asarray(slot.rewards, dtype=np.float32),
            instruction=slot.instruction,
            task=slot.task,
            seed=slot.seed,
            success=bool(result.success),
            terminated=bool(result.terminated),
            truncated=bool(result.truncated),
        )

    def _close_segment(
        self, slot: _Slot, seg: _OpenSegment, result: StepResult, done: bool
    ) -> Segment:
        if slot.imagined:  # counted by the imagination once put into B_img
            tags = {"imagined": True, "wm_version": result.info["wm_version"]}
        else:
            self._counts["segments"] += 1
            self._counts["segment_steps"] += len(seg.actions)
            tags = {
                "worker_env_steps": self._counts["env_steps"],
                "worker_dropped_error": self._counts["dropped_error_steps"],
            }
        return Segment(
            worker=self.worker_id,
            episode=slot.episode,
            task=slot.task,
            instruction=slot.instruction,
            **segment_arrays(seg),
            terminated=done and result.terminated,
            episode_done=done,
            success=done and result.success,
            **tags,
        )

    def _finish_episode(self, slot: _Slot, success: bool) -> None:
        with self._lock:
            self._counts["episodes"] += 1
            per_task = self._tasks.setdefault(slot.task, {"episodes": 0, "successes": 0})
            per_task["episodes"] += 1
            per_task["successes"] += int(success)
            self._results.append(
                EpisodeResult(
                    self.worker_id,
                    slot.episode,
                    slot.task,
                    success,
                    slot.episode_return,
                    slot.length,
                )
            )
        slot.obs = None

    def _on_env_error(self, slot: _Slot, err: Exception, where: str) -> None:
        """End the env's episode, count the steps of its unfinished segment, rebuild the env."""
        with self._lock:
            self._counts["env_errors"] += 1
            if slot.open is not None:
                self._counts["dropped_error_steps"] += len(slot.open.actions)
            self._errors.append(f"{where}: {type(err).__name__}: {err}")
        slot.open = None
        slot.obs = None
        self._consecutive_errors += 1
        with contextlib.suppress(Exception):  # a crashed simulator may fail to close too
            slot.env.close()
        if self._consecutive_errors >= self.max_consecutive_errors:
            raise RuntimeError(
                f"rollout worker {self.worker_id}: {self._consecutive_errors} env errors in a row "
                f"(max_consecutive_errors={self.max_consecutive_errors}); last: {where}: {err!r}"
            ) from err
        slot.env = self._env_kind(self.make_env)


class _EnvThread:
    """One env whose every call runs on one thread of its own.

    GL contexts (MuJoCo's EGL renderer in MetaWorld and LIBERO) belong to the thread that made
    them current, and a threaded Ray actor serves calls from any thread of its pool.
    """

    def __init__(self, make_env: Callable[[], EmbodiedEnv]):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayrl-env")
        self.env = self._thread.submit(make_env).result()
        self.action_space = self.env.action_space
        self.tasks = self.env.tasks

    def reset(self, **kwargs: Any) -> Observation:
        """``env.reset`` on the env's thread."""
        return self._thread.submit(self.env.reset, **kwargs).result()

    def step(self, action: Any) -> StepResult:
        """``env.step`` on the env's thread."""
        return self.submit_step(action).result()

    def submit_step(self, action: Any) -> Future:
        """``env.step`` started on the env's thread; its future."""
        return self._thread.submit(self.env.step, action)

    def close(self) -> None:
        """``env.close`` on the env's thread, then stop the thread."""
        try:
            self._thread.submit(self.env.close).result()
        finally:
            self._thread.shutdown(wait=False)


class _EnvInline:
    """One env called on the caller's thread; ``submit_step`` returns a finished future, so the
    worker treats it as an ``_EnvThread``."""

    def __init__(self, make_env: Callable[[], EmbodiedEnv]):
        self.env = make_env()
        self.action_space = self.env.action_space
        self.tasks = self.env.tasks

    def reset(self, **kwargs: Any) -> Observation:
        """``env.reset``."""
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> StepResult:
        """``env.step``."""
        return self.env.step(action)

    def submit_step(self, action: Any) -> Future:
        """``env.step`` run now; its outcome (result or error) as a finished future. An env with
        a ``submit_step`` of its own (``WorldModelEnv``) starts the step and returns its future."""
        if hasattr(self.env, "submit_step"):
            return self.env.submit_step(action)
        future: Future = Future()
        try:
            future.set_result(self.env.step(action))
        except Exception as err:  # the worker contains it, as an _EnvThread's
            future.set_exception(err)
        return future

    def close(self) -> None:
        """``env.close``."""
        self.env.close()


def _sampler_state(sampler: Callable[[], str] | None) -> dict | None:
    """A task sampler's state when it keeps one (``worker_side.TaskSampler`` does), else None."""
    save = getattr(sampler, "state_dict", None)
    return save() if save is not None else None


def _copy_image(obs: Observation) -> np.ndarray:
    # Some simulators render into one reused buffer; a segment must keep each frame.
    return np.array(obs.image, dtype=np.uint8, copy=True)
