"""The single controller's loops: the four ways a train step is fed, one per loop family and mode.

A loop drives role groups by name. LLM: generator replicas ``generate``, the scoring stages
(``LLMWorkload.scorers()``: rewarders, then your stages, reward models, references and the critic
where placed) ``score`` in a chain, every trainer rank ``train_step``s on the same batch (each
takes its share) and ``publish``es its shard, and the receivers take the new weights through the
run's ``WeightSync``.
Embodied: rollout workers step their envs and ask inference replicas for actions; segments reach
every trainer rank's ``train_step`` (sync: collected here in lockstep; async: fetched from the
replay buffer one super-batch ahead), and the inference replicas take the new weights. Object
references pass between executors, so rollout tensors never move through here. Between two steps
each loop lets the ``Checkpointer`` write a run checkpoint when one is due.

``relayrl.job.train`` runs a whole job around a loop (run directory, Ray, placement, resume, the
summary); what a workload owns (placement, evaluation, its summary sections) is in
``relayrl.workloads``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from relayrl.channels.local import Channel
from relayrl.checkpoint import Checkpointer
from relayrl.config import Config
from relayrl.executors.rollout_worker import Collected
from relayrl.executors.worker_side import BufferSink, ServiceClient
from relayrl.launch import Group, WeightSync
from relayrl.observability.metrics import MetricsLog, RunTally
from relayrl.recovery import DEATHS, ExecutorFailed, Recovery, WorkerRuns, alive, first_line
from relayrl.types import LoopEnd, StepResult
from relayrl.weight_sync import ReceiverLost
from relayrl.workloads import BatchWorkload, SegmentWorkload


async def run_sync(
    cfg: Config,
    w: BatchWorkload,
    sync: WeightSync,
    tally: RunTally,
    log: MetricsLog,
    ckpt: Checkpointer,
) -> LoopEnd:
    """generate -> score -> train -> publish, one after the other; strictly on-policy.

    A step's calls are submitted at once as a chain of object references: Ray runs each when its
    input is ready and passes data executor to executor, so the controller waits once per step.
    Every generator replica generates a batch; one rewarder replica (in turn) scores them all as
    one batch, which every trainer rank trains on. Ray runs an actor's calls in submission order,
    so the next ``generate`` always comes after this step's ``update_weights``; the controller
    awaits each generator's update as it waits for that ``generate`` (``WeightSync.watched``),
    and a generator whose update fails or misses ``sync.timeout_s`` is replaced as a dead one
    is, with the step's batch. The trainer never waits for a generator's update.

    With ``generator.min_lag`` = K the scored batches wait in a queue here, and each step trains
    on the batch generated K steps before its own (while its own is generated): the first K
    rounds only fill the queue, on version 0. Returns the samples left in the queue.
    """
    recovery = w.recovery
    waiting: deque[tuple[tuple, Any]] = deque()  # (meta refs, scored ref), oldest first
    while tally.steps < cfg.steps:
        meta_refs, batches = zip(
            *(g.generate.options(num_returns=2).remote() for g in w.generators), strict=True
        )
        r = tally.steps % len(w.rewarders)
        summary_refs, scored_ref = _score_chain(w.scorers(), r, batches)
        waiting.append((meta_refs, scored_ref))
        due = waiting.popleft()[1] if len(waiting) > cfg.generator.min_lag else None
        results = [] if due is None else [rank.train_step.remote(due) for rank in w.trainer]
        if results:
            sync.publish()
        names = w.generators.names
        generated = [sync.watched(n, ref) for n, ref in zip(names, meta_refs, strict=True)]
        try:
            metas, score = await asyncio.gather(asyncio.gather(*generated), _scored(summary_refs))
        except (*DEATHS, ReceiverLost) as err:  # this step's batch is lost
            await _recover_sync_step(cfg, w, recovery, meta_refs, r, err)
            if due is scored_ref:  # the trainer did not train on it
                continue
            waiting.pop()  # with min_lag the trainer trained on an older batch meanwhile
        else:
            for meta in metas:
                tally.on_generated(meta.samples, meta.busy_s)
            tally.on_scored(score["busy_s"], score["errors"], score["timeouts"])
        if not results:
            continue
        result = await _trained(w.trainer, results)
        if result.received:  # partial rollouts: a batch in which no group finished is no step
            await _log_step(cfg, tally, log, result, w.evaluate)
            if ckpt.due():
                await ckpt.write(in_flight=await _samples(waiting))
            ckpt.after()
    await _serving_newest(sync, w.generators, recovery)
    return LoopEnd(in_flight=await _samples(waiting))


def _score_chain(stages: list[Group], i: int, batches: tuple) -> tuple[list, Any]:
    """Pass ``batches`` (object refs) through every scoring stage, replica ``i`` (modulo its
    size) of each, as one chain of object references: Ray hands each stage's batch to the next.
    Returns every stage's summary ref, in order, and the last stage's batch ref."""
    summaries = []
    for group in stages:
        summary, scored = group[i % len(group)].score.options(num_returns=2).remote(*batches)
        summaries.append(summary)
        batches = (scored,)
    return summaries, batches[0]


async def _scored(summary_refs: list) -> dict:
    """The scoring stages' summaries of one batch, added up: busy seconds, errors, timeouts."""
    summaries = [await ref for ref in summary_refs]  # in order: the first dead stage raises
    return {key: sum(s.get(key, 0) for s in summaries) for key in ("busy_s", "errors", "timeouts")}


