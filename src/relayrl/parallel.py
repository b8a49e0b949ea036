"""Data parallelism of a trainer group: the rendezvous, FSDP2 sharding and each rank's share.

A trainer group is ``world`` processes (Ray actors in a run), each holding ``1/world`` of the rows
of every parameter (FSDP2 ``fully_shard``) and its optimizer state, each training on its share of
every batch. Every rank receives the whole batch, so what depends on the batch alone (which
samples are stale, token and step counts, the minibatch order) is computed alike on every rank
without communication; only parameters, gradients, gradient norms, advantage statistics and the
logged metrics cross ranks.

Gradients are summed over ranks, not averaged as FSDP2 does by default: each rank's loss is its
share of the global loss (its local sum over the global count), so the ranks' gradients add up to
the gradient one process takes on the whole batch.

A collective must be entered by every rank in the same order. A rank with nothing to train on
therefore still runs every forward and backward the others run, on a filler sample whose loss
carries zero weight.
"""

from __future__ import annotations

import socket
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import Tensor, nn


def group_address() -> tuple[str, int]:
    """This node's IP address and a free TCP port, for rank 0 to host the group's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def join(host: str, port: int, rank: int, world: int, *, cuda: bool) -> None:
    """Join the default process group, whose store rank 0 hosts at ``host:port``: nccl for a
    model on CUDA, gloo on CPU. Every rank calls this at once."""
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world,
    )


def shard(model: nn.Module) -> None:
    """Shard ``model`` in place with FSDP2: every module of every ``ModuleList`` (its layers, each
    gathered only for its own forward and backward), then the root; gradients sum over ranks."""
    # Imported here: FSDP pulls in torch's compiler stack, ~0.7 s of CPU in every process that
    # imports this module, and only a trainer of several ranks shards.
    from torch.distributed.fsdp import FSDPModule, fully_shard

    # Innermost first: FSDP2 leaves out of a module's shards the parameters already sharded below.
    for module in reversed(list(model.modules())):
        if isinstance(module, nn.ModuleList):
            for layer in module:
                fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The default averages; a divide factor of 1 with sum-only collectives sums (gloo has
            # no PREMUL_SUM, which a factor alone would use).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def gather_cat(values: Tensor) -> Tensor:
    """The 1-D ``values`` of every rank, concatenated in rank order (float64); a collective when
    a process group exists, ``values`` as given otherwise. Ranks may hold different counts."""
    values = values.detach().flatten().double()
    if not (dist.is_available() and dist.is_initialized()):
        return values
    world = dist.get_world_size()
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([values.numel()]))
    width = max(int(c) for c in counts)
    padded = torch.zeros(width, dtype=torch.float64)
    padded[: values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[: int(c)] for g, c in zip(gathered, counts, strict=True)])


def sum_gradients(params: list[nn.Parameter]) -> None:
    """Sum each parameter's gradient over the ranks, in place, in one all-reduce (replicated
    parameters, as DDP keeps them); a collective. A gradient no rank has stays None, as it would
    in one process, so the optimizer skips that parameter everywhere."""
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    live = [p for p, u in zip(params, used.tolist(), strict=True) if u]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not live:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in live])
    dist.all_reduce(flat)
    offset = 0
    for p in live:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` (any picklable object) on every rank; a collective when a process
    group exists, ``value`` as given otherwise."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def share(count: int, rank: int, world: int) -> slice:
    """``rank``'s contiguous block of ``count`` items: blocks in rank order, sizes differing by
    at most one (the first ``count % world`` ranks take one more); possibly empty."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The full (unsharded) state dict on the CPU of rank 0, empty on the other ranks; a
    collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    # The gather copies a tied parameter once per name; alias the copies again, as in the
    # model's own state_dict, so that savers which drop tied names by storage (Hugging Face's)
    # write the same files as one trainer does.
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        alias = first.setdefault(id(param), name)
        if alias != name and name in state:
            state[name] = state[alias]
    return state


def global_metrics(shares: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
    """Each of ``shares`` summed and each of ``maxima`` maxed over the ranks; a collective when a
    process group exists, the values as given otherwise. A mean over the group's samples is the
    sum of each rank's local mean weighted by its fraction of the samples."""
    if not (dist.is_available() and dist.is_initialized()):
        return shares | maxima
    reduced = {}
    for values, op in ((shares, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX)):
        if values:
            tensor = torch.tensor(list(values.values()), dtype=torch.float64)
            dist.all_reduce(tensor, op=op)
            reduced |= dict(zip(values, tensor.tolist(), strict=True))
    return reduced
