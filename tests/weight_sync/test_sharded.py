"""A row-sharded trainer: each shard publishes its rows of every parameter (pieces) straight to
the receivers, which serve the full tensors bit-identically, swapping once every shard is in."""

from __future__ import annotations

import dataclasses
import socket
import threading

import pytest
import torch
import torch.distributed as dist
from conftest import on_ranks

from relayrl.weight_sync import TRANSPORTS, chunk_rows, shard_pieces
from relayrl.weight_sync.buckets import Layout, ReceiverState

WORLD = 2


class Tiny(torch.nn.Module):
    """``a`` has 5 rows (pieces of 3 + 2 over two shards), ``b`` 1 row (1 + none), and an int
    buffer that every shard holds whole."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(7, 5)
        self.b = torch.nn.Linear(5, 1)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def full_tensors(version: int) -> dict[str, torch.Tensor]:
    """Element i of every floating tensor is ``version + i / 8``; the buffer holds ``version``."""
    out = {
        name: (torch.arange(t.numel(), dtype=torch.float32) / 8 + version).view(t.shape)
        for name, t in Tiny().state_dict().items()
    }
    out["steps"] = torch.full((3,), version, dtype=torch.int64)
    return out


def pieces(full: dict[str, torch.Tensor], shard: int) -> tuple[dict, dict]:
    """What shard ``shard`` of two publishes: its rows of every parameter; shard 0 the buffer."""
    tensors, rows = {}, {}
    for name, tensor in full.items():
        if name == "steps":
            if shard == 0:
                tensors[name] = tensor
            continue
        start, stop = chunk_rows(tensor.shape[0], WORLD, shard)
        tensors[name] = tensor[start:stop]
        rows[name] = (start, tuple(tensor.shape))
    return tensors, rows


def together(*calls) -> list:
    """Run the calls in threads at once (dist pairs rendezvous and transfer only in pairs)."""
    results = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def build(kind: str, names: list[str], precision: str | None = None):
    """Two shard publishers of ``Tiny``'s pieces and one receiver per name, connected."""
    mod = TRANSPORTS[kind]
    pubs = []
    for shard in range(WORLD):
        tensors, rows = pieces(full_tensors(0), shard)
        pubs.append(
            mod.Publisher(tensors, names, shard=shard, rows=rows, timeout_s=20, bucket_bytes=64)
        )
    addresses = [p.address for p in pubs]
    rcvs = [mod.Receiver(Tiny(), addresses, n, precision=precision, timeout_s=20) for n in names]
    together(*(p.connect for p in pubs), *(r.connect for r in rcvs))
    return pubs, rcvs


def publish(pubs, version: int, full: dict[str, torch.Tensor]) -> list:
    return [p.publish(version, pieces(full, p.shard)[0]) for p in pubs]


@pytest.fixture(params=sorted(TRANSPORTS))
def kind(request, ray_session) -> str:
    return request.param


