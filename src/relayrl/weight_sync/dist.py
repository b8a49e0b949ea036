"""torch.distributed transport: gloo process pairs per (trainer shard, receiver), bucket by
bucket, sends issued asynchronously.

The DDMA analogue: every trainer shard has its own publisher and sends its own tensors (whole,
or its rows of each as pieces) straight to every receiver; nothing is gathered on one rank. Pairs
(rather than one group holding every receiver) keep a failure local: a receiver that dies breaks
only its own pair, the publisher names it and carries on with the others. ``publish`` packs the
tensors into a send buffer allocated once, issues the sends and returns, so the trainer stalls
for one memory copy plus any sends of the previous version still in flight.

``bind`` moves the trainer's tensors into the send buffer itself, so a publish copies nothing
and sends straight from the trainer's memory (and the trainer holds no second copy of its
weights). The price: the trainer must not write its tensors while they are being sent, so it
calls ``writable`` before every optimizer step, which waits for the sends in flight. In a
training loop that wait overlaps the next batch's forward and backward; the whole transfer is
the worst case, and it grows with the number of receivers.

Each (shard, receiver) has ``streams`` pairs, and bucket ``j`` travels on pair ``j % streams``;
a payload of fewer than ``streams`` buckets is cut into buckets of about 1/``streams`` of it.
One gloo pair over loopback TCP moves ~4.6 GB/s here; two in parallel ~7.2 GB/s, four ~6.5 GB/s
(4 GB between two plain processes on two cores), so the default is 2.
"""

from __future__ import annotations

import datetime
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from relayrl.weight_sync.base import ReceiverBase, ReceiveStats, Ticket
from relayrl.weight_sync.buckets import Layout, Rows, copy_into

BACKENDS = ("gloo",)


def _pair(
    store: dist.Store, receiver: str, rank: int, timeout_s: float, stream: int
) -> dist.ProcessGroup:
    """Stream ``stream`` of the two-process gloo groups between a publisher (rank 0) and
    ``receiver`` (rank 1)."""
    prefixed = dist.PrefixStore(f"relayrl/sync/{receiver}/{stream}", store)
    return dist.ProcessGroupGloo(prefixed, rank, 2, datetime.timedelta(seconds=timeout_s))


def _pair_of(pairs: Sequence[dist.ProcessGroup], bucket: int) -> dist.ProcessGroup:
    """The pair bucket number ``bucket`` travels on. Sender and receiver both route with this,
    so their broadcasts on each pair match one to one."""
    return pairs[bucket % len(pairs)]


def _ready_key(receiver: str) -> str:
    return f"relayrl/sync/ready/{receiver}"


def _broadcast(group: dist.ProcessGroup, tensor: Tensor) -> dist.Work:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


class Publisher:
    """The trainer side of one shard: a store to rendezvous on and a pair per receiver."""

    kind = "dist"

    def __init__(
        self,
        tensors: Mapping[str, Tensor],
        receivers: Sequence[str],
        *,
        timeout_s: float = 60.0,
        shard: int = 0,
        bucket_bytes: int = 256 << 20,
        host: str = "127.0.0.1",
        backend: str = "gloo",
        connect_timeout_s: float = 300.0,
        streams: int = 2,
        rows: Rows | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}: CPU-only build")
        if not isinstance(streams, int) or streams < 1:
            raise ValueError(
                f"streams must be a positive int (pairs per receiver), got {streams!r}"
            )
        self.streams = streams
        self.layout = Layout.of(tensors, bucket_bytes=bucket_bytes, rows=rows)
        if len(self.layout.buckets) < streams:  # cut smaller so that every pair carries some
            share = -(-self.layout.nbytes // streams)
            self.layout = Layout.of(tensors, bucket_bytes=min(bucket_bytes, share), rows=rows)
        self.receivers = list(receivers)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.shard = shard
        self.store = dist.TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=connect_timeout_s),
        )
        self.host = host
        self.buffer = self.layout.allocate()
        self.views = self.layout.views(self.buffer)
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayrl-sync")
        self._issuing: Future | None = None
        self.groups: dict[str, list[dist.ProcessGroup]] = {}
        self.lost: dict[str, str] = {}
        self._pending: list[tuple[str, dist.Work]] = []
        self.bound = False

    @property
    def address(self) -> dict[str, Any]:
        """What a receiver needs to join."""
        return {
            "kind": self.kind,
            "shard": self.shard,
            "layout": self.layout,
            "host": self.host,
            "port": self.store.port,
            "streams": self.streams,
        }

    def connect(self) -> None:
        """Form the pairs with every receiver (each receiver calls its ``connect`` meanwhile).

        Both sides first meet in the store (waiting up to ``connect_timeout_s``: receivers may
        still be starting), so the pair itself forms at once and ``timeout_s`` bounds transfers.
        """
        wait = datetime.timedelta(seconds=self.connect_timeout_s)
        for name in self.receivers:
            try:
                self.store.wait([_ready_key(name)], wait)
                self.groups[name] = [
                    _pair(self.store, name, 0, self.timeout_s, k) for k in range(self.streams)
                ]
            except RuntimeError as e:
                self._lose(name, f"did not connect ({_first_line(e)})")

    def bind(self, tensors: Mapping[str, Tensor]) -> None:
        """Move ``tensors`` into the send buffer: each one's ``.data`` becomes its view of it.

        Pass the tensor objects the trainer keeps (``dict(model.named_parameters())`` plus its
        buffers), not a ``state_dict`` (whose tensors are detached copies of the references).
        From now on ``publish`` skips every tensor that already lives in its view, and the
        trainer calls ``writable`` before it writes them.
        """
        unknown = sorted(set(tensors) - set(self.views))
        if unknown:
            raise ValueError(f"bind: tensors not in the layout: {unknown[:5]}")
        self.finish()
        with torch.no_grad():
            for name, tensor in tensors.items():
                view = self.views[name]
                if tuple(tensor.shape) != tuple(view.shape) or tensor.dtype != view.dtype:
                    raise ValueError(
                        f"bind: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                        f"the layout has {view.dtype} {tuple(view.shape)}"
                    )
                view.copy_(tensor)
                tensor.data = view
        self.bound = True

    def writable(self) -> float:
        """Wait until the trainer may write its tensors again; returns the seconds waited.

        Zero unless ``bind`` put the tensors in the send buffer: then the sends in flight must
        end first (a receiver lost meanwhile is reported by ``finish`` as usual).
        """
        if not self.bound:
            return 0.0
        start = time.perf_counter()
        self.finish()
        return time.perf_counter() - start

    def publish(self, version: int, tensors: Mapping[str, Tensor]) -> Ticket:
        """Pack ``tensors`` and start sending them to every live receiver; returns the ticket.

        The trainer waits for the pack (one copy; none for bound tensors) only: a sender thread
        issues the sends, so the stall does not grow with the number of receivers.
        """
        start = time.perf_counter()
        self.finish()
        self.layout.check(tensors)
        copy_into(self.views, tensors)
        self._issuing = self._sender.submit(self._issue, list(self.groups.items()))
        stall = time.perf_counter() - start
        return Ticket(self.kind, self.shard, version, None, stall, self.layout.nbytes)

    def _issue(
        self, groups: list[tuple[str, list[dist.ProcessGroup]]]
    ) -> list[tuple[str, dist.Work]]:
        return [
            (receiver, _broadcast(_pair_of(pairs, j), self.buffer[begin:end]))
            for j, (begin, end) in enumerate(self.layout.buckets)
            for receiver, pairs in groups
        ]

    def finish(self, timeout_s: float | None = None) -> dict[str, str]:
        """Wait for the sends in flight; returns the receivers lost so far."""
        timeout = datetime.timedelta(seconds=timeout_s or self.timeout_s)
        if self._issuing is not None:
            self._pending, self._issuing = self._issuing.result(), None
        for name, work in self._pending:
            if name in self.lost:
                continue
            try:
                work.wait(timeout)
            except RuntimeError as e:
                self._lose(name, _first_line(e))
        self._pending = []
        return dict(self.lost)

    def _lose(self, name: str, reason: str) -> None:
        self.lost[name] = reason
        self.groups.pop(name, None)
        warnings.warn(f"weight sync: lost receiver {name!r}: {reason}", stacklevel=3)

    def close(self) -> None:
        """Drop the pairs and the store."""
        self._sender.shutdown(wait=True)
        self.groups.clear()
        self._pending, self._issuing = [], None


