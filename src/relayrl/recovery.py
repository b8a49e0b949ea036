"""Executors that die mid-run are replaced, not fatal: the failure is recorded, a new actor takes
the dead one's place (same role, index and placement bundle), weight sync is reconnected and the
newest weights are served to it, and what died with it is counted.

A trainer rank is not replaced: its shard of the model and optimizer state died with it, so the
run stops (``ExecutorFailed``) and ``relayrl train --resume`` continues from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray.exceptions import RayActorError

from relayrl.launch import Group, WeightSync
from relayrl.observability.metrics import RunTally, say

DEATHS = (RayActorError,)  # what a call on a dead (killed, crashed, out of memory) actor raises


class ExecutorFailed(RuntimeError):
    """An executor the run cannot go on without died; ``name`` says which."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name} died: {reason}")
        self.name = name
        self.reason = reason


class Recovery:
    """Replaces dead executors of ``workload`` one at a time; every replacement and publish
    that the loops make goes under ``lock``, so no publish lands between two publishers."""

    def __init__(self, workload: Any, sync: WeightSync, tally: RunTally):
        self.workload = workload
        self.sync = sync
        self.tally = tally
        self.lock = asyncio.Lock()

    async def replace(
        self, group: Group, index: int, err: BaseException, *, lost: int = 0, unfinished: int = 0
    ) -> Any:
        """Record the death of ``group[index]`` (``lost``: samples counted as generated that died
        with it; ``unfinished``: work in progress it held, never counted), put a new actor in
        its place, reconnect weight sync; returns the new actor."""
        name = group.names[index]
        reason = first_line(err)
        self.tally.on_failure(
            {
                "role": group.role,
                "name": name,
                "time": time.time(),
                "step": self.tally.steps,
                "reason": reason,
                "lost": lost,
                "unfinished": unfinished,
            }
        )
        say(f"{name} died ({reason}); replacing it")
        async with self.lock:
            incarnation = sum(f["name"] == name for f in self.tally.failures)
            group.actors[index] = await asyncio.to_thread(
                self.workload.recreate, group.role, index, incarnation
            )
            await self.sync.reconnect(self.workload.receivers())
        say(f"{name} replaced; weight sync reconnected")
        return group.actors[index]


def first_line(err: BaseException) -> str:
    """The first line of an error's message, with its type."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
