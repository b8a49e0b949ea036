"""Checkpoint files, the other baseline users know: the trainer writes a safetensors file per
version (to a temporary name, then renamed, so a reader never sees half a file) and each receiver
reloads it into its staging slot.

With ``durable=True`` (the default) the file is fsynced before the ticket is handed out, so the
checkpoint is on disk when the trainer carries on, as a checkpoint is meant to be. With
``durable=False`` it may still sit in the page cache only; the receivers then read it from
memory, which is the fastest a file-based sync can be (and loses the file on a crash).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

from relayrl.weight_sync.base import ReceiverBase, ReceiveStats, Ticket
from relayrl.weight_sync.buckets import Layout, Rows

KEEP = 2  # newest files kept: a receiver may still be reading the older one


class Publisher:
    """The trainer side: one safetensors file per version."""

    kind = "disk"

    def __init__(
        self,
        tensors: Mapping[str, Tensor],
        receivers: Sequence[str],
        *,
        timeout_s: float = 60.0,
        shard: int = 0,
        bucket_bytes: int = 256 << 20,
        directory: str | None = None,
        durable: bool = True,
        rows: Rows | None = None,
    ):
        self.layout = Layout.of(tensors, bucket_bytes=bucket_bytes, rows=rows)
        self.receivers = list(receivers)
        self.timeout_s = timeout_s
        self.shard = shard
        self.durable = durable
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="relayrl-sync-")
        self.directory = directory or self._tmp.name
        os.makedirs(self.directory, exist_ok=True)
        self.lost: dict[str, str] = {}
        self._files: list[str] = []

    @property
    def address(self) -> dict[str, Any]:
        """What a receiver needs."""
        return {"kind": self.kind, "shard": self.shard, "layout": self.layout}

    def connect(self) -> None:
        """Nothing to rendezvous."""

    def publish(self, version: int, tensors: Mapping[str, Tensor]) -> Ticket:
        """Write the checkpoint of ``version``; the ticket carries its path."""
        start = time.perf_counter()
        self.layout.check(tensors)
        path = os.path.join(self.directory, f"shard{self.shard}-v{version}.safetensors")
        save_file({n: t.detach().contiguous() for n, t in tensors.items()}, path + ".tmp")
        if self.durable:
            fsync_path(path + ".tmp")
        os.replace(path + ".tmp", path)
        if self.durable:
            fsync_path(self.directory)
        self._files.append(path)
        while len(self._files) > KEEP:
            os.unlink(self._files.pop(0))
        stall = time.perf_counter() - start
        return Ticket(self.kind, self.shard, version, path, stall, self.layout.nbytes)

    def finish(self, timeout_s: float | None = None) -> dict[str, str]:
        """Nothing in flight on the trainer side; returns the receivers lost so far."""
        return dict(self.lost)

    def close(self) -> None:
        """Delete the files this publisher wrote."""
        for path in self._files:
            if os.path.exists(path):
                os.unlink(path)
        self._files = []
        if self._tmp is not None:
            self._tmp.cleanup()


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's entry names: a rename, a new file) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Receiver(ReceiverBase):
    """The receiver side: reload the file into the staging slot, swap."""

    kind = "disk"
    # Each version is its own file and the publisher waits for no one; only the newest KEEP
    # files stay, so a receiver must take the newest ticket soon after it is published.
    skips_versions = True

    def receive(self, tickets: Sequence[Ticket]) -> ReceiveStats:
        """Take one version from its checkpoint files."""
        version = self._check(tickets)
        slot = self.state.staging()

        def fetch() -> None:
            ordered = sorted(tickets, key=lambda t: t.shard)
            for a, ticket in zip(self.addresses, ordered, strict=True):
                self.state.fill(slot, load_file(ticket.payload), a["layout"])

        return self._timed(fetch, slot, version)
