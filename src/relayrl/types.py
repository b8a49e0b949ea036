"""Typed messages that flow between executors. Every message carries policy versions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


@dataclass
class ActReply:
    """The policy's answer to one observation."""

    actions: np.ndarray  # int64 [D] action tokens
    logprobs: np.ndarray  # float32 [D] behaviour log-prob mu of each token
    value: float  # behaviour value estimate of the observation
    version: int  # policy version of the weights that computed this reply


@dataclass
class RolloutBatch:
    """A batch of finished completions, columnar, laid out as consecutive groups of one prompt.

    Token arrays are right-padded to a common length ``L``; ``tokens[i, :prompt_len[i]]`` is the
    prompt and the next ``completion_len[i]`` entries are the completion. ``logprobs`` and
    ``versions`` are aligned with ``tokens``: entry ``j`` is the behaviour log-probability ``mu``
    of ``tokens[i, j]`` and the policy version that sampled it (``-1`` on prompt and padding).
    """

    tokens: np.ndarray  # [B, L] int64
    prompt_len: np.ndarray  # [B] int64
    completion_len: np.ndarray  # [B] int64
    logprobs: np.ndarray  # [B, L] float32
    versions: np.ndarray  # [B, L] int64, -1 outside the completion
    finished: np.ndarray  # [B] bool, the completion ended with EOS
    group_size: int
    answers: list[str]  # reference answer of each sample
    completions: list[str] = field(default_factory=list)  # decoded text, by the generator
    rewards: np.ndarray | None = None  # [B] float32, filled by the rewarder
    score_errors: int = 0  # scorer calls that raised, filled by the rewarder
    ref_logprobs: np.ndarray | None = None  # [B, L] float32 like logprobs, by the reference
    rule_rewards: np.ndarray | None = None  # [B] the rewarder's, kept as stages change rewards
    token_advantages: np.ndarray | None = None  # [B, L] float32 like logprobs, by the critic
    stage_metrics: dict[str, float] = field(default_factory=dict)  # scoring stages', to log

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def completion_mask(self) -> np.ndarray:
        """[B, L] bool, true on completion tokens."""
        return self.versions >= 0

    @property
    def min_version(self) -> np.ndarray:
        """[B] the oldest policy version that sampled any token of each completion."""
        big = np.iinfo(np.int64).max
        return np.where(self.completion_mask, self.versions, big).min(axis=1)

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """One batch holding ``batches`` one after the other, padded to the longest row."""
        if len(batches) == 1:
            return batches[0]
        if len({b.group_size for b in batches}) != 1:
            sizes = [b.group_size for b in batches]
            raise ValueError(f"batches to concatenate must share a group_size, got {sizes}")
        width = max(b.tokens.shape[1] for b in batches)

        def stack(name: str, fill: float) -> np.ndarray:
            parts = [getattr(b, name) for b in batches]
            return np.concatenate(
                [np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=fill) for p in parts]
            )

        scored = all(b.rewards is not None for b in batches)
        referenced = all(b.ref_logprobs is not None for b in batches)
        ruled = all(b.rule_rewards is not None for b in batches)
        advantaged = all(b.token_advantages is not None for b in batches)
        return cls(
            tokens=stack("tokens", 0),
            prompt_len=np.concatenate([b.prompt_len for b in batches]),
            completion_len=np.concatenate([b.completion_len for b in batches]),
            logprobs=stack("logprobs", 0.0),
            versions=stack("versions", -1),
            finished=np.concatenate([b.finished for b in batches]),
            group_size=batches[0].group_size,
            answers=[a for b in batches for a in b.answers],
            completions=[c for b in batches for c in b.completions],
            rewards=np.concatenate([b.rewards for b in batches]) if scored else None,
            score_errors=sum(b.score_errors for b in batches),
            ref_logprobs=stack("ref_logprobs", 0.0) if referenced else None,
            rule_rewards=np.concatenate([b.rule_rewards for b in batches]) if ruled else None,
            token_advantages=stack("token_advantages", 0.0) if advantaged else None,
            stage_metrics={
                key: float(
                    np.mean([b.stage_metrics[key] for b in batches if key in b.stage_metrics])
                )
                for key in {k for b in batches for k in b.stage_metrics}
            },
        )

    def select(self, keep: np.ndarray) -> RolloutBatch:
        """Rows where ``keep`` (a [B] bool array) is true; ``keep`` must keep whole groups."""
        rows = np.flatnonzero(keep)
        return replace(
            self,
            tokens=self.tokens[rows],
            prompt_len=self.prompt_len[rows],
            completion_len=self.completion_len[rows],
            logprobs=self.logprobs[rows],
            versions=self.versions[rows],
            finished=self.finished[rows],
            answers=[self.answers[i] for i in rows],
            completions=[self.completions[i] for i in rows] if self.completions else [],
            rewards=None if self.rewards is None else self.rewards[rows],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[rows],
            rule_rewards=None if self.rule_rewards is None else self.rule_rewards[rows],
            token_advantages=None if self.token_advantages is None else self.token_advantages[rows],
        )


