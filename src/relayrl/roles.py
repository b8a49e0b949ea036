"""Roles as data: a workload's role table, its placement, and the replacement of a member.

A workload declares one ``Role`` per kind of actor it runs: the executor class, how many, the
Ray resources each needs, whether it receives weights (and from which role), whether a dead one
is replaced, and what of its state a run checkpoint keeps. ``Placed.place`` checks the table
(``check_table``) before any actor exists, puts every member in a bundle of one placement group
(``Placement``) and builds it. From then on topology, snapshots and restores, traces, weight-sync
receivers, replacement (``Placed.recreate``) and shutdown go over the table, so a new workload
adds a table and classes, never a branch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relayrl.executors.worker_side import node_of

# Ray CPUs each actor reserves in its placement-group bundle: enough to make a bundle (Ray refuses
# empty ones), small enough that many actors on a 2-CPU node leave room for every task. Executors
# set their own torch thread counts.
CPU_SHARE = 0.01
PLACEMENT_TIMEOUT_S = 120
# Start-up of the run's actors (torch import, model build): minutes on a loaded 2-core machine.
ACTOR_START_TIMEOUT_S = 300
# How a role's state reaches a run checkpoint: through the controller (``state_dict``), as files
# each member writes itself (``save_checkpoint``: the trainer ranks), or not at all.
SAVED = ("state_dict", "own_files", "none")


@dataclass(frozen=True)
class Role:
    """One row of a workload's role table.

    ``make(i, k)`` returns the constructor's ``(args, kwargs)`` of member ``i``'s ``k``-th
    incarnation (0 when placed, k for its k-th replacement); ``renew(actor, i, k)`` readies a
    replacement before its first call (what the placed members get later, in ``prepare``).
    ``receives`` names the role whose weights its members take, ``close`` the method that frees
    what a kill would leave behind, ``options`` extra Ray actor options (``max_concurrency``).
    ``keeps`` says in words what a checkpoint keeps of a member, ``saved`` how.
    """

    name: str
    cls: type
    count: int
    make: Callable[[int, int], tuple[tuple, dict[str, Any]]]
    cpus: float = CPU_SHARE
    gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    receives: str | None = None
    replaced: bool = False
    keeps: str = "nothing"
    saved: str = "none"
    traced: bool = False
    close: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    renew: Callable[[Any, int, int], None] | None = None

    def bundle(self) -> dict[str, float]:
        """The Ray resources one member reserves."""
        gpus = {"GPU": self.gpus} if self.gpus else {}
        return {"CPU": self.cpus, **gpus, **self.resources}


def ray_resources(resources: Mapping[str, float]) -> dict[str, Any]:
    """A config section's ``resources`` as ``Role`` fields: ``CPU`` and ``GPU`` apart from the
    custom node resources."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {
        "cpus": resources.get("CPU", CPU_SHARE),
        "gpus": resources.get("GPU", 0.0),
        "resources": custom,
    }


class RoleTableError(ValueError):
    """A role table that cannot be placed; the message is one line naming the role."""


def check_table(table: Sequence[Role], cluster: Mapping[str, float] | None = None) -> None:
    """Raise ``RoleTableError`` for a duplicate role name, a count below 1, an unknown ``saved``
    or ``receives``, or (given ``cluster``, Ray's total resources) a resource the cluster lacks:
    the role named is the first whose members no longer fit."""
    seen: set[str] = set()
    for role in table:
        if role.name in seen:
            raise RoleTableError(f"role {role.name!r} appears twice in the role table")
        seen.add(role.name)
        if role.count < 1:
            raise RoleTableError(f"role {role.name!r}: count={role.count}, must be >= 1")
        if role.saved not in SAVED:
            raise RoleTableError(f"role {role.name!r}: saved={role.saved!r}, one of {SAVED}")
    for role in table:
        if role.receives is not None and role.receives not in seen:
            raise RoleTableError(
                f"role {role.name!r}: receives={role.receives!r} is not a role of the table "
                f"{sorted(seen)}"
            )
    if cluster is None:
        return
    needed: dict[str, float] = {}
    for role in table:
        for key, amount in role.bundle().items():
            needed[key] = needed.get(key, 0.0) + amount * role.count
            have = cluster.get(key, 0.0)
            if needed[key] > have + 1e-9:
                raise RoleTableError(
                    f"role {role.name!r}: {role.count} x {key}={amount:g} brings the run's "
                    f"{key} to {needed[key]:g}, the cluster has {have:g} (ray status)"
                )


