"""Weight sync: the trainer publishes (version, named tensors); receivers swap them in atomically.

One small interface, four transports (one file each), chosen by name from ``TRANSPORTS``:

- ``shm``: same-host shared memory; two slots allocated once; zero-copy receive.
- ``dist``: torch.distributed (gloo on CPU, NCCL on GPU), one process pair per trainer shard and
  receiver, bucket by bucket; a sharded trainer sends each shard straight to every receiver.
- ``object_store``: Ray's object store (the baseline most Ray users write).
- ``disk``: safetensors checkpoint files reloaded by the receiver (the other usual baseline).

Life cycle, the same for every transport::

    pub = TRANSPORTS[kind].Publisher(tensors, receivers=["gen0", "gen1"], timeout_s=30)
    rcv = TRANSPORTS[kind].Receiver(model, [pub.address], "gen0", timeout_s=30)
    pub.connect(); rcv.connect()          # concurrently: dist pairs rendezvous here
    ticket = pub.publish(version, tensors) # returns once the trainer may change its tensors again
    rcv.receive([ticket])                  # in the receiver: fill a slot, drain, swap
    with rcv.serving() as version: ...     # forward passes in the receiver
    pub.finish()                           # transfers done; receivers that failed are in pub.lost

A sharded trainer has one publisher per shard (``shard=i``); a receiver takes every shard's
address and, on each receive, every shard's ticket of one version, and swaps only after all are
filled. A shard sends whole tensors, *pieces*, or both. A piece is rows ``[start, start + its
rows)`` of a full tensor, declared by ``rows={name: (start, full_shape)}`` to ``Publisher``; the
pieces of a tensor over all shards must hold each row exactly once, and the receiver holds (and
serves) the full tensors. An FSDP2 trainer group publishes this way, each rank its own rows::

    tensors, rows = shard_pieces(model.state_dict(), include_replicated=rank == 0)
    pub = TRANSPORTS[kind].Publisher(tensors, receivers, shard=rank, rows=rows)
    pub.publish(version, shard_pieces(model.state_dict(), include_replicated=rank == 0)[0])

A ticket is small and picklable; the controller carries it from trainer to receivers, so the
fan-out stays visible at the call site. With a pull transport (``Receiver.skips_versions``:
object_store, disk) a receiver may skip versions and take only the newest ticket; a push
transport (shm, dist) needs every receiver to take every publish, in order. A receiver that
dies or hangs surfaces within ``timeout_s`` as a ``ReceiverLost`` naming it (or in ``pub.lost``),
and the publisher carries on with the receivers that remain.
"""

from __future__ import annotations

from relayrl.weight_sync import disk, dist, object_store, shm
from relayrl.weight_sync.base import ReceiverLost, ReceiveStats, Ticket
from relayrl.weight_sync.sharding import chunk_rows, shard_pieces

TRANSPORTS = {"shm": shm, "dist": dist, "object_store": object_store, "disk": disk}

__all__ = ["TRANSPORTS", "ReceiveStats", "ReceiverLost", "Ticket", "chunk_rows", "shard_pieces"]