def test_chunk_rows_follows_torch_chunk() -> None:
    assert [chunk_rows(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [chunk_rows(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    for rows in range(10):
        for world in range(1, 5):
            chunks = torch.arange(rows).chunk(world)  # fewer than world when rows run out
            for rank in range(world):
                start, stop = chunk_rows(rows, world, rank)
                want = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(start, stop)) == want, (rows, world, rank)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        chunk_rows(5, 2, 2)


def test_pieces_from_two_shards_serve_the_full_tensors_bit_identically(kind: str) -> None:
    pubs, rcvs = build(kind, ["r0", "r1"])
    for version in (1, 2):
        full = full_tensors(version)
        tickets = publish(pubs, version, full)
        stats = together(*(lambda r=r, t=tickets: r.receive(t) for r in rcvs))
        assert all(p.finish() == {} for p in pubs)
        for rcv, stat in zip(rcvs, stats, strict=True):
            assert stat.version == version and rcv.version == version
            got = rcv.state.model.state_dict()
            assert list(got) == list(full)
            for name, tensor in full.items():
                assert got[name].dtype == tensor.dtype
                assert torch.equal(got[name], tensor), (kind, name, version)
    # Payload bytes (without alignment), by hand: a.weight 5x7, a.bias 5, b.weight 1x5, b.bias 1
    # in fp32 and the int64 buffer of 3 make 208; shard 0 sends rows 0-2 of a, all of b and the
    # buffer (84 + 12 + 20 + 4 + 24), shard 1 rows 3-4 of a (56 + 8).
    payloads = [sum(s.nbytes for s in p.layout.specs) for p in pubs]
    assert payloads == [144, 64] and sum(payloads) == 208
    whole = Layout.of(full_tensors(0)).nbytes
    assert all(t.bytes == p.layout.nbytes < whole for t, p in zip(tickets, pubs, strict=True))
    if kind == "shm":
        assert not any(r.zero_copy for r in rcvs)  # no trainer slot holds a full tensor
    for p in pubs:
        p.close()


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_pieces_in_a_precision_equal_whole_tensors_in_it(kind: str, precision: str) -> None:
    """Casting and per-row quantisation act row by row, so pieces give the same bits."""
    pubs, (pieced,) = build(kind, ["r0"], precision=precision)
    mod = TRANSPORTS[kind]
    one = mod.Publisher(full_tensors(0), ["r0"], timeout_s=20)
    whole = mod.Receiver(Tiny(), [one.address], "r0", precision=precision, timeout_s=20)
    together(one.connect, whole.connect)
    full = full_tensors(3)
    together(lambda: pieced.receive(publish(pubs, 3, full)))
    together(lambda: whole.receive([one.publish(3, full)]))
    got, want = pieced.state.model.state_dict(), whole.state.model.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    x = torch.randn(4, 7, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    with torch.no_grad():
        assert torch.equal(pieced.state.model(x), whole.state.model(x))
    if precision == "int8":
        assert got["a.parametrizations.weight.original"].dtype == torch.int8
    for p in [*pubs, one]:
        p.close()


def layouts_of(*shards: tuple[dict, dict]) -> list[Layout]:
    return [Layout.of(tensors, rows=rows) for tensors, rows in shards]


def test_bad_pieces_name_the_tensor_and_the_rows() -> None:
    full = full_tensors(0)
    weight = full["a.weight"]
    with pytest.raises(ValueError, match=r"'a.weight': rows \[4, 7\) fall outside the 5 rows"):
        Layout.of({"a.weight": weight[:3]}, rows={"a.weight": (4, (5, 7))})
    with pytest.raises(ValueError, match=r"'a.weight' of shape \(3, 7\) cannot be rows of .*6\)"):
        Layout.of({"a.weight": weight[:3]}, rows={"a.weight": (0, (5, 6))})
    with pytest.raises(ValueError, match=r"not among the tensors: \['nope'\]"):
        Layout.of({"a.weight": weight}, rows={"nope": (0, (5, 7))})

    def shards_with(name: str, first: tuple, second: tuple) -> list[Layout]:
        """Both shards as usual, but ``name`` given as (start, stop, full shape) per shard."""
        out = [pieces(full, 0), pieces(full, 1)]
        for (tensors, rows), (start, stop, shape) in zip(out, (first, second), strict=True):
            tensors[name] = torch.zeros(stop - start, *shape[1:])
            rows[name] = (start, shape)
        return layouts_of(*out)

    overlap = shards_with("a.weight", (0, 3, (5, 7)), (2, 5, (5, 7)))
    with pytest.raises(ValueError, match=r"'a.weight': rows \[2, 3\) are in more than one"):
        ReceiverState(Tiny(), overlap)
    gap = shards_with("a.weight", (0, 3, (5, 7)), (4, 5, (5, 7)))
    with pytest.raises(ValueError, match=r"'a.weight': rows \[3, 4\) of its 5 are in no shard"):
        ReceiverState(Tiny(), gap)
    larger = shards_with("a.bias", (0, 3, (6,)), (3, 6, (6,)))
    with pytest.raises(ValueError, match=r"'a.bias': a piece gives its full shape as \(6,\), "):
        ReceiverState(Tiny(), larger)
    tensors, rows = pieces(full, 0)
    tensors["a.weight"], rows = weight, {n: r for n, r in rows.items() if n != "a.weight"}
    twice = layouts_of((tensors, rows), pieces(full, 1))
    with pytest.raises(ValueError, match=r"sent more than once .* \['a.weight'\]"):
        ReceiverState(Tiny(), twice)
    with pytest.raises(ValueError, match="receiver holds pieces as full tensors"):
        layouts_of(pieces(full, 0))[0].astype("bf16")


def test_a_receiver_missing_a_shard_of_a_pieced_model_says_which_rows(tmp_path) -> None:
    tensors, rows = pieces(full_tensors(0), 0)
    pub = TRANSPORTS["disk"].Publisher(tensors, ["r0"], rows=rows, directory=str(tmp_path))
    with pytest.raises(ValueError, match=r"'a.weight': rows \[3, 5\) of its 5 are in no shard"):
        TRANSPORTS["disk"].Receiver(Tiny(), [pub.address], "r0")
    pub.close()


def test_a_version_is_served_only_once_every_shard_of_it_is_in(tmp_path) -> None:
    pubs = []
    for shard in range(WORLD):
        tensors, rows = pieces(full_tensors(0), shard)
        pub = TRANSPORTS["disk"].Publisher(
            tensors, ["r0"], shard=shard, rows=rows, directory=str(tmp_path), durable=False
        )
        pubs.append(pub)
    rcv = TRANSPORTS["disk"].Receiver(Tiny(), [p.address for p in pubs], "r0")
    rcv.receive(publish(pubs, 1, full_tensors(1)))
    tickets = publish(pubs, 2, full_tensors(2))
    broken = dataclasses.replace(tickets[1], payload=str(tmp_path / "gone.safetensors"))
    with pytest.raises(FileNotFoundError):
        rcv.receive([tickets[0], broken])  # shard 0's rows are in the staging slot by now
    assert rcv.version == 1
    got = rcv.state.model.state_dict()
    assert all(torch.equal(got[n], t) for n, t in full_tensors(1).items())
    rcv.receive(tickets)
    got = rcv.state.model.state_dict()
    assert rcv.version == 2 and all(torch.equal(got[n], t) for n, t in full_tensors(2).items())
    for p in pubs:
        p.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank: int, world: int, port: int) -> list[int]:
    """One FSDP2 rank: publish its pieces through shm for two versions; rank 0 also receives
    every rank's pieces and checks them against the full state dict. Returns the versions rank 0
    received and checked (none on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    columns = {"col": distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)])}
    with pytest.raises(ValueError, match=r"'col' is placed \(Shard\(dim=1\),\): pieces need"):
        shard_pieces(columns, include_replicated=True)
    replicated = {"rep": distribute_tensor(torch.ones(2), mesh, [Replicate()])}
    sent, _ = shard_pieces(replicated, include_replicated=rank == 0)
    assert list(sent) == (["rep"] if rank == 0 else [])
    torch.manual_seed(0)
    model = Tiny()
    fully_shard(model, mesh=mesh)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full on rank 0 only
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pub = receiver = None
    checked = []
    try:
        for version in (1, 2):
            model(torch.ones(4, 7)).square().sum().backward()
            optimizer.step()
            model.steps.fill_(version)
            tensors, rows = shard_pieces(model.state_dict(), include_replicated=rank == 0)
            if pub is None:
                pub = TRANSPORTS["shm"].Publisher(tensors, ["r0"], shard=rank, rows=rows)
            ticket = pub.publish(version, tensors)
            share = (pub.address, ticket, {n: t.clone() for n, t in tensors.items()}, rows)
            shares = [None] * WORLD
            dist.all_gather_object(shares, share)
            full = get_model_state_dict(model, options=options)
            if rank == 0:
                if receiver is None:
                    receiver = TRANSPORTS["shm"].Receiver(Tiny(), [s[0] for s in shares], "r0")
                _check_rows(full, shares)
                assert receiver.receive([s[1] for s in shares]).version == version
                got = receiver.state.model.state_dict()
                assert all(torch.equal(got[n], t) for n, t in full.items()), version
                checked.append(version)
            dist.barrier()  # rank 1 keeps its slots until rank 0 has read them
    finally:
        if pub is not None:
            pub.close()
        dist.destroy_process_group()
    return checked


def _check_rows(full: dict[str, torch.Tensor], shares: list) -> None:
    """Every rank sent exactly its torch.chunk rows of each parameter; rank 0 alone the buffer."""
    for rank, (_, _, tensors, rows) in enumerate(shares):
        assert ("steps" in tensors) == (rank == 0)
        for name, tensor in full.items():
            if name == "steps":
                continue
            chunks = tensor.chunk(WORLD)
            want = chunks[rank] if rank < len(chunks) else tensor[:0]
            start = sum(len(c) for c in chunks[:rank])
            assert rows[name] == (min(start, len(tensor)), tuple(tensor.shape)), (rank, name)
            assert torch.equal(tensors[name], want), (rank, name)


def test_fsdp2_ranks_publish_their_own_rows_and_a_receiver_reassembles_them(ray_session) -> None:
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard") or not dist.is_gloo_available():
        pytest.skip("needs FSDP2 (torch.distributed.fsdp.fully_shard) and gloo")
    checked = on_ranks(_fsdp_rank, _free_port(), world=WORLD)  # a hang fails at TIMEOUT_S
    assert checked == [[1, 2], []]  # rank 0 received and checked both versions