def _first_line(error: BaseException) -> str:
    """Gloo's message without its source location and boilerplate advice."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = re.sub(r"^\[[^\]]*\.(cc|h|cpp):\d+\]\s*", "", text.splitlines()[0])
    return line.split(". This is typically")[0][:300]


class Receiver(ReceiverBase):
    """The receiver side: one pair per trainer shard; receives into the staging slot."""

    kind = "dist"

    def __init__(
        self,
        model: torch.nn.Module,
        addresses: Sequence[dict[str, Any]],
        name: str,
        *,
        precision: str | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 300.0,
    ):
        super().__init__(model, addresses, name, precision=precision, timeout_s=timeout_s)
        self.connect_timeout_s = connect_timeout_s
        # In another precision, or with pieces to write into full tensors, the slots are not
        # laid out as the wire: receive into wire buffers, then fill.
        copying = self.state.layouts != self.state.wire_layouts
        self.wire = [a["layout"].allocate() for a in self.addresses] if copying else None
        self.groups: list[list[dist.ProcessGroup]] = []

    def connect(self) -> None:
        """Join the pairs of every trainer shard."""
        for a in self.addresses:
            timeout = datetime.timedelta(seconds=self.connect_timeout_s)
            store = dist.TCPStore(a["host"], a["port"], is_master=False, timeout=timeout)
            store.set(_ready_key(self.name), "1")
            streams = a["streams"]
            self.groups.append(
                [_pair(store, self.name, 1, self.timeout_s, k) for k in range(streams)]
            )

    def receive(self, tickets: Sequence[Ticket]) -> ReceiveStats:
        """Receive every shard's buckets into the staging slot, then swap it in."""
        version = self._check(tickets)
        if len(self.groups) != len(self.addresses):
            raise RuntimeError(f"receiver {self.name!r}: call connect() before receive()")
        slot = self.state.staging()
        timeout = datetime.timedelta(seconds=self.timeout_s)

        def fetch() -> None:
            for i, (a, pairs) in enumerate(zip(self.addresses, self.groups, strict=True)):
                target = self.state.slots[slot][i] if self.wire is None else self.wire[i]
                try:  # post every bucket's receive at once, so the sender never waits on us
                    works = [
                        _broadcast(_pair_of(pairs, j), target[b:e])
                        for j, (b, e) in enumerate(a["layout"].buckets)
                    ]
                    for work in works:
                        work.wait(timeout)
                except RuntimeError as e:
                    raise RuntimeError(
                        f"receiver {self.name!r}: trainer shard {a['shard']} at "
                        f"{a['host']}:{a['port']} failed mid-transfer: {_first_line(e)}"
                    ) from e
                if self.wire is not None:
                    self.state.fill(slot, a["layout"].views(self.wire[i]), a["layout"])

        return self._timed(fetch, slot, version)