@dataclass
class RolloutMeta:
    """What the controller needs to know about a rollout batch without touching its tensors."""

    samples: int
    tokens: int
    version: int  # generator policy version at the end of the call
    resumed: int  # completions continued from an earlier call (partial rollouts)
    pending: int  # unfinished completions cached for the next call
    busy_s: float


@dataclass
class Segment:
    """Up to L consecutive steps of one episode from one rollout worker (AcceRL's trajectory unit).

    A segment never spans two episodes. It ends when the episode ends or after L steps; unless it
    ended with ``terminated``, the trainer bootstraps from the value of the last observation
    (``images[-1]``), recomputed with its current critic.
    """

    worker: int
    episode: int  # per-worker episode counter
    task: str
    instruction: str
    images: np.ndarray  # uint8 [T+1, V, H, W, 3]: the observation before each step, plus the last
    steps: np.ndarray  # int64 [T+1] step index within the episode of each observation
    actions: np.ndarray  # int64 [T, D] action tokens
    logprobs: np.ndarray  # float32 [T, D] behaviour log-prob mu of each action token
    values: np.ndarray  # float32 [T] behaviour value estimates (recomputed by the trainer)
    rewards: np.ndarray  # float32 [T]
    versions: np.ndarray  # int64 [T] policy version that chose each action
    terminated: bool  # the episode ended in the task's terms at the last step: no bootstrap
    episode_done: bool  # the episode ended at the last step (terminated or truncated)
    success: bool  # meaningful when episode_done
    # The worker's books when this segment closed, so that they outlive the worker if it dies:
    # its env steps so far (this segment's included) and how many of them env errors dropped.
    worker_env_steps: int = 0
    worker_dropped_error: int = 0
    # Imagined in the world model (not stepped in the env), and the world-model version that
    # predicted its frames and rewards (-1 for a real segment).
    imagined: bool = False
    wm_version: int = -1

    def __len__(self) -> int:
        return int(self.actions.shape[0])


def segment_arrays(open_segment: object) -> dict[str, np.ndarray]:
    """The array fields of a ``Segment`` from an open segment's per-step lists (its ``images``,
    ``steps``, ``actions``, ``logprobs``, ``values``, ``rewards`` and ``versions``), as the rollout
    worker and imagination both keep them."""
    o: Any = open_segment
    return {
        "images": np.stack(o.images),
        "steps": np.asarray(o.steps, dtype=np.int64),
        "actions": np.stack(o.actions),
        "logprobs": np.stack(o.logprobs),
        "values": np.asarray(o.values, dtype=np.float32),
        "rewards": np.asarray(o.rewards, dtype=np.float32),
        "versions": np.asarray(o.versions, dtype=np.int64),
    }