async def _dead_stages(w: BatchWorkload, i: int) -> list[tuple[Group, int]]:
    """The scoring-stage replicas that chain ``i`` uses and that are dead."""
    stages = [(group, i % len(group)) for group in w.scorers()]
    return [(group, j) for group, j in stages if not await alive(group[j])]


async def _samples(waiting: deque) -> int:
    """Samples in the batches of ``waiting`` ((meta refs, scored ref) pairs)."""
    metas = await asyncio.gather(*(ref for meta_refs, _ in waiting for ref in meta_refs))
    return sum(meta.samples for meta in metas)


async def _serving_newest(
    sync: WeightSync, group: Group, recovery: Recovery, pending: dict[str, int] | None = None
) -> None:
    """Await every replica of ``group``'s update to the newest publish; one whose update fails
    or misses ``sync.timeout_s`` (or that died) is replaced, and the replacement serves it.
    ``pending``: the unfinished work each replica holds, by name (none if not given)."""
    replaced = True
    while replaced:  # a replacement publishes to every replica again
        replaced = False
        for i, name in enumerate(group.names):
            actor = group[i]
            try:
                await sync.updated(name)
            except (*DEATHS, ReceiverLost) as err:
                held = (pending or {}).get(name, 0)
                await recovery.replace(group, i, err, unfinished=held, dead=actor)
                replaced = True


async def _recover_sync_step(
    cfg: Config, w: BatchWorkload, recovery: Recovery, meta_refs: tuple, r: int, err: Exception
) -> None:
    """After a sync step failed: replace the generators and the rewarder that died (or the
    generator that missed ``sync.timeout_s``), and count the batches the live generators
    finished (never trained) as lost."""
    for name, rank in w.trainer.named().items():
        if not await alive(rank):
            raise ExecutorFailed(name, first_line(err)) from err
    stopped = w.generators.names.index(err.name) if isinstance(err, ReceiverLost) else None
    if stopped is not None:  # it may be busy still: stopped, it goes the way of a dead one
        ray.kill(w.generators[stopped])
    metas = await asyncio.gather(*meta_refs, return_exceptions=True)
    finished = [m for m in metas if not isinstance(m, BaseException)]
    for meta in finished:
        recovery.tally.on_generated(meta.samples, meta.busy_s)
    lost = sum(meta.samples for meta in finished)
    batch = cfg.generator.prompts_per_step * cfg.generator.group_size
    dead = [
        (w.generators, i, batch if isinstance(metas[i], BaseException) else 0)
        for i, g in enumerate(w.generators)
        if i == stopped or not await alive(g)
    ]
    dead += [(group, j, 0) for group, j in await _dead_stages(w, r)]
    if not dead:
        raise err
    for k, (group, i, unfinished) in enumerate(dead):
        await recovery.replace(group, i, err, lost=lost if k == 0 else 0, unfinished=unfinished)


