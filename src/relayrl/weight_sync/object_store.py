"""Ray's object store, the baseline most Ray users write: the trainer ``ray.put``s its tensors
(one copy into shared memory), the ticket carries the reference, and each receiver ``ray.get``s
it (zero-copy on the same node) and copies it into its staging slot."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from torch import Tensor

from relayrl.weight_sync.base import ReceiverBase, ReceiveStats, Ticket
from relayrl.weight_sync.buckets import Layout, Rows, parse_dtype

KEEP = 2  # versions whose objects stay referenced: a receiver may still be fetching the older one


def _raw(tensor: Tensor) -> Any:
    """A numpy view of the tensor's bytes (numpy has no bfloat16, so view as same-size ints)."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    elif tensor.dtype.is_floating_point and tensor.element_size() == 1:
        tensor = tensor.view(torch.uint8)
    return tensor.numpy()


class Publisher:
    """The trainer side: one object per version."""

    kind = "object_store"

    def __init__(
        self,
        tensors: Mapping[str, Tensor],
        receivers: Sequence[str],
        *,
        timeout_s: float = 60.0,
        shard: int = 0,
        bucket_bytes: int = 256 << 20,
        rows: Rows | None = None,
    ):
        self.layout = Layout.of(tensors, bucket_bytes=bucket_bytes, rows=rows)
        self.receivers = list(receivers)
        self.timeout_s = timeout_s
        self.shard = shard
        self.lost: dict[str, str] = {}
        self._refs: list[ray.ObjectRef] = []

    @property
    def address(self) -> dict[str, Any]:
        """What a receiver needs."""
        return {"kind": self.kind, "shard": self.shard, "layout": self.layout}

    def connect(self) -> None:
        """Nothing to rendezvous."""

    def publish(self, version: int, tensors: Mapping[str, Tensor]) -> Ticket:
        """Put the tensors in the object store; the ticket carries the reference."""
        start = time.perf_counter()
        self.layout.check(tensors)
        ref = ray.put({name: _raw(t) for name, t in tensors.items()})
        self._refs = [*self._refs[-(KEEP - 1) :], ref]
        stall = time.perf_counter() - start
        return Ticket(self.kind, self.shard, version, [ref], stall, self.layout.nbytes)

    def finish(self, timeout_s: float | None = None) -> dict[str, str]:
        """Nothing in flight on the trainer side; returns the receivers lost so far."""
        return dict(self.lost)

    def close(self) -> None:
        """Release the references."""
        self._refs = []


class Receiver(ReceiverBase):
    """The receiver side: fetch the object, copy (and cast) it into the staging slot, swap."""

    kind = "object_store"
    # Any published object stays readable while a ticket that refers to it is alive, and the
    # publisher waits for no one.
    skips_versions = True

    def receive(self, tickets: Sequence[Ticket]) -> ReceiveStats:
        """Take one version from the object store."""
        version = self._check(tickets)
        slot = self.state.staging()

        def fetch() -> None:
            ordered = sorted(tickets, key=lambda t: t.shard)
            for a, ticket in zip(self.addresses, ordered, strict=True):
                arrays = ray.get(ticket.payload[0], timeout=self.timeout_s)
                with warnings.catch_warnings():
                    # Ray hands out read-only views of the object store; we only read them.
                    warnings.filterwarnings("ignore", message="The given NumPy array is not")
                    tensors = {
                        s.name: torch.from_numpy(arrays[s.name]).view(parse_dtype(s.dtype))
                        for s in a["layout"].specs
                    }
                self.state.fill(slot, tensors, a["layout"])

        return self._timed(fetch, slot, version)
