"""The books of rollout workers that died, and the ids the live ones go on under.

A dead worker's env steps, and the steps env errors dropped, are kept as of the last segment it
closed: the replay buffer's record of its last put (async), or the last segment collected in
lockstep (``note``). The steps it took after that died with it, in no books; its failure record
reports them as ``unfinished``. A replacement goes on under an id of its own, so its books never
mix with the dead one's. A run checkpoint keeps all of it (``state_dict``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relayrl.executors.rollout_worker import Collected
from relayrl.recovery import DEATHS


class RetiredWorkers:
    """Dead rollout workers' books by worker id, and the id each live worker goes on under."""

    def __init__(self, workers: int):
        # worker id -> (env steps, steps dropped by env errors) as of the last segment it closed
        self.books: dict[int, tuple[int, int]] = {}
        self.seen: dict[int, tuple[int, int]] = {}  # the same, of segments collected in lockstep
        self.ids = list(range(workers))  # by worker index

    def note(self, collected: Sequence[Collected]) -> None:
        """Remember the workers' books as of the last segment each collected in lockstep."""
        for c in collected:
            self.seen[c.worker] = (c.worker_env_steps, c.worker_dropped_error)

    def renew(self, index: int, incarnation: int) -> None:
        """Worker ``index``'s replacement number ``incarnation`` goes on under an id no worker
        had."""
        self.ids[index] = index + incarnation * len(self.ids)

    async def retire(self, index: int, buffer: Any, service: Any) -> int | None:
        """Keep the books of dead worker ``index`` as of the last segment it closed (from the
        replay ``buffer``'s record, or the segments collected in lockstep); returns the env steps
        it took after that segment, which no books count (its open segment's, and those of a
        segment an env error ended since).

        As its last request to its inference replica ``service`` said; None (unknown) if that
        replica died since. A step in flight at the death is not known. In lockstep a round
        ends, and a checkpoint falls, with every segment closed: a worker killed between two
        rounds took none.
        """
        worker_id = self.ids[index]
        found = (await buffer.stats.remote()).workers.get(worker_id, (0, 0))
        books = max(tuple(found), self.seen.get(worker_id, (0, 0)))
        self.books[worker_id] = books
        try:
            taken = await service.reported.remote(worker_id)
        except DEATHS:
            taken = None
        # Below books[0] when its last step closed a segment that reached the buffer after its
        # last request: nothing was left open.
        return None if taken is None else max(taken - books[0], 0)

    def state_dict(self) -> dict[str, Any]:
        """For a run checkpoint (its ``retired_workers`` part)."""
        return {"retired": dict(self.books), "seen": dict(self.seen), "worker_ids": list(self.ids)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` saved."""
        self.books = dict(state["retired"])
        self.seen = dict(state["seen"])
        self.ids = list(state["worker_ids"])
