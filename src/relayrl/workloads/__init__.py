"""Workloads: what a run trains, on which roles, and what its summary reports.

A workload is one object. It places its role groups (``place``), readies the policy before RL
(``prepare``: warm start, version 0, the first evaluation), evaluates (``evaluate``), and after RL
returns its sections of ``summary.json`` (``finish``). The controller owns what every workload
shares: the run directory, Ray, weight-sync wiring, the loops, the staleness gate, tracing,
checkpoints, failure handling and the books. A new workload adds a class here, not branches there.
"""

from __future__ import annotations

from typing import Any, Protocol

from relayrl.launch import Group
from relayrl.observability.metrics import MetricsLog, RunTally
from relayrl.workloads.embodied import EmbodiedWorkload
from relayrl.workloads.llm import LLMWorkload


class Workload(Protocol):
    """What the controller needs of a workload (see the module docstring)."""

    trainer: Group
    placement: Any  # the run's Placement once placed, else None
    legend: dict[str, str]  # learning-curve labels
    recovery: Any  # the run's relayrl.recovery.Recovery once weight sync is connected, else None
    run_dir: Any  # the run directory (a Path), set by relayrl.job.train before place()

    def place(self) -> None:
        """Create every role's actors."""

    def groups(self) -> list[Group]:
        """Every role group: topology, traces and stop go over these."""

    def traced(self) -> dict[str, Any]:
        """Executors that record spans, by name."""

    def receivers(self) -> dict[str, Any]:
        """Weight-sync receivers by name."""

    def closing(self) -> list[Any]:
        """Calls (object refs) that release what a kill would leave behind."""

    async def snapshot(self) -> dict[str, Any]:
        """For a run checkpoint: every non-trainer executor's state, by name."""

    def restore(self, parts: dict[str, Any]) -> None:
        """Load what ``snapshot`` saved (a resume)."""

    def prepare(self, log: MetricsLog) -> dict:
        """Before RL: ready version 0 on every receiver and evaluate; returns summary sections."""

    async def evaluate(self) -> dict:
        """Evaluate the policy the receivers serve now."""

    def finish(self, tally: RunTally, loop: dict, rl_wall: float) -> dict:
        """After RL: this workload's sections of summary.json."""

    def partial_books(self, tally: RunTally) -> dict:
        """The books of a run that stopped early (failed or interrupted): a
        ``relayrl.observability.books.Books`` by summary section (``samples``, ...)."""


WORKLOADS: dict[str, type] = {"llm": LLMWorkload, "embodied": EmbodiedWorkload}

__all__ = ["WORKLOADS", "EmbodiedWorkload", "LLMWorkload", "Workload"]
