"""What each rank of a row-sharded (FSDP2) trainer group publishes: its own rows, as pieces.

FSDP2 (``fully_shard``) holds every parameter as a ``DTensor`` placed ``Shard(0)`` on a 1-D mesh:
with ``chunk = ceil(rows / world)``, rank ``r`` holds rows ``[r * chunk, (r + 1) * chunk)``
clipped to ``rows`` (torch.chunk semantics; the last ranks may hold none). Buffers stay plain
tensors, the same on every rank. Each rank publishes its rows of every parameter through its own
publisher (``shard=rank``), and one rank also sends the tensors every rank holds whole, so each
rank sends about 1/world of the model and nothing is gathered.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``rows`` that ``rank`` of ``world`` holds under ``Shard(0)``
    (torch.chunk semantics); a rank past the last chunk holds the empty ``[rows, rows)``."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    chunk = -(-rows // world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def shard_pieces(
    state: Mapping[str, Tensor], *, include_replicated: bool
) -> tuple[dict[str, Tensor], dict[str, tuple[int, tuple[int, ...]]]]:
    """This rank's share of ``state`` as ``(tensors, rows)``, for
    ``Publisher(tensors, receivers, shard=rank, rows=rows)``.

    A ``DTensor`` placed ``Shard(0)`` on a 1-D mesh gives its local rows, named in ``rows`` with
    their first row and the full shape. Tensors every rank holds whole (plain tensors such as
    FSDP2's buffers, replicated ``DTensor``s) are included only when ``include_replicated``
    (``rank == 0``), so exactly one rank sends them. Every ``publish`` takes ``tensors`` computed
    afresh from the current state; the local rows are views of the rank's parameters, no copy.
    """
    # Imported here: torch.distributed.tensor costs ~0.5 s and ~40 MB, and only a sharded
    # trainer rank calls this, not the receivers that import this package.
    from torch.distributed.tensor import DTensor

    tensors: dict[str, Tensor] = {}
    rows: dict[str, tuple[int, tuple[int, ...]]] = {}
    for name, tensor in state.items():
        if isinstance(tensor, DTensor) and _row_sharded(name, tensor):
            mesh = tensor.device_mesh
            start, stop = chunk_rows(tensor.shape[0], mesh.size(), mesh.get_local_rank())
            local = tensor.to_local()
            if local.shape[0] != stop - start:
                raise ValueError(
                    f"tensor {name!r}: this rank holds {local.shape[0]} of its "
                    f"{tensor.shape[0]} rows, but Shard(0) gives it rows [{start}, {stop})"
                )
            tensors[name] = local
            rows[name] = (start, tuple(tensor.shape))
        elif include_replicated:
            tensors[name] = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return tensors, rows


def _row_sharded(name: str, tensor: Tensor) -> bool:
    """True for a DTensor placed ``Shard(0)`` on a 1-D mesh, False when every rank holds it
    whole."""
    from torch.distributed.tensor import Shard

    placements = tuple(tensor.placements)
    if all(p.is_replicate() for p in placements):
        return False
    if placements == (Shard(0),):
        return True
    raise ValueError(
        f"tensor {name!r} is placed {placements}: pieces need Shard(0) on a 1-D mesh (FSDP2 "
        "without HSDP or tensor parallelism) or replication"
    )