@dataclass
class StepResult:
    """What one train step did. The typed fields are control (the controller decides on them and
    keeps the books with them); ``metrics`` is for logging only."""

    stepped: bool  # an optimizer step was taken and the version bumped
    version: int  # the trainer's policy version after the step
    received: int  # samples (completions, or env steps) the step was given
    trained: int  # of those, samples within max_staleness (trained on, or zero-signal skipped)
    dropped_stale: int  # of those, samples dropped for lagging more than max_staleness
    lags: list[int]  # lags[k]: trained samples k versions old
    train_s: float  # seconds the step took
    skipped_nonfinite: int = 0  # optimizer steps (minibatches) skipped for a nan or inf loss/norm
    # LLM: completion tokens of the trained and of the dropped samples (the length bias of drops)
    trained_tokens: int = 0
    dropped_tokens: int = 0
    # Embodied with imagination: the imagined env steps, kept apart from the real ones above.
    imagined_received: int = 0
    imagined_trained: int = 0
    imagined_dropped_stale: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def merge(cls, results: list[StepResult]) -> StepResult:
        """One step of a trainer group: counts add up over ranks; metrics, and the skipped
        optimizer steps the ranks agree on, come from rank 0."""
        first = results[0]
        width = max(len(r.lags) for r in results)
        return cls(
            stepped=first.stepped,
            version=first.version,
            received=sum(r.received for r in results),
            trained=sum(r.trained for r in results),
            dropped_stale=sum(r.dropped_stale for r in results),
            lags=[sum(r.lags[k] for r in results if k < len(r.lags)) for k in range(width)],
            train_s=max(r.train_s for r in results),
            skipped_nonfinite=first.skipped_nonfinite,
            trained_tokens=sum(r.trained_tokens for r in results),
            dropped_tokens=sum(r.dropped_tokens for r in results),
            imagined_received=sum(r.imagined_received for r in results),
            imagined_trained=sum(r.imagined_trained for r in results),
            imagined_dropped_stale=sum(r.imagined_dropped_stale for r in results),
            metrics=first.metrics,
        )


@dataclass(frozen=True)
class LoopEnd:
    """What a loop leaves when its last step ends, for the workload's summary: the samples it
    generated and never trained, and (segments) the replay buffer's occupancy after each step."""

    in_flight: int = 0  # batches: samples queued or in the pipeline, never trained
    prefetched: int = 0  # segments: real env steps fetched that no trainer rank received
    prefetched_imagined: int = 0  # segments with imagination: the imagined ones
    occupancy: tuple[float, ...] = ()  # segments, async: after each step


# What executors' ``stats()`` return. The typed fields are what the controller and the workloads
# read (the books, versions, occupancy); each is the executor's count since it started unless
# its comment says otherwise.


@dataclass(frozen=True)
class TrainerStats:
    """A trainer rank's counters: its version and the samples it trained and dropped stale."""

    version: int  # the rank's policy version
    busy_s: float
    skipped_nonfinite: int  # optimizer steps skipped for a nan or inf loss or norm
    skipped_masked: int = 0  # optimizer steps skipped: the loss masked every token with a signal
    trained: int = 0  # samples (completions, or real env steps) trained on, or zero-signal
    dropped_stale: int = 0  # samples dropped for lagging more than max_staleness
    imagined_trained: int = 0  # embodied with imagination: imagined env steps, kept apart
    imagined_dropped_stale: int = 0

    @staticmethod
    def received(ranks: Sequence[TrainerStats], imagined: bool = False) -> int:
        """Samples of one source (real, or ``imagined``) the ``ranks`` have received together:
        each was trained or dropped stale."""
        if imagined:
            return sum(r.imagined_trained + r.imagined_dropped_stale for r in ranks)
        return sum(r.trained + r.dropped_stale for r in ranks)


@dataclass(frozen=True)
class WorldModelStats:
    """The world-model trainer's counters: its version, gradient steps and ``B_wm``'s books."""

    version: int
    busy_s: float
    skipped_nonfinite: int
    updates: dict[str, int]  # gradient steps by model ("obs", "reward")
    buffer_steps: int  # real env steps held in B_wm
    buffer_episodes: int
    added_steps: int
    evicted_steps: int


