"""Executors that die mid-run are replaced, not fatal: the failure is recorded, a new actor takes
the dead one's place (same role, index and placement bundle), weight sync is reconnected and the
newest weights are served to it, and what died with it is counted. A weight-sync receiver that
misses ``sync.timeout_s`` (``ReceiverLost``) goes the same way: it is stopped and replaced.

A trainer rank is not replaced: its shard of the model and optimizer state died with it, so the
run stops (``ExecutorFailed``) and ``relayrl train --resume`` continues from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from relayrl.launch import WeightSync
from relayrl.observability.metrics import Failure, RunTally, say
from relayrl.roles import Group, Placed
from relayrl.weight_sync import ReceiverLost

DEATHS = (RayActorError,)  # what a call on a dead (killed, crashed, out of memory) actor raises


class ExecutorFailed(RuntimeError):
    """An executor the run cannot go on without died; ``name`` says which."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name} died: {reason}")
        self.name = name
        self.reason = reason


class Recovery:
    """Replaces dead members of a placed role table one at a time, each by its role's
    constructor (``Placed.recreate``); every replacement and publish that the loops make goes
    under ``lock``, so no publish lands between two publishers."""

    def __init__(self, roles: Placed, sync: WeightSync, tally: RunTally):
        self.roles = roles
        self.sync = sync
        self.tally = tally
        self.lock = asyncio.Lock()
        self.deaths: dict[str, int] = {}  # each dead actor's index in tally.failures, by actor id

    async def replace(
        self,
        group: Group,
        index: int,
        err: BaseException,
        *,
        lost: int = 0,
        unfinished: int | None = 0,
        dead: Any = None,
    ) -> Any:
        """Record the death of ``dead`` (default: ``group[index]``; ``lost``: samples counted as
        generated that died with it; ``unfinished``: work in progress it held, never counted,
        None if unknown), put a new actor in its place, reconnect weight sync; returns the
        actor now in its place. With ``err`` a ``ReceiverLost`` the receiver may be alive (busy
        past ``sync.timeout_s``): it is killed first, which frees its bundle for the new one.

        Several loops may see one death (a scoring loop and an evaluation, say): it is recorded
        once, what each lost is added to that record, and it is replaced once. A replacement
        under way finishes even when the loop that started it is cancelled, so no later call
        finds the dead actor still in place.
        """
        dead = group.actors[index] if dead is None else dead
        name = group.names[index]
        lost_receiver = isinstance(err, ReceiverLost)
        key = dead._actor_id.hex()
        if key in self.deaths:  # another loop's view of a death already recorded
            self.tally.on_failure_seen_again(self.deaths[key], lost, unfinished)
        else:
            reason = first_line(err)
            failure = Failure(
                group.role, name, time.time(), self.tally.steps, reason, lost, unfinished
            )
            self.deaths[key] = self.tally.on_failure(failure)
            say(f"{name} {'is lost' if lost_receiver else 'died'} ({reason}); replacing it")
        async with self.lock:
            if group.actors[index] is dead:
                if lost_receiver:
                    ray.kill(dead)
                swap = asyncio.ensure_future(self._swap(group, index))
                try:
                    await asyncio.shield(swap)
                except asyncio.CancelledError:
                    await swap
                    raise
                say(f"{name} replaced")
        return group.actors[index]

    async def _swap(self, group: Group, index: int) -> None:
        """A new actor in place of ``group[index]``, and weight sync reconnected to it."""
        name = group.names[index]
        incarnation = sum(f.name == name for f in self.tally.failures)
        group.actors[index] = await asyncio.to_thread(
            self.roles.recreate, group.role, index, incarnation
        )
        if name in self.sync.receivers:
            await self.sync.reconnect(self.roles.receivers())


def dead_executor(err: BaseException, groups: list[Group]) -> str | None:
    """The name of the executor whose death ``err`` reports, if it is one of ``groups``."""
    actor_id = getattr(err, "actor_id", None) or getattr(
        getattr(err, "cause", None), "actor_id", None
    )
    for group in groups:
        for name, actor in group.named().items():
            if actor_id is not None and actor._actor_id.hex() == actor_id:
                return name
    return None


def first_line(err: BaseException) -> str:
    """The first line of an error's message, with its type (of its cause, for a task's error
    caused by an actor's death)."""
    cause = getattr(err, "cause", None)
    err = cause if isinstance(cause, DEATHS) else err
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def is_death(err: BaseException) -> bool:
    """Whether ``err`` is an actor's death, or a task's error caused by one (a rollout worker's
    run fails so when its inference replica dies)."""
    return isinstance(err, DEATHS) or isinstance(getattr(err, "cause", None), DEATHS)