async def run_async(
    cfg: Config,
    w: BatchWorkload,
    sync: WeightSync,
    tally: RunTally,
    log: MetricsLog,
    ckpt: Checkpointer,
) -> LoopEnd:
    """Generation, scoring and training overlap, joined by bounded channels.

    Each generator replica runs its own rollout loop and each rewarder replica its own scoring
    loop. One staleness gate serves them all: batch ``i`` (counted over every replica) starts
    only once the trainer has consumed batch ``i - max_staleness`` and published its weights, so
    a batch reaches the trainer about ``max_staleness`` versions old at most; the trainer still
    checks every token and drops (and counts) any group that is older. A replica generates on the
    newest weights published when its batch starts: a push transport queues every version to
    every replica; with one that lets receivers skip versions, the replica takes only the newest,
    just before the batch. Returns the samples generated but not trained when the last step
    finished, once every replica has been handed the last version.

    ``generator.min_lag`` = K forces the lag: the gate then admits K + 1 batches, and the trainer
    takes batch ``i`` only once batch ``i + K`` has started. So batch ``i + K`` starts on the
    weights of exactly ``i`` train steps and is trained after ``i + K``: every step takes one
    version, each batch is K versions old (the first K start on version 0: they fill the
    pipeline). A step that takes no optimizer step leaves the version where it is, and the K
    batches after it are one version younger.
    """
    pipeline = _Pipeline(cfg, w, sync, tally)
    workers = pipeline.start()
    try:
        while tally.steps < cfg.steps:
            _, scored_ref = await _first_or_raise(pipeline.scored.get(), workers)
            if pipeline.lag:
                await pipeline.lagged(workers)
            result = await _train_step(w.trainer, scored_ref)
            if result.stepped:
                async with w.recovery.lock:
                    sync.publish(fan_out=not sync.skips_versions)
            await _log_step(cfg, tally, log, result, pipeline.evaluate)
            await pipeline.trained()
            await ckpt.maybe(in_flight=pipeline.in_flight())
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    sync.refresh(*w.generators.names)  # what runs on the replicas next sees the last version
    await _serving_newest(sync, w.generators, w.recovery, pipeline.pending)
    return LoopEnd(in_flight=pipeline.close())


