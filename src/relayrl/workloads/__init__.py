"""Workloads: what a run trains, on which roles, and what its summary reports.

A workload is one object. It declares its roles in a table (``relayrl.roles.Role``) and places
it (``place``), readies the policy before RL (``prepare``: warm start, version 0, the first
evaluation), evaluates (``evaluate``), and after RL returns its sections of ``summary.json``
(``finish``). It names the loop family that feeds its trainer (``family``): ``batches``
(generate -> score -> train: ``controller.run_sync`` / ``run_async``) or ``segments`` (act ->
step -> train: ``run_lockstep`` / ``run_streaming``). The controller owns what every workload
shares: the run directory, Ray, weight-sync wiring, the loops, the staleness gate, tracing,
checkpoints, failure handling and the books. A new workload adds classes, not branches there.

``Workload`` lists every member that ``relayrl.job``, ``relayrl.checkpoint`` and
``relayrl.recovery`` use; ``BatchWorkload`` and ``SegmentWorkload`` add what each loop family
uses. Those modules and the loops touch nothing else of a workload (tests/test_workload_protocol.py
records what they touch).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from relayrl.executors.rollout_worker import Collected
from relayrl.observability.metrics import MetricsLog, RunTally
from relayrl.recovery import Recovery
from relayrl.roles import Group, Placed
from relayrl.types import LoopEnd
from relayrl.workloads.embodied import EmbodiedWorkload
from relayrl.workloads.llm import LLMWorkload


class Workload(Protocol):
    """What the job, the checkpointer and recovery use of a workload (see the module doc)."""

    family: str  # the loop family that feeds it: "batches" or "segments"
    placed: Placed  # its role table, placed (empty until ``place``)
    legend: dict[str, str]  # learning-curve labels
    recovery: Recovery | None  # set by relayrl.job.train once weight sync is connected
    run_dir: Path | None  # the run directory, set by relayrl.job.train before place()

    @property
    def trainer(self) -> Group:
        """The trainer ranks: they train, publish and write their own checkpoint parts."""

    def place(self) -> None:
        """Place the role table (``relayrl.roles.Placed.place``) and wire what it needs."""

    def prepare(self, log: MetricsLog) -> dict:
        """Before RL: ready version 0 on every receiver and evaluate; returns summary sections."""

    async def evaluate(self) -> dict:
        """Evaluate the policy the receivers serve now."""

    async def settle(self) -> None:
        """Before a checkpoint: bring what the snapshot saves to rest."""

    async def snapshot(self) -> dict[str, Any]:
        """For a run checkpoint: every non-trainer executor's state by name, and the workload's
        own; changes nothing."""

    async def realign(self, parts: dict[str, Any]) -> None:
        """After a checkpoint of ``parts``: put the executors where a resume from it starts."""

    def restore(self, parts: dict[str, Any]) -> None:
        """Load what ``snapshot`` saved (a resume)."""

    def finish(self, tally: RunTally, loop: LoopEnd, rl_wall: float) -> dict:
        """After RL: this workload's sections of summary.json."""

    def partial_books(self, tally: RunTally) -> dict:
        """The books of a run that stopped early (failed or interrupted): a
        ``relayrl.observability.books.Books`` by summary section (``samples``, ...)."""


class BatchWorkload(Workload, Protocol):
    """What the ``batches`` loops (``run_sync``, ``run_async``) use besides: generator replicas
    (weight receivers) make batches, scoring stages score them in a chain."""

    @property
    def generators(self) -> Group:
        """The generator replicas: ``generate() -> (RolloutMeta, batch)``."""

    @property
    def rewarders(self) -> Group:
        """The first scoring stage; the async loop runs one scoring loop per replica."""

    def scorers(self) -> list[Group]:
        """The scoring stages in the order a batch passes them: ``score(*batches) -> (summary,
        batch)``."""


class SegmentWorkload(Workload, Protocol):
    """What the ``segments`` loops (``run_lockstep``, ``run_streaming``) and ``WorkerRuns`` use
    besides: rollout workers step envs and ask inference replicas (weight receivers) for
    actions; segments reach the trainer directly (lockstep) or through the replay buffer."""

    @property
    def services(self) -> Group:
        """The inference replicas."""

    @property
    def workers(self) -> Group:
        """The rollout workers."""

    @property
    def replay_buffer(self) -> Any:
        """The replay buffer's actor."""

    def note(self, collected: Sequence[Collected]) -> None:
        """Remember the workers' books as of the last segment each collected in lockstep."""

    async def revive(self, recovery: Recovery, err: BaseException) -> None:
        """Replace the inference replicas and rollout workers that died (lockstep); re-raise
        ``err`` when none did."""

    async def retire(self, index: int) -> int | None:
        """Keep dead worker ``index``'s books; the env steps it took that no books count."""

    def service_of(self, worker: int) -> Any:
        """The inference replica that answers rollout worker ``worker``."""

    def service_client(self, worker: int) -> Any:
        """What rollout worker ``worker`` calls for an action in its ``run``."""

    def fetch(self, version: int) -> list[Any]:
        """Refs to the next super-batch's parts for a trainer at ``version``."""

    def buffers(self) -> list[Any]:
        """The buffers the loop closes at its end."""

    async def prefetched(self, tally: RunTally) -> tuple[int, int | None]:
        """Real and imagined env steps handed out that no trainer rank has received yet, less
        those ``tally`` books as dropped at a resume."""

    async def after_step(self, step: int) -> dict[str, float]:
        """After policy step ``step``: what runs beside the loop (a world-model round)."""

    async def finish_world_model(self) -> dict[str, float]:
        """Wait for what ``after_step`` started; its metrics."""

    async def episode_feedback(self, step: int) -> dict[str, float]:
        """Feed finished episodes to the task choice; rollout metrics."""


def members(protocol: type) -> frozenset[str]:
    """The names a protocol declares (attributes, properties, methods), its bases' included."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        names |= set(cls.__dict__.get("__annotations__", {}))
        names |= {n for n in cls.__dict__ if not n.startswith("_")}
    return frozenset(names)


FAMILIES: dict[str, type] = {"batches": BatchWorkload, "segments": SegmentWorkload}
WORKLOADS: dict[str, type] = {"llm": LLMWorkload, "embodied": EmbodiedWorkload}

__all__ = [
    "FAMILIES",
    "WORKLOADS",
    "BatchWorkload",
    "EmbodiedWorkload",
    "LLMWorkload",
    "SegmentWorkload",
    "Workload",
    "members",
]
