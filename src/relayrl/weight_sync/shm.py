"""Same-host shared memory: two slots in /dev/shm, allocated once, written by the trainer in
turn; a receiver whose precision matches binds its model straight to a slot (zero-copy).

Publishes are numbered (a version may be published twice, e.g. during a warm start). The
trainer writes publish n into the slot that held publish n-2, so before writing it waits until
every live receiver has swapped past n-2 (each receiver acknowledges the publish it serves in
a small shared header). A receiver that does not within ``timeout_s`` is declared lost and the
trainer carries on without it. A receiver in another precision, or whose shards send pieces
(rows of full tensors, which no one slot holds whole), copies the slots into its own staging slot
instead.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from relayrl.weight_sync.base import ReceiverBase, ReceiverLost, ReceiveStats, Ticket
from relayrl.weight_sync.buckets import Layout, Rows, copy_into

EVICTED = -2  # written into a lost receiver's acknowledgement
POLL_S = 0.0002


def _map(path: str, nbytes: int, *, create: bool) -> Tensor:
    if create:
        with open(path, "wb") as f:
            f.truncate(max(nbytes, 1))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*from_file.*")
        return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)


PREFIX = "relayrl-sync-"  # then the creating process's pid, a random id, the shard and the part


def sweep_orphans(directory: str = "/dev/shm") -> list[str]:
    """Remove the weight-sync files whose creating process is gone (a killed run leaves its
    files behind: nothing ran its ``close``); returns their names. The pid in a file's name is
    only meaningful on this host, which is the only one that sees this ``/dev/shm``."""
    removed = []
    for path in Path(directory).glob(f"{PREFIX}*"):
        pid = path.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class Publisher:
    """The trainer side: packs each version into the slot no live receiver reads."""

    kind = "shm"

    def __init__(
        self,
        tensors: Mapping[str, Tensor],
        receivers: Sequence[str],
        *,
        timeout_s: float = 60.0,
        shard: int = 0,
        bucket_bytes: int = 256 << 20,
        directory: str = "/dev/shm",
        rows: Rows | None = None,
    ):
        if not os.path.isdir(directory):
            raise ValueError(f"shared-memory directory {directory!r} does not exist")
        self.layout = Layout.of(tensors, bucket_bytes=bucket_bytes, rows=rows)
        self.receivers = list(receivers)
        self.timeout_s = timeout_s
        self.shard = shard
        sweep_orphans(directory)
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-shard{shard}"
        prefix = os.path.join(directory, name)
        self.paths = [f"{prefix}-slot{i}" for i in range(2)] + [f"{prefix}-header"]
        self.slots = [_map(p, self.layout.nbytes, create=True) for p in self.paths[:2]]
        for slot in self.slots:
            slot.zero_()  # fault every page in now, not on the first publish
        # header: publish number held by slot 0 and slot 1, then the one each receiver serves
        header_bytes = 8 * (2 + len(self.receivers))
        self.header = _map(self.paths[2], header_bytes, create=True).view(torch.int64)
        self.header.fill_(-1)
        self.views = [self.layout.views(slot) for slot in self.slots]
        self.lost: dict[str, str] = {}
        self._next = 0
        self._published = 0

    @property
    def address(self) -> dict[str, Any]:
        """What a receiver needs to attach."""
        return {
            "kind": self.kind,
            "shard": self.shard,
            "layout": self.layout,
            "paths": self.paths,
            "receivers": self.receivers,
        }

    def connect(self) -> None:
        """Nothing to rendezvous: receivers map the files themselves."""

    def publish(self, version: int, tensors: Mapping[str, Tensor]) -> Ticket:
        """Write ``tensors`` as ``version`` into the free slot; returns the ticket for receivers."""
        start = time.perf_counter()
        slot = self._next
        old = int(self.header[slot])
        if old >= 0:
            self._await_release(old)
        self.layout.check(tensors)
        copy_into(self.views[slot], tensors)
        self.header[slot] = self._published
        payload = (slot, self._published)
        self._next, self._published = 1 - slot, self._published + 1
        stall = time.perf_counter() - start
        return Ticket(self.kind, self.shard, version, payload, stall, self.layout.nbytes)

    def _await_release(self, old: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            holding = [
                (i, name)
                for i, name in enumerate(self.receivers)
                if name not in self.lost and int(self.header[2 + i]) == old
            ]
            if not holding:
                return
            if time.monotonic() > deadline:
                for i, name in holding:
                    self.lost[name] = (
                        f"still served publish #{old} after {self.timeout_s:g} s, "
                        "blocking the slot of the next one"
                    )
                    self.header[2 + i] = EVICTED
                names = [n for _, n in holding]
                warnings.warn(f"weight sync: lost receivers {names}", stacklevel=3)
                return
            time.sleep(POLL_S)

    def finish(self, timeout_s: float | None = None) -> dict[str, str]:
        """Nothing is in flight after ``publish``; returns the receivers lost so far."""
        return dict(self.lost)

    def close(self) -> None:
        """Remove the shared-memory files (mappings stay valid until dropped)."""
        for path in self.paths:
            if os.path.exists(path):
                os.unlink(path)


class Receiver(ReceiverBase):
    """The receiver side: binds the model to the trainer's slot, or copies it when casting or
    assembling pieces."""

    kind = "shm"

    def __init__(
        self,
        model: torch.nn.Module,
        addresses: Sequence[dict[str, Any]],
        name: str,
        *,
        precision: str | None = None,
        timeout_s: float = 60.0,
    ):
        addresses = sorted(addresses, key=lambda a: a["shard"])
        self.maps = [
            [_map(p, a["layout"].nbytes, create=False) for p in a["paths"][:2]] for a in addresses
        ]
        self.headers = [
            _map(a["paths"][2], 8 * (2 + len(a["receivers"])), create=False).view(torch.int64)
            for a in addresses
        ]
        for a in addresses:
            if name not in a["receivers"]:
                raise ValueError(f"receiver {name!r} is not among the publisher's {a['receivers']}")
        self.index = [a["receivers"].index(name) for a in addresses]
        self.zero_copy = not any(a["layout"].pieced for a in addresses) and all(
            a["layout"].astype(precision) == a["layout"] for a in addresses
        )
        external = [[m[i] for m in self.maps] for i in range(2)] if self.zero_copy else None
        super().__init__(
            model,
            addresses,
            name,
            precision=precision,
            timeout_s=timeout_s,
            external_slots=external,
        )
        self.wire_views = [
            [a["layout"].views(m) for m in maps]
            for a, maps in zip(self.addresses, self.maps, strict=True)
        ]

    def receive(self, tickets: Sequence[Ticket]) -> ReceiveStats:
        """Serve the tickets' version: swap to its slot (zero-copy) or copy it in, then ack."""
        version = self._check(tickets)
        tickets = sorted(tickets, key=lambda t: t.shard)
        for header, index, ticket in zip(self.headers, self.index, tickets, strict=True):
            if int(header[2 + index]) == EVICTED:
                raise ReceiverLost(self.name, "evicted by the publisher after a timeout")
            slot, number = ticket.payload
            if int(header[slot]) != number:
                raise RuntimeError(
                    f"receiver {self.name!r}: slot {slot} of shard {ticket.shard} holds publish "
                    f"#{int(header[slot])}, not #{number} (version {version}): the ticket is stale"
                )
        if self.zero_copy:
            if len({t.payload[0] for t in tickets}) != 1:
                raise RuntimeError(f"receiver {self.name!r}: shards published into different slots")
            stats = self._timed(lambda: None, tickets[0].payload[0], version)
        else:
            slot = self.state.staging()

            def fetch() -> None:
                for a, views, ticket in zip(self.addresses, self.wire_views, tickets, strict=True):
                    self.state.fill(slot, views[ticket.payload[0]], a["layout"])

            stats = self._timed(fetch, slot, version)
        for header, index, ticket in zip(self.headers, self.index, tickets, strict=True):
            header[2 + index] = ticket.payload[1]
        return stats