@dataclass
class Group:
    """One role's actors: the N ranks of one process group (the trainer) or M independent
    replicas. Call sites fan out visibly: ``group[i]`` is one member, ``for a in group`` all."""

    role: str
    actors: list[Any]

    def __len__(self) -> int:
        return len(self.actors)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.actors)

    def __getitem__(self, index: int) -> Any:
        return self.actors[index]

    @property
    def names(self) -> list[str]:
        """One name per member: the role for a group of one, ``role_i`` otherwise."""
        if len(self.actors) == 1:
            return [self.role]
        return [f"{self.role}_{i}" for i in range(len(self.actors))]

    def named(self) -> dict[str, Any]:
        """Members by name."""
        return dict(zip(self.names, self.actors, strict=True))


class Placement:
    """Where a table's members go: one Ray placement group with a bundle per member.

    ``colocated`` puts every member in one bundle, so all roles share a node. ``distributed``
    gives every member a bundle of its own with its role's resources, in one SPREAD placement
    group, so roles land on the nodes that carry their resources.
    """

    def __init__(self, strategy: str, table: Sequence[Role]):
        self.strategy = strategy
        self.index: dict[tuple[str, int], int] = {}
        bundles: list[dict[str, float]] = []
        for role in table:
            for i in range(role.count):
                if strategy == "colocated":
                    if not bundles:
                        bundles.append({})
                    for key, amount in role.bundle().items():
                        bundles[0][key] = bundles[0].get(key, 0.0) + amount
                    self.index[role.name, i] = 0
                else:
                    self.index[role.name, i] = len(bundles)
                    bundles.append(role.bundle())
        # Ray keeps resource amounts to 1e-4 and rounds a bundle down: 12 float sums of 0.01
        # would come out one unit short of the 12 actors that each ask for 0.01.
        bundles = [{key: round(amount, 4) for key, amount in b.items()} for b in bundles]
        self.roles = {role.name: role for role in table}
        kind = "STRICT_PACK" if strategy == "colocated" else "SPREAD"
        self.group = placement_group(bundles, strategy=kind)
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            raise RuntimeError(
                f"placement={strategy}: Ray could not place {len(bundles)} bundle(s) "
                f"{bundles} within {PLACEMENT_TIMEOUT_S} s; check that the cluster's nodes carry "
                "the resources each role asks for (ray status)"
            ) from None

    def options(self, role: str, i: int) -> dict[str, Any]:
        """Ray actor options that put member ``i`` of ``role`` in its bundle."""
        r = self.roles[role]
        return {
            "num_cpus": r.cpus,
            "num_gpus": r.gpus,
            "resources": dict(r.resources),
            "max_restarts": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.index[role, i]
            ),
        }

    def close(self) -> None:
        """Release the bundles (after the actors are killed)."""
        remove_placement_group(self.group)


@functools.cache
def remote_class(cls: type) -> Any:
    """``ray.remote(cls)``, made once per class: Ray exports an actor class (pickled, its code
    disassembled for a collision check) once per class object and job, so a fresh
    ``ray.remote(cls)`` per actor re-exported it for every actor and every replacement."""
    return ray.remote(cls)


