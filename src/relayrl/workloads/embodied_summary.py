"""The embodied workload's summary: one ``Books`` per source (real env steps; imagined ones with
a world model) and the rollout, perf, replay and world-model sections, from the executors' stats.

Real env steps: every step a worker took is trained, dropped (stale, evicted from a full buffer,
by an env error, or in flight at a checkpoint a resume continued from), lost with a dead
executor, or still in flight (resident in the buffer, fetched for a step that never ran, or in a
worker's open segment). A worker that died counts as of the last segment it closed; the steps it
took after that are ``lost_unfinished``, outside the books. Imagined env steps are generated when
put into ``B_img``; they are trained, dropped (stale, overflow, resume) or in flight (resident,
prefetched).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from relayrl.config import Config
from relayrl.observability.books import Books
from relayrl.observability.metrics import RunTally, say
from relayrl.types import (
    BufferStats,
    LoopEnd,
    ServiceStats,
    TrainerStats,
    WorkerStats,
    WorldModelStats,
)

WASTE_WARN_FRACTION = 0.25  # imagined env steps dropped before training, above which we warn


@dataclass(frozen=True)
class EmbodiedStats:
    """Every executor's stats at one moment; the imagined parts are None (or empty) without a
    world model."""

    workers: Sequence[WorkerStats]
    trainers: Sequence[TrainerStats]
    services: Sequence[ServiceStats]
    buffer: BufferStats
    imagined_buffer: BufferStats | None = None
    world_model: WorldModelStats | None = None
    wm_services: Sequence[ServiceStats] = ()

    def unreceived(self, tally: RunTally) -> tuple[int, int]:
        """Real and imagined env steps the buffers handed out that no trainer rank has received
        (a fetch ahead), less those the run's resumes booked as ``dropped_resume``; exact only
        while no worker puts."""
        real = self.buffer.unreceived(self.trainers, booked=tally.dropped_resume)
        if (imagined := self.imagined_buffer) is None:
            return real, 0
        booked = tally.imagined_dropped_resume
        return real, imagined.unreceived(self.trainers, imagined=True, booked=booked)


def real_books(
    tally: RunTally, found: EmbodiedStats, retired: Mapping[int, tuple[int, int]], prefetched: int
) -> Books:
    """The real env steps' books: counted where they are played (the live workers, and the dead
    ones' ``retired`` books: worker id -> (env steps, steps dropped by env errors)), with the
    ``prefetched`` steps a fetch took that no trainer rank received."""
    workers, trainers, buffer = found.workers, found.trainers, found.buffer
    unfinished = [f.unfinished for f in tally.failures]  # rollout workers' (others: 0)
    return Books(
        unit="env_steps",
        generated=sum(w.env_steps for w in workers) + sum(s for s, _ in retired.values()),
        trained=sum(t.trained for t in trainers),
        dropped={
            "stale": sum(t.dropped_stale for t in trainers) + buffer.dropped_stale_steps,
            "overflow": buffer.dropped_overflow_steps,
            "error": sum(w.dropped_error_steps for w in workers)
            + sum(e for _, e in retired.values()),
            "resume": tally.dropped_resume,
        },
        lost=tally.lost,
        in_flight={
            "resident": buffer.resident_steps,
            "prefetched": prefetched,
            "open": sum(w.open_steps for w in workers),
        },
        # None if any death's unfinished steps are unknown
        beside={"lost_unfinished": None if None in unfinished else sum(unfinished)},
    )


def imagined_books(tally: RunTally, found: EmbodiedStats, prefetched: int) -> Books:
    """The imagined env steps' books (generated: put into ``B_img``), with the imagined episodes
    the live workers count and their success rate beside them."""
    buffer = found.imagined_buffer
    if buffer is None:
        raise ValueError("imagined_books needs the imagined buffer's stats: the run imagines none")
    trainers, counts = found.trainers, [w.imagined for w in found.workers]
    episodes = sum(c.episodes for c in counts)
    return Books(
        unit="imagined_env_steps",
        generated=buffer.put_steps,
        trained=sum(t.imagined_trained for t in trainers),
        dropped={
            "stale": sum(t.imagined_dropped_stale for t in trainers) + buffer.dropped_stale_steps,
            "overflow": buffer.dropped_overflow_steps,
            "resume": tally.imagined_dropped_resume,
        },
        in_flight={"resident": buffer.resident_steps, "prefetched": prefetched},
        beside={
            "by_live_workers": sum(c.steps for c in counts),
            "episodes": episodes,
            "success_rate": sum(c.successes for c in counts) / max(episodes, 1),
        },
    )


def books(
    tally: RunTally,
    found: EmbodiedStats,
    retired: Mapping[int, tuple[int, int]],
    prefetched: tuple[int, int],
) -> dict[str, Books]:
    """The books by summary section: ``samples``, and ``imagined_samples`` with a world model;
    ``prefetched``: the real and imagined env steps fetched that no trainer rank received."""
    out = {"samples": real_books(tally, found, retired, prefetched[0])}
    if found.imagined_buffer is not None:
        out["imagined_samples"] = imagined_books(tally, found, prefetched[1])
    return out


def summary_sections(
    cfg: Config,
    tally: RunTally,
    found: EmbodiedStats,
    retired: Mapping[int, tuple[int, int]],
    loop: LoopEnd,
    rl_wall: float,
) -> dict:
    """The rollout, perf, staleness, replay and books sections (and world_model with one) of a
    run that finished, whose loop returned ``loop`` after ``rl_wall`` seconds of RL."""
    prefetched = (loop.prefetched, loop.prefetched_imagined)
    by_section = books(tally, found, retired, prefetched)
    for name, kept in by_section.items():
        if problem := kept.imbalance():
            say(f"warning: the {name} books do not balance: {problem}")
    if (imagined := by_section.get("imagined_samples")) and (warning := imagined_waste(imagined)):
        say(warning)
    real = by_section["samples"]
    workers, services, buffer = found.workers, found.services, found.buffer
    tasks = WorkerStats.tasks_of(workers)
    episodes = sum(t.episodes for t in tasks.values())
    occupancy = loop.occupancy
    requests = sum(s.requests for s in services)
    forwards = sum(s.forwards for s in services)
    out = {name: kept.section() for name, kept in by_section.items()}
    if found.world_model is not None:
        out["world_model"] = world_model_section(found.world_model, found.wm_services)
    return out | {
        "rollout": {
            "env_steps_per_s": real.trained / rl_wall,
            "generated_env_steps_per_s": real.generated / rl_wall,
            "episodes": episodes,
            "success_rate": {
                "overall": sum(t.successes for t in tasks.values()) / max(episodes, 1),
                "per_task": {task: t.success_rate for task, t in tasks.items()},
            },
            "env_errors": sum(w.env_errors for w in workers),
            "last_errors": [e for w in workers for e in w.last_errors][-5:],
            "workers": len(workers),
        },
        "perf": {
            "busy": {"rollout_workers": sum(w.busy_s for w in workers) / len(workers) / rl_wall},
            "inference": {
                "replicas": len(services),
                "requests": requests,
                "requests_per_replica": [s.requests for s in services],
                "versions": [s.version for s in services],
                "forwards": forwards,
                "mean_batch": requests / max(forwards, 1),
                "latency_ms_p50": services[0].latency_ms_p50,
                "latency_ms_p95": services[0].latency_ms_p95,
            },
        },
        "staleness": tally.staleness() | {"max_staleness": cfg.max_staleness},
        "replay": {
            "capacity_steps": cfg.replay.capacity_steps,
            "occupancy_mean": sum(occupancy) / max(len(occupancy), 1),
            "occupancy_end": buffer.occupancy,
            "reader_wait_s": buffer.reader_wait_s,
            "resident_max_steps": buffer.resident_max_steps,
            "wait_at": cfg.replay.wait_at,
            "writer_wait_s": buffer.writer_wait_s,
        },
    }


def world_model_section(wm: WorldModelStats, services: Sequence[ServiceStats]) -> dict:
    """The ``world_model`` section: its version, gradient steps per model, ``B_wm``'s books and
    what its replicas served."""
    requests = sum(s.requests for s in services)
    return {
        "version": wm.version,
        "updates": wm.updates,
        "b_wm": {
            "buffer_steps": wm.buffer_steps,
            "buffer_episodes": wm.buffer_episodes,
            "added_steps": wm.added_steps,
            "evicted_steps": wm.evicted_steps,
        },
        "service": {
            "replicas": len(services),
            "requests": requests,
            "mean_batch": requests / max(sum(s.forwards for s in services), 1),
            "versions": [s.version for s in services],
        },
    }


def imagined_waste(imagined: Books) -> str | None:
    """A warning when more than ``WASTE_WARN_FRACTION`` of the ``imagined`` env steps were
    dropped before any training (``B_img`` overflowed, or they aged past ``max_staleness``),
    naming the knobs that balance what the workers imagine against what the trainer takes; else
    None."""
    generated = imagined.generated
    overflow, stale = imagined.dropped.get("overflow", 0), imagined.dropped.get("stale", 0)
    if not generated or (overflow + stale) / generated <= WASTE_WARN_FRACTION:
        return None
    return (
        f"{(overflow + stale) / generated:.0%} of the {generated} imagined env steps were never "
        f"trained ({overflow} overflowed imagination.buffer_steps, {stale} aged past "
        "max_staleness): the workers imagine more than the trainer takes; lower "
        "imagination.episodes_per_real or imagination.real_ratio"
    )
