"""What every transport shares: tickets, receive statistics, the lost-receiver error, and the
receiver half that owns the double-buffered weights."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.weight_sync.buckets import ReceiverState, Rows
from relayrl.weight_sync.sharding import shard_pieces


class ReceiverLost(RuntimeError):
    """A receiver did not take a version within the timeout, or its connection broke."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"weight-sync receiver {name!r} lost: {reason}")
        self.name = name
        self.reason = reason

    def __reduce__(self) -> tuple:
        return (type(self), (self.name, self.reason))


@dataclass
class Ticket:
    """What a receiver needs to take one published version of one trainer shard."""

    kind: str
    shard: int
    version: int
    payload: Any = None  # transport-specific: a slot index, an ObjectRef, a file path
    stall_s: float = 0.0  # how long ``publish`` held the trainer
    bytes: int = 0


@dataclass
class ReceiveStats:
    """How one ``receive`` went."""

    version: int
    fetch_s: float  # moving bytes into the staging slot (0 for a zero-copy swap)
    drain_s: float  # waiting for forward passes in flight before the swap
    total_s: float


class ReceiverBase:
    """The receiver half every transport shares: state, serving, version checks, timing."""

    kind = ""
    # Whether a receiver may skip versions and take only the newest (a pull transport). A push
    # transport (shm, dist) needs every receiver to take every publish: its publisher waits for
    # them, or sends to each.
    skips_versions = False

    def __init__(
        self,
        model: torch.nn.Module,
        addresses: Sequence[dict[str, Any]],
        name: str,
        *,
        precision: str | None = None,
        timeout_s: float = 60.0,
        external_slots: Sequence[Sequence[torch.Tensor]] | None = None,
    ):
        if not addresses:
            raise ValueError("a receiver needs the address of at least one trainer shard")
        for address in addresses:
            if address["kind"] != self.kind:
                kind = address["kind"]
                raise ValueError(
                    f"address of a {kind!r} publisher given to a {self.kind!r} receiver"
                )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.name = name
        self.addresses = sorted(addresses, key=lambda a: a["shard"])
        self.timeout_s = timeout_s
        self.precision = precision
        self.state = ReceiverState(
            model,
            [a["layout"] for a in self.addresses],
            precision=precision,
            external_slots=external_slots,
        )

    @property
    def version(self) -> int:
        """The version the model serves now (-1 before the first receive)."""
        return self.state.version

    def serving(self) -> Any:
        """Context manager around a forward pass; yields the version it runs on."""
        return self.state.serving()

    def connect(self) -> None:
        """Join the publishers (a no-op unless the transport rendezvous)."""

    def close(self) -> None:
        """Release transport resources."""

    def _check(self, tickets: Sequence[Ticket]) -> int:
        shards = sorted(t.shard for t in tickets)
        expected = [a["shard"] for a in self.addresses]
        if shards != expected:
            raise ValueError(f"receiver {self.name!r} expects shards {expected}, got {shards}")
        versions = {t.version for t in tickets}
        if len(versions) != 1:
            raise ValueError(f"tickets of one receive must share a version, got {sorted(versions)}")
        return versions.pop()

    def _timed(self, fetch: Any, slot: int, version: int) -> ReceiveStats:
        start = time.perf_counter()
        fetch()
        fetched = time.perf_counter()
        drain = self.state.swap(slot, version)
        return ReceiveStats(version, fetched - start, drain, time.perf_counter() - start)


class TrainerSide:
    """A trainer's end of weight sync: its publisher and the stall of every publish, in order.

    With ``in_place`` (dist only) the model's tensors are bound into the publisher's send buffer
    when it opens; the trainer then calls ``writable`` before it writes them, and the time that
    waits for sends in flight is added to the stall of the publish it waited for.

    Rank ``rank`` of an FSDP2 trainer group of ``world > 1`` publishes as shard ``rank``: its
    rows of every sharded tensor, and on rank 0 the tensors every rank holds whole
    (``shard_pieces``).
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        bucket_bytes: int,
        streams: int,
        in_place: bool,
        rank: int = 0,
        world: int = 1,
    ):
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.streams = streams
        self.in_place = in_place
        self.rank = rank
        self.world = world
        self.publisher: Any = None
        self.stalls: list[float] = []
        self.payload_bytes = 0  # bytes of tensor data this rank sends per publish

    def open(
        self, transport: Any, model: torch.nn.Module, receivers: list[str], host: str
    ) -> dict[str, Any]:
        """Create the publisher of ``transport`` (a ``TRANSPORTS`` entry) for ``model``'s
        tensors; returns its address."""
        dist = transport.Publisher.kind == "dist"
        if self.in_place and not dist:
            raise ValueError(
                f"sync.in_place=true needs the dist transport, got {transport.Publisher.kind!r}"
            )
        options = {"host": host, "streams": self.streams} if dist else {}
        state = model.state_dict()
        tensors, rows = self._share(state)
        self.payload_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.publisher = transport.Publisher(
            tensors,
            receivers,
            shard=self.rank,
            rows=rows,
            timeout_s=self.timeout_s,
            bucket_bytes=self.bucket_bytes,
            **options,
        )
        if self.in_place:
            live = dict(model.named_parameters()) | dict(model.named_buffers())
            self.publisher.bind({name: t for name, t in live.items() if name in state})
        return self.publisher.address

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> Ticket:
        """Publish ``tensors`` (the model's state dict) as ``version`` and record the stall."""
        if self.publisher is None:
            raise RuntimeError("call open_sync() before publish()")
        ticket = self.publisher.publish(version, self._share(tensors)[0])
        self.stalls.append(ticket.stall_s)
        return ticket

    def _share(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Rows | None]:
        """What this rank sends, and the rows it holds of each piece (None for whole tensors)."""
        if self.world == 1:
            return state, None
        return shard_pieces(state, include_replicated=self.rank == 0)

    def writable(self) -> float:
        """Wait until the model's tensors may be written (a no-op unless in place); returns the
        seconds waited, which count as stall of the last publish."""
        if not self.in_place or self.publisher is None:
            return 0.0
        waited = self.publisher.writable()
        if self.stalls:
            self.stalls[-1] += waited
        return waited

    def stats(self) -> dict:
        """Trainer-side stall of every publish, in order, the receivers lost, and the bytes of
        tensor data this rank sends per publish."""
        lost = self.publisher.finish() if self.publisher is not None else {}
        return {"stall_s": list(self.stalls), "lost": lost, "payload_bytes": self.payload_bytes}

    def close(self) -> None:
        """Close the publisher: shm removes its files, which would outlive a killed process."""
        if self.publisher is not None:
            self.publisher.close()