class Placed:
    """A role table once placed: its placement and one ``Group`` per role, in table order.

    Before ``place`` (or after a failed one) it holds no role: every group is empty."""

    def __init__(self, table: Sequence[Role] = (), placement: Placement | None = None):
        self.table = {role.name: role for role in table}
        self.placement = placement
        self.groups = {role.name: Group(role.name, []) for role in table}

    @classmethod
    def place(cls, strategy: str, table: Sequence[Role]) -> Placed:
        """Check ``table`` against the cluster, reserve its bundles and create every member."""
        check_table(table, ray.cluster_resources())
        placed = cls(table, Placement(strategy, table))
        try:
            for role in table:
                group = placed.groups[role.name]
                for i in range(role.count):
                    group.actors.append(placed.create(role.name, i))
        except BaseException:  # a constructor that raises here leaves no actor or bundle behind
            placed.stop()
            raise
        return placed

    def __getitem__(self, role: str) -> Group:
        """The group of ``role``; an empty one for a role the table does not hold."""
        return self.groups.get(role) or Group(role, [])

    def all(self) -> list[Group]:
        """Every role's group, in table order."""
        return list(self.groups.values())

    def create(self, role: str, index: int, incarnation: int = 0) -> Any:
        """A new actor for member ``index`` of ``role`` in its bundle (not put in its group)."""
        r = self.table[role]
        args, kwargs = r.make(index, incarnation)
        options = {**self.placement.options(role, index), **r.options}
        return remote_class(r.cls).options(**options).remote(*args, **kwargs)

    def recreate(self, role: str, index: int, incarnation: int) -> Any:
        """The ``incarnation``-th replacement of member ``index`` of ``role``, ready for its
        first call (``Role.renew``); refused for a role that is not replaced."""
        r = self.table.get(role)
        if r is None or not r.replaced:
            replaced = [name for name, x in self.table.items() if x.replaced]
            raise ValueError(f"a {role} is not replaced: only members of {replaced} are")
        actor = self.create(role, index, incarnation)
        if r.renew is not None:
            r.renew(actor, index, incarnation)
        return actor

    def receivers(self, of: str = "trainer") -> dict[str, Any]:
        """The members that receive ``of``'s weights, by name."""
        return {
            name: actor
            for role in self.table.values()
            if role.receives == of
            for name, actor in self.groups[role.name].named().items()
        }

    def traced(self) -> dict[str, Any]:
        """The members that record spans, by name."""
        return {
            n: a for r in self.table.values() if r.traced for n, a in self[r.name].named().items()
        }

    def saved(self) -> list[Group]:
        """The groups whose ``state_dict`` a run checkpoint keeps."""
        return [self.groups[r.name] for r in self.table.values() if r.saved == "state_dict"]

    async def snapshot(self) -> dict[str, Any]:
        """Every saved member's ``state_dict``, by member name; changes nothing."""
        named = {name: a for g in self.saved() for name, a in g.named().items()}
        states = await asyncio.gather(*(a.state_dict.remote() for a in named.values()))
        return dict(zip(named, states, strict=True))

    def restore(self, parts: dict[str, Any]) -> None:
        """``load_state_dict`` every saved member from ``parts`` (what ``snapshot`` returned)."""
        named = {name: a for g in self.saved() for name, a in g.named().items()}
        missing = sorted(named.keys() - parts.keys())
        if missing:
            raise ValueError(
                f"the checkpoint has no state for {missing}; it holds {sorted(parts)} (was it "
                "written with other replica counts?)"
            )
        ray.get([a.load_state_dict.remote(parts[name]) for name, a in named.items()])

    def closing(self) -> list[Any]:
        """Calls (object refs) that free what killing the members would leave behind."""
        return [
            getattr(actor, role.close).remote()
            for role in self.table.values()
            if role.close is not None
            for actor in self.groups[role.name]
        ]

    def topology(self) -> dict:
        """summary.json's ``topology``: placement, and every actor's node, by role. It is the
        first call every actor answers, so it waits up to ``ACTOR_START_TIMEOUT_S`` for all."""
        return topology(self.all(), self.placement.strategy if self.placement else "none")

    def stop(self, extra: Sequence[Any] = ()) -> None:
        """Free what the members hold (``closing``, and the ``extra`` calls), kill them and
        release their bundles; the Ray instance stays up for the next run."""
        closing: list[Any] = list(extra)
        with contextlib.suppress(Exception):  # a dead member answers nothing; the kill still runs
            closing += self.closing()
        stop(self.all(), self.placement, closing)


def topology(groups: Sequence[Group], placement: str) -> dict:
    """summary.json's ``topology`` of ``groups``: placement, and every actor's node, by role."""
    refs = {g.role: [a.__ray_call__.remote(node_of) for a in g] for g in groups}
    every = [r for found in refs.values() for r in found]
    _, pending = ray.wait(every, num_returns=len(every), timeout=ACTOR_START_TIMEOUT_S)
    if pending:
        slow = sorted(role for role, found in refs.items() if set(found) & set(pending))
        raise RuntimeError(
            f"actors of {slow} did not start within {ACTOR_START_TIMEOUT_S} s (each imports "
            "torch and builds its model first); check `ray status` and the machine's load"
        )
    nodes = {role: ray.get(r) for role, r in refs.items()}
    return {
        "placement": placement,
        "nodes": len({node for found in nodes.values() for node, _ in found}),
        "roles": {
            g.role: [
                {"name": name, "node": node, "ip": ip}
                for name, (node, ip) in zip(g.names, nodes[g.role], strict=True)
            ]
            for g in groups
        },
    }


def stop(groups: Sequence[Group], placement: Placement | None, closing: Sequence[Any]) -> None:
    """Kill the actors of a run (the Ray instance stays up for the next run) and free their
    placement group, after waiting for the ``closing`` calls (object refs) to end: what a kill
    would leave behind (shm files of the trainer ranks' publishers, scoring processes)."""
    for ref in closing:
        with contextlib.suppress(Exception):  # it may already be dead; the kill below still runs
            ray.get(ref, timeout=30)
    for g in groups:
        for actor in g:
            ray.kill(actor)
    if placement is not None:
        placement.close()
