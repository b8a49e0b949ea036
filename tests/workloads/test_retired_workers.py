"""The dead rollout workers' books: kept as of the last segment each closed (the replay buffer's
record or the last one collected in lockstep, whichever is later), the steps after it reported as
unfinished, fresh ids for replacements, and a checkpoint part with the same keys as ever."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ray.exceptions import RayActorError

from relayrl.executors.rollout_worker import Collected
from relayrl.workloads.retired_workers import RetiredWorkers


class Remote:
    """An actor method's ``remote`` that answers at once (or raises ``err``)."""

    def __init__(self, answer: object = None, err: BaseException | None = None):
        self.answer, self.err = answer, err

    async def remote(self, *args: object) -> object:
        if self.err is not None:
            raise self.err
        return self.answer


@dataclass
class Found:
    """What a replay buffer's ``stats()`` says of the workers: id -> (env steps, dropped)."""

    workers: dict[int, tuple[int, int]] = field(default_factory=dict)


class Buffer:
    """A replay buffer whose record of the workers' last puts is ``workers``."""

    def __init__(self, workers: dict[int, tuple[int, int]]):
        self.stats = Remote(Found(workers))


class Service:
    """An inference replica that heard of ``reported`` env steps (None: it died since)."""

    def __init__(self, reported: int | None):
        dead = RayActorError() if reported is None else None
        self.reported = Remote(reported, dead)


def test_a_dead_worker_keeps_its_latest_closed_segments_books_and_reports_the_rest():
    retired = RetiredWorkers(workers=2)
    retired.note([Collected(worker=1, steps=8, worker_env_steps=40, worker_dropped_error=3)])
    buffer = Buffer({0: (25, 1), 1: (32, 0)})
    # Worker 1: lockstep saw 40 steps, later than the buffer's 32; its replica heard of 46.
    assert asyncio.run(retired.retire(1, buffer, Service(reported=46))) == 6
    # Worker 0: the buffer's 25; a segment that reached it after the last request leaves 0.
    assert asyncio.run(retired.retire(0, buffer, Service(reported=20))) == 0
    assert retired.books == {1: (40, 3), 0: (25, 1)}
    # A replica that died since knows nothing: unknown.
    assert asyncio.run(retired.retire(0, buffer, Service(reported=None))) is None


def test_replacements_go_on_under_fresh_ids_and_a_checkpoint_restores_everything():
    retired = RetiredWorkers(workers=3)
    retired.renew(1, incarnation=1)  # 1 + 1 * 3
    retired.renew(2, incarnation=2)  # 2 + 2 * 3
    assert retired.ids == [0, 4, 8]
    retired.note([Collected(worker=4, steps=5, worker_env_steps=5, worker_dropped_error=0)])
    asyncio.run(retired.retire(1, Buffer({}), Service(reported=9)))
    state = retired.state_dict()
    assert state == {"retired": {4: (5, 0)}, "seen": {4: (5, 0)}, "worker_ids": [0, 4, 8]}
    resumed = RetiredWorkers(workers=3)
    resumed.load_state_dict(state)
    assert (resumed.books, resumed.seen, resumed.ids) == ({4: (5, 0)}, {4: (5, 0)}, [0, 4, 8])