@dataclass(frozen=True)
class BufferStats:
    """A replay buffer's books in env steps and segments: put, taken, dropped and resident."""

    put_steps: int
    put_segments: int
    taken_steps: int  # handed out to a trainer's fetch
    taken_segments: int
    dropped_stale_steps: int  # aged past max_staleness while resident
    dropped_stale_segments: int
    dropped_overflow_steps: int  # evicted from a full buffer
    dropped_overflow_segments: int
    resident_steps: int
    resident_segments: int
    resident_max_steps: int
    occupancy: float  # resident steps / capacity
    reader_wait_s: float
    writer_wait_s: float  # summed over the writers waiting for room
    # worker id -> (env steps, steps dropped by env errors) as of the worker's last put
    workers: dict[int, tuple[int, int]] = field(default_factory=dict)

    def unreceived(
        self, ranks: Sequence[TrainerStats], imagined: bool = False, booked: int = 0
    ) -> int:
        """Env steps this buffer handed out that no trainer rank has received yet (a fetch
        ahead); ``imagined`` for the imagined buffer, whose steps the ranks count apart.
        ``booked``: those a resume already booked as dropped (taken before the checkpoint it
        continued from, which the restored buffer still counts as taken)."""
        return self.taken_steps - TrainerStats.received(ranks, imagined) - booked


@dataclass(frozen=True)
class TaskCounts:
    """Finished training episodes of one task, and how many of them succeeded."""

    episodes: int = 0
    successes: int = 0

    def __add__(self, other: TaskCounts) -> TaskCounts:
        return TaskCounts(self.episodes + other.episodes, self.successes + other.successes)

    @property
    def success_rate(self) -> float:
        """Successes per episode (0.0 before the first)."""
        return self.successes / max(self.episodes, 1)


@dataclass(frozen=True)
class ImaginedCounts:
    """What a rollout worker imagined: env steps, segments, episodes and their successes."""

    steps: int = 0
    segments: int = 0
    episodes: int = 0
    successes: int = 0


@dataclass(frozen=True)
class WorkerStats:
    """A rollout worker's counters: the env steps it took and where they went, its episodes per
    task, env errors, and its busy and waiting seconds."""

    env_steps: int
    segments: int  # segments closed
    segment_steps: int  # env steps in those segments
    episodes: int
    env_errors: int
    dropped_error_steps: int  # steps of the unfinished segments an env error ended
    open_steps: int  # steps of the segments still open
    tasks: dict[str, TaskCounts]
    last_errors: list[str]
    busy_s: float  # in env reset and step
    wait_s: float  # on the inference service
    sink_wait_s: float  # on the sink (for room in the replay buffer)
    imagined: ImaginedCounts = ImaginedCounts()

    @staticmethod
    def tasks_of(workers: Sequence[WorkerStats]) -> dict[str, TaskCounts]:
        """Each task's episodes and successes over ``workers``."""
        out: dict[str, TaskCounts] = {}
        for w in workers:
            for task, counts in w.tasks.items():
                out[task] = out.get(task, TaskCounts()) + counts
        return out


@dataclass(frozen=True)
class ServiceStats:
    """An inference service's counters since its last ``reset_stats``: requests, batched
    forwards, and per-request latency (queue wait plus forward) in milliseconds."""

    version: int  # the policy version it serves now
    requests: int
    forwards: int
    busy_s: float
    batch_sizes: dict[int, int]  # batch size -> forwards of that size
    mean_batch: float
    queue_ms_mean: float
    latency_ms_mean: float
    latency_ms_p50: float  # over the recent window
    latency_ms_p95: float
    latency_ms_max: float
    waiting: int  # requests queued now


@dataclass(frozen=True)
class GeneratorStats:
    """A generator replica's counters."""

    version: int
    busy_s: float
    tokens_generated: int
    pending: int  # unfinished partial rollouts cached for its next call


@dataclass(frozen=True)
class StageStats:
    """A scoring stage's counters; ``counts`` holds a stage of your own's, for the summary."""

    busy_s: float
    scored: int = 0  # samples scored
    errors: int = 0  # samples a scorer raised on (scored 0)
    timeouts: int = 0  # samples whose scorer timed out (scored 0)
    updates: int = 0  # a learning stage's (the critic's) optimizer steps
    skipped_nonfinite: int = 0
    counts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EvaluatorStats:
    """An evaluator's counters."""

    episodes: int  # evaluation episodes played since the start