class _Pipeline:
    """What the async loop's rollout and scoring loops share: the channels between them, the
    staleness gate (batches started against train steps taken) and the books of what each loop
    holds."""

    def __init__(self, cfg: Config, w: BatchWorkload, sync: WeightSync, tally: RunTally):
        self.w, self.sync, self.tally = w, sync, tally
        idle = tally.idle
        self.generated: Channel = Channel(cfg.channels.capacity, "generated")
        self.scored: Channel = Channel(
            cfg.channels.capacity, "scored", consumer=idle[w.trainer.names[0]]
        )
        self.published = asyncio.Condition()
        self.started = tally.steps  # batches started; a resumed run has nothing in flight
        self.held: dict[str, int] = {}  # samples a loop holds between two channels, by loop
        self.pending = dict.fromkeys(w.generators.names, 0)  # unfinished completions per replica
        self.lag = cfg.generator.min_lag
        self.bound = self.lag if self.lag else cfg.max_staleness  # admits bound + 1 batches
        self.batch = cfg.generator.prompts_per_step * cfg.generator.group_size

    def start(self) -> list[asyncio.Task]:
        """One rollout loop per generator replica, one scoring loop per rewarder replica."""
        loops = [self.rollout_loop(i, n) for i, n in enumerate(self.w.generators.names)]
        loops += [self.score_loop(i, n) for i, n in enumerate(self.w.rewarders.names)]
        return [asyncio.create_task(loop) for loop in loops]

    async def rollout_loop(self, i: int, name: str) -> None:
        """Generator replica ``i``: pass the gate, take the newest weights, generate, hand the
        batch to the scoring loops; a replica that dies or misses its update is replaced."""
        w, sync, idle = self.w, self.sync, self.tally.idle[name]
        while True:
            start = time.time()
            await self._admit()
            idle.wait("staleness gate", start, time.time())
            generator = w.generators[i]
            try:
                async with w.recovery.lock:  # pull: the newest weights, before this generate
                    sync.refresh(name)
                meta_ref, batch_ref = generator.generate.options(num_returns=2).remote()
                # Ray runs the update handed to it first: awaited with the batch, and one that
                # fails or misses sync.timeout_s meanwhile stops it.
                meta = await sync.watched(name, meta_ref)
            except (*DEATHS, ReceiverLost) as err:
                # Its batch in progress and its partial rollouts die with it.
                self.started -= 1
                left = self.pending[name] + self.batch
                await w.recovery.replace(w.generators, i, err, unfinished=left, dead=generator)
                self.pending[name] = 0
                continue
            self.pending[name] = meta.pending
            self.tally.on_generated(meta.samples, meta.busy_s)
            if not meta.samples:  # partial rollouts: no group finished in this call
                self.started -= 1
                continue
            self.held[name] = meta.samples
            await self.generated.put((meta.samples, batch_ref), idle)
            self.held[name] = 0

    async def score_loop(self, i: int, name: str) -> None:
        """Rewarder replica ``i`` (and replica ``i`` of every later stage): score the batches
        generated, hand them to the trainer; a batch whose stage dies is lost with it."""
        idle = self.tally.idle[name]
        while True:
            samples, batch_ref = await self.generated.get(idle)
            self.held[name] = samples
            used = [(g, i % len(g), g[i % len(g)]) for g in self.w.scorers()]
            summary_refs, scored_ref = _score_chain(self.w.scorers(), i, (batch_ref,))
            try:
                score = await _scored(summary_refs)
            except DEATHS as err:  # the batch being scored dies with the stage that held it
                self.held[name] = 0
                await self._lost(used, samples, err)
                continue
            self.tally.on_scored(score["busy_s"], score["errors"], score["timeouts"])
            await self.scored.put((samples, scored_ref), idle)
            self.held[name] = 0

    async def _admit(self) -> None:
        """Wait until batch ``started`` may start: the trainer has consumed batch ``started -
        bound``."""
        async with self.published:
            await self.published.wait_for(lambda: self.tally.steps >= self.started - self.bound)
            self.started += 1
            self.published.notify_all()  # min_lag: the batch this start releases may train

    async def _lost(self, used: list, samples: int, err: BaseException) -> None:
        """Replace the dead stages of ``used`` (group, index, actor); the batch of ``samples``
        they held is lost."""
        dead = [(g, j, actor) for g, j, actor in used if not await alive(actor)]
        if not dead:
            raise err
        for k, (group, j, actor) in enumerate(dead):
            await self.w.recovery.replace(group, j, err, lost=samples if k == 0 else 0, dead=actor)
        # It never reaches the trainer: the gate lets another batch start in its place (without
        # this, max_staleness + 1 lost batches would close it for good).
        async with self.published:
            self.started -= 1
            self.published.notify_all()

    async def lagged(self, workers: list[asyncio.Task]) -> None:
        """min_lag: wait until K batches younger than the next one have started."""

        async def started() -> None:
            async with self.published:
                await self.published.wait_for(lambda: self.started > self.tally.steps + self.lag)

        start = time.time()
        await _first_or_raise(started(), workers)
        self.tally.idle[self.w.trainer.names[0]].wait("min_lag", start, time.time())

    async def trained(self) -> None:
        """A train step ended: the gate may admit another batch."""
        async with self.published:
            self.published.notify_all()

    async def evaluate(self) -> dict:
        """The workload's evaluation, after every replica was handed the newest weights (a
        replica runs its calls in order)."""
        async with self.w.recovery.lock:
            self.sync.refresh(*self.w.generators.names)
        return await self.w.evaluate()

    def in_flight(self) -> int:
        """Samples the loops and channels hold now."""
        queued = self.generated.peek() + self.scored.peek()
        return sum(self.held.values()) + sum(n for n, _ in queued)

    def close(self) -> int:
        """Close the channels; the samples generated and never trained."""
        left = self.generated.close() + self.scored.close()
        return sum(self.held.values()) + sum(samples for samples, _ in left)


async def run_lockstep(
    cfg: Config,
    w: SegmentWorkload,
    sync: WeightSync,
    tally: RunTally,
    log: MetricsLog,
    ckpt: Checkpointer,
) -> LoopEnd:
    """Embodied sync: collect in lockstep, train, publish, one after the other; no overlap.

    A round asks every worker to ``collect`` one segment (L steps or the end of its episode),
    stepping its env against its inference replica; each request is sampled from a seed of the
    worker's (a forward pass of its own), so a run and its resume take the same actions however
    the requests interleave. Rounds repeat until the super-batch holds ``replay.batch_steps``
    env steps. The segments
    stay where the workers put them: the trainer ranks take their references. No segment is
    left open between rounds and the replicas' updates are awaited before the next, so every
    step trained was chosen by the current weights: every lag is 0.
    """
    while tally.steps < cfg.steps:
        start = time.time()
        collected = await _collect(cfg, w)
        tally.on_generated(sum(c.steps for c, _ in collected), time.time() - start)
        result = await _train_step(w.trainer, *(segments for _, segments in collected))
        async with w.recovery.lock:
            sync.publish()
        await _serving_newest(sync, w.services, w.recovery)
        result.metrics |= await w.episode_feedback(tally.steps + 1)
        await _log_step(cfg, tally, log, result, w.evaluate)
        await ckpt.maybe()
    return LoopEnd()