async def alive(actor: Any) -> bool:
    """Whether ``actor`` still answers."""
    try:
        await actor.__ray_ready__.remote()
    except DEATHS:
        return False
    return True


class WorkerRuns:
    """The rollout workers' ``run`` loops of an async embodied run, kept running.

    A run that ends because its worker or its worker's inference replica died is restarted once
    the dead actor is replaced. Each run is watched with its replica's weight updates
    (``WeightSync.watched``): a replica whose update fails or misses ``sync.timeout_s`` is
    replaced as a dead one, and the runs of the workers it served restart on its replacement.
    A replaced worker's books (env steps, steps dropped by env errors) are kept as of the last
    segment it put; the steps it took after that died with it, uncounted, and its failure record
    reports them as ``unfinished`` (see ``EmbodiedWorkload.retire``).
    """

    def __init__(self, workload: Any, recovery: Recovery, sink: Any):
        self.w = workload
        self.recovery = recovery
        self.sink = sink
        self.runs: list[asyncio.Future] = []
        self.calls: list[Any] = []  # each run's call (an object ref), which the watch awaits
        self.served: list[Any] = []  # the inference replica each run was started with
        self.watch: asyncio.Future | None = None
        self._reviving = asyncio.Lock()

    def start(self) -> None:
        """Start every worker's run, and the watch that revives them."""
        count = len(self.w.workers)
        self.calls, self.served = [None] * count, [None] * count
        self.runs = [self._run(i) for i in range(count)]
        self.watch = asyncio.ensure_future(self._watch())

    async def stop(self) -> None:
        """Stop the watch (after a revival in progress) and every run (after its last put); a
        worker that dies meanwhile is replaced (the next ``start`` starts its run)."""
        async with self._reviving:
            self.watch.cancel()
            await asyncio.gather(self.watch, return_exceptions=True)
            await self._revive_ended()
            workers = self.w.workers
            stops = await asyncio.gather(
                *(worker.stop.remote() for worker in workers), return_exceptions=True
            )
            ended = await asyncio.gather(*self.runs, return_exceptions=True)
            for i, (stop, run) in enumerate(zip(stops, ended, strict=True)):
                err = next((e for e in (stop, run) if isinstance(e, BaseException)), None)
                if err is not None:
                    await self._replace_dead(i, err)

    def _run(self, i: int) -> asyncio.Future:
        worker, service = self.w.workers[i], self.w.service_of(i)
        self.calls[i] = worker.run.remote(self.w.service_client(i), self.sink)
        self.served[i] = service
        name = self.w.services.names[i % len(self.w.services)]
        return asyncio.ensure_future(self.recovery.sync.watched(name, self.calls[i]))

    async def _watch(self) -> None:
        while True:
            await asyncio.wait(self.runs, return_when=asyncio.FIRST_COMPLETED)
            async with self._reviving:
                await self._revive_ended()

    async def _revive_ended(self) -> None:
        for i, run in enumerate(self.runs):
            if not run.done():
                continue
            err = run.exception()
            if err is None:
                raise RuntimeError(f"rollout worker {i}'s run returned before it was stopped")
            await self._replace_dead(i, err)
            self.runs[i] = self._run(i)

    async def _replace_dead(self, i: int, err: BaseException) -> None:
        """Worker ``i``'s call failed with ``err``: replace its inference replica and itself,
        whichever died or (the replica) missed its update (re-raise an error that is neither).
        The death of an executor neither of them (a world-model replica, say), which nothing
        replaces, fails the run naming it, where restarting the worker would only fail again."""
        services = self.w.services
        s = i % len(services)
        replaced = False
        if isinstance(err, ReceiverLost):  # its replica missed its update: stopped and replaced
            await self.recovery.replace(services, s, err, dead=self.served[i])
            await asyncio.gather(self.calls[i], return_exceptions=True)  # the run fails with it
            replaced = True
        elif not is_death(err):
            raise err
        elif not await alive(services[s]):
            await self.recovery.replace(services, s, err)
            replaced = True
        if not await alive(self.w.workers[i]):
            unfinished = await self.w.retire(i)
            await self.recovery.replace(self.w.workers, i, err, unfinished=unfinished)
            replaced = True
        if not replaced and (name := dead_executor(err, self.w.placed.all())) is not None:
            raise ExecutorFailed(name, first_line(err)) from err