async def _collect(cfg: Config, w: SegmentWorkload) -> list[tuple[Collected, Any]]:
    """Rounds of one segment per rollout worker until they hold ``replay.batch_steps`` env
    steps: each worker's ``Collected`` and its segments' reference. A round that meets a dead
    worker or replica keeps what the others collected and replaces the dead (the segments the
    dead worker was filling die with it, uncounted: ``EmbodiedWorkload.retire``)."""
    collected: list[tuple[Collected, Any]] = []
    while sum(c.steps for c, _ in collected) < cfg.replay.batch_steps:
        calls = [
            worker.collect.options(num_returns=2).remote(ServiceClient(w.service_of(i)))
            for i, worker in enumerate(w.workers)
        ]
        found = await asyncio.gather(*(meta for meta, _ in calls), return_exceptions=True)
        done = [(c, ref) for c, (_, ref) in zip(found, calls, strict=True) if _ok(c)]
        w.note([c for c, _ in done])
        collected += done
        if failed := [err for err in found if not _ok(err)]:
            await w.revive(w.recovery, failed[0])
    return collected


def _ok(found: Any) -> bool:
    return not isinstance(found, BaseException)


async def run_streaming(
    cfg: Config,
    w: SegmentWorkload,
    sync: WeightSync,
    tally: RunTally,
    log: MetricsLog,
    ckpt: Checkpointer,
) -> LoopEnd:
    """Embodied async: workers, inference replicas and trainer each run their own loop.

    Every worker loops observe -> ``act`` on its inference replica (dynamically batched with the
    other workers' requests) -> step, and puts each closed segment into the replay buffer. The
    next super-batch is fetched from the buffer while the current one trains (the buffer drops
    segments more than ``max_staleness`` versions older than the version the trainer will have
    when it takes them, one more than when the fetch starts; the trainer checks again); after
    each step the new weights go to every inference replica, which drains its forward pass in
    flight before swapping them in; ``WorkerRuns`` awaits each replica's update beside the runs
    of the workers it serves, and replaces a replica that misses ``sync.timeout_s``. Returns the
    env steps of the super-batch fetched but never trained, and the buffer occupancy after each
    step.
    """
    runs = WorkerRuns(w, w.recovery, BufferSink(w.replay_buffer))
    runs.start()
    trainer_idle = tally.idle[w.trainer.names[0]]
    version, occupancy = (await w.trainer[0].stats.remote()).version, []
    batch_refs = w.fetch(version)  # the real part, and with imagination the imagined one
    while tally.steps < cfg.steps:
        start = time.time()
        await _fetched(w, batch_refs, runs)
        trainer_idle.wait("replay", start, time.time())
        segments_refs = batch_refs
        # Trained after the step now starting, by a trainer one version on: fetched for that one,
        # or the oldest segments the buffer hands out (lag max_staleness now) arrive stale.
        batch_refs = w.fetch(version + 1)
        result = await _first_or_raise(_train_step(w.trainer, *segments_refs), [runs.watch])
        version = result.version
        if result.stepped:
            async with runs.recovery.lock:
                sync.publish()
        result.metrics |= await w.after_step(tally.steps + 1)
        result.metrics |= await w.episode_feedback(tally.steps + 1)
        result.metrics |= await _buffer_metrics(w, occupancy)
        await _log_step(cfg, tally, log, result, w.evaluate)
        if ckpt.due():
            # With the workers stopped the buffer holds still, and the fetch ahead has taken its
            # segments or is waiting for more: the books and the snapshot agree.
            await runs.stop()
            real, imagined = await w.prefetched(tally)
            await ckpt.write(in_flight=real, imagined_in_flight=imagined)
            runs.start()
            ckpt.after()
    await runs.stop()
    await _serving_newest(sync, w.services, w.recovery)
    await w.finish_world_model()
    real, imagined = await _closed(w, batch_refs, tally)
    return LoopEnd(prefetched=real, prefetched_imagined=imagined or 0, occupancy=tuple(occupancy))


async def _fetched(w: SegmentWorkload, batch_refs: list, runs: WorkerRuns) -> None:
    """Wait until the super-batch's parts are fetched, without pulling them here (the trainer
    ranks take them directly); re-raise at once if the workers' runs fail."""
    ready = asyncio.to_thread(ray.wait, batch_refs, num_returns=len(batch_refs), fetch_local=False)
    try:
        await _first_or_raise(ready, [runs.watch])
    except BaseException:
        # The fetch goes on waiting, in a thread asyncio.run waits for at exit, for segments no
        # worker will put now: closing the buffers ends it.
        with contextlib.suppress(Exception):
            await asyncio.gather(*(b.close.remote() for b in w.buffers()))
        raise


async def _buffer_metrics(w: SegmentWorkload, occupancy: list[float]) -> dict[str, float]:
    """The replay buffer's occupancy (appended to ``occupancy``) and the real env steps of the
    segments the workers have finished: the x axis of learning per env interaction (the trained
    total leaves out what a run with imagination never trains)."""
    buffer = await w.replay_buffer.stats.remote()
    occupancy.append(buffer.occupancy)
    return {"replay/occupancy": buffer.occupancy, "samples/real_put_total": float(buffer.put_steps)}


async def _closed(w: SegmentWorkload, batch_refs: list, tally: RunTally) -> tuple[int, int | None]:
    """Close the buffers (no worker puts now) and end the fetches still waiting (a closed one
    takes nothing); the real and imagined env steps fetched that no trainer rank received (less
    what a resume booked as dropped, ``tally``)."""
    await asyncio.gather(*(b.close.remote() for b in w.buffers()))
    await asyncio.to_thread(ray.wait, batch_refs, num_returns=len(batch_refs), fetch_local=False)
    return await w.prefetched(tally)


# By (the workload's ``family``, ``mode``): a workload names the family that feeds it.
LOOPS: dict[tuple[str, str], Callable[..., Awaitable[LoopEnd]]] = {
    ("batches", "sync"): run_sync,
    ("batches", "async"): run_async,
    ("segments", "sync"): run_lockstep,
    ("segments", "async"): run_streaming,
}


async def _train_step(trainer: Group, *batch_refs: Any) -> StepResult:
    """Every trainer rank trains on its share of the batch (its parts, in order); one result for
    the group. A rank that died stops the run, naming it."""
    return await _trained(trainer, [r.train_step.remote(*batch_refs) for r in trainer])


async def _trained(trainer: Group, calls: list) -> StepResult:
    """The group's result of the ranks' ``train_step`` ``calls``; a rank that died stops the
    run, naming it."""
    try:
        return StepResult.merge(await asyncio.gather(*calls))
    except DEATHS as err:  # a dead rank, or the batch's maker (e.g. the replay buffer) died
        for name, rank in trainer.named().items():
            if not await alive(rank):
                raise ExecutorFailed(name, first_line(err)) from err
        raise


async def _first_or_raise(awaitable: Awaitable, workers: list[asyncio.Future]) -> Any:
    """``await awaitable``, but re-raise at once if a worker loop died instead of waiting."""
    main = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({main, *workers}, return_when=asyncio.FIRST_COMPLETED)
    for task in workers:
        if task in done:
            main.cancel()
            task.result()
            raise RuntimeError("a worker loop returned before it was stopped")
    return main.result()


async def _log_step(
    cfg: Config,
    tally: RunTally,
    log: MetricsLog,
    result: StepResult,
    evaluate: Callable[[], Awaitable[dict]],
) -> None:
    """Log a finished train step; every ``log.eval_every`` steps also ``evaluate()``."""
    out = tally.on_trained(result)
    if tally.steps % cfg.log.every == 0 or tally.steps == cfg.steps:
        log.log(tally.steps, out)
    if cfg.log.eval_every and tally.steps % cfg.log.eval_every == 0 and tally.steps < cfg.steps:
        found = await evaluate()
        log.log(tally.steps, {f"eval/{k}": v for k, v in found.items() if k != "per_task"})
