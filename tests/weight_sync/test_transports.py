"""Every transport delivers bit-identical tensors and the right version, in the receiver's
precision; swaps are atomic under concurrent forward passes."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from relayrl.weight_sync import TRANSPORTS, ReceiverLost
from relayrl.weight_sync.base import Ticket, TrainerSide
from relayrl.weight_sync.buckets import Layout


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Linear layers plus a non-parameter buffer, so both kinds of tensor are exercised."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    return model.to(dtype)


def trainer_tensors(version: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Distinct values per version; ints too, so casting must leave them alone."""
    g = torch.Generator().manual_seed(version)
    out = {
        name: torch.randn(t.shape, generator=g, dtype=torch.float32).to(dtype)
        for name, t in make_model().state_dict().items()
        if t.is_floating_point()
    }
    out["steps"] = torch.full((3,), version, dtype=torch.int64)
    return {name: out[name] for name in make_model().state_dict()}


def connect(pub, rcvs) -> None:
    """Publisher and receivers rendezvous concurrently, as they do across processes."""
    threads = [threading.Thread(target=r.connect) for r in rcvs]
    for t in threads:
        t.start()
    pub.connect()
    for t in threads:
        t.join(timeout=30)


def receive_all(rcvs, ticket) -> list:
    """Receive on every receiver at once (dist sends need the receivers to be listening)."""
    results = [None] * len(rcvs)

    def run(i):
        results[i] = rcvs[i].receive([ticket])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rcvs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


@pytest.fixture(params=sorted(TRANSPORTS))
def kind(request, ray_session) -> str:
    return request.param


def build(kind: str, names: list[str], precision: str | None = None, timeout_s: float = 20.0):
    mod = TRANSPORTS[kind]
    pub = mod.Publisher(trainer_tensors(0), names, timeout_s=timeout_s, bucket_bytes=1024)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rcvs = [
        mod.Receiver(make_model(dtype), [pub.address], n, precision=precision, timeout_s=timeout_s)
        for n in names
    ]
    connect(pub, rcvs)
    return pub, rcvs


def test_layout_packs_buckets_of_whole_tensors() -> None:
    layout = Layout.of(trainer_tensors(0), bucket_bytes=1024)
    assert layout.nbytes % 64 == 0 and len(layout.buckets) > 1
    assert layout.buckets[0][0] == 0 and layout.buckets[-1][1] == layout.nbytes
    starts = {s.offset for s in layout.specs}
    assert all(begin in starts for begin, _ in layout.buckets)
    buffer = layout.allocate()
    tensors = trainer_tensors(3)
    for name, view in layout.views(buffer).items():
        view.copy_(tensors[name])
    assert all(torch.equal(layout.views(buffer)[n], tensors[n]) for n in tensors)


def test_every_transport_delivers_bit_identical_tensors_and_versions(kind: str) -> None:
    pub, rcvs = build(kind, ["r0", "r1"])
    for version in (1, 2, 3):
        tensors = trainer_tensors(version)
        ticket = pub.publish(version, tensors)
        assert ticket.version == version and ticket.bytes == pub.layout.nbytes
        stats = receive_all(rcvs, ticket)
        assert pub.finish() == {}
        for rcv, stat in zip(rcvs, stats, strict=True):
            assert stat.version == version and rcv.version == version
            got = rcv.state.model.state_dict()
            for name, tensor in tensors.items():
                assert got[name].dtype == tensor.dtype
                assert torch.equal(got[name], tensor), (kind, name, version)
    pub.close()


def test_receiver_casts_to_its_own_precision(kind: str) -> None:
    pub, (rcv,) = build(kind, ["r0"], precision="bf16")
    tensors = trainer_tensors(5)
    rcv.receive([pub.publish(5, tensors)])
    pub.finish()
    got = rcv.state.model.state_dict()
    for name, tensor in tensors.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected)
    x = torch.randn(4, 7, dtype=torch.bfloat16)
    assert rcv.state.model(x).dtype == torch.bfloat16
    pub.close()


@pytest.mark.parametrize("precision, tolerance", [("int8", 0.02), ("fp8", 0.08)])
def test_receiver_holds_a_weight_only_quantised_copy(kind: str, precision, tolerance) -> None:
    """2-D weights stored quantised with row scales, dequantised on access; outputs stay close."""
    pub, (rcv,) = build(kind, ["r0"], precision=precision)
    tensors = trainer_tensors(6)
    rcv.receive([pub.publish(6, tensors)])
    pub.finish()
    model = rcv.state.model
    stored = model[0].parametrizations.weight.original
    assert stored.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[precision]
    for name, layer in (("0", model[0]), ("2", model[2])):
        exact = tensors[f"{name}.weight"]
        step = exact.abs().amax(dim=1, keepdim=True) / (127 if precision == "int8" else 448)
        error = (layer.weight - exact).abs()
        assert float((error / exact.abs().amax(dim=1, keepdim=True)).max()) < tolerance
        if precision == "int8":
            assert bool((error <= step / 2 + 1e-6).all())  # rounding to the nearest level
        assert torch.equal(layer.bias, tensors[f"{name}.bias"])  # 1-D tensors stay exact
    assert torch.equal(model.steps, tensors["steps"])
    reference = make_model()
    reference.load_state_dict(tensors)
    x = torch.randn(16, 7)
    with torch.no_grad():
        got, want = model(x), reference(x)
    assert float((got - want).norm() / want.norm()) < tolerance
    wire = {s.name: s.nbytes for s in pub.layout.specs}
    held = {s.name: s.nbytes for s in rcv.state.layouts[0].specs}
    assert held["0.weight"] * 4 == wire["0.weight"] and held["0.bias"] == wire["0.bias"]
    pub.close()


def test_shm_receiver_is_zero_copy_only_when_precision_matches(ray_session) -> None:
    pub, (same,) = build("shm", ["r0"])
    assert same.zero_copy
    ticket = pub.publish(1, trainer_tensors(1))
    same.receive([ticket])
    weight = same.state.model[0].weight
    assert weight.untyped_storage().data_ptr() == same.maps[0][ticket.payload[0]].data_ptr()
    pub.close()
    pub, (cast,) = build("shm", ["r0"], precision="bf16")
    assert not cast.zero_copy
    pub.close()


def test_sharded_trainer_sends_each_shard_straight_to_receivers(kind: str) -> None:
    """Two trainer shards, each with half the tensors and its own publisher; no gather."""
    mod = TRANSPORTS[kind]
    full = trainer_tensors(0)
    names = list(full)
    halves = [{n: full[n] for n in names[::2]}, {n: full[n] for n in names[1::2]}]
    pubs = [mod.Publisher(h, ["r0"], shard=i, timeout_s=20) for i, h in enumerate(halves)]
    rcv = mod.Receiver(make_model(), [p.address for p in pubs], "r0", timeout_s=20)
    threads = [threading.Thread(target=p.connect) for p in pubs]
    for t in threads:
        t.start()
    rcv.connect()
    for t in threads:
        t.join(timeout=30)
    new = trainer_tensors(4)
    tickets = [p.publish(4, {n: new[n] for n in h}) for p, h in zip(pubs, halves, strict=True)]
    assert rcv.receive(tickets).version == 4
    got = rcv.state.model.state_dict()
    assert all(torch.equal(got[n], new[n]) for n in names)
    # Checked before anything is read: no publish behind the odd ticket, so no send of a
    # transport that waits for its reader is left to time out at close.
    with pytest.raises(ValueError, match="share a version"):
        rcv.receive([tickets[0], dataclasses.replace(tickets[1], version=5)])
    for p in pubs:
        p.close()


def test_forward_passes_never_see_two_versions(kind: str) -> None:
    """Readers check that every parameter holds the same version number during a forward; a
    swap that rebinds tensors one by one, or a trainer overwriting a slot in use, is caught."""
    names = ["r0"]
    mod = TRANSPORTS[kind]
    model = make_model()
    pub = mod.Publisher(const_tensors(0), names, timeout_s=20)
    rcv = mod.Receiver(model, [pub.address], "r0", timeout_s=20)
    connect(pub, [rcv])
    stop = threading.Event()
    torn, seen = [], set()

    def reader() -> None:
        while not stop.is_set():
            with rcv.serving() as version:
                values = {
                    float(t.detach().flatten()[i]) for t in model.parameters() for i in (0, -1)
                }
                if version >= 0 and values != {float(version)}:
                    torn.append((version, values))
                seen.add(version)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers:
        t.start()
    for version in range(1, 25):
        ticket = pub.publish(version, const_tensors(version))
        receive_all([rcv], ticket)
        pub.finish()
    stop.set()
    for t in readers:
        t.join(timeout=10)
    pub.close()
    assert not torn, torn[:3]
    assert len(seen) > 3


def const_tensors(version: int) -> dict[str, torch.Tensor]:
    """Every floating tensor filled with the version number."""
    return {
        n: torch.full_like(t, float(version)) if t.is_floating_point() else t
        for n, t in make_model().state_dict().items()
    }


def test_shm_publisher_waits_for_the_slot_then_names_a_receiver_that_never_releases_it(
    ray_session,
) -> None:
    pub, (fast, slow) = build("shm", ["fast", "slow"], timeout_s=0.5)
    t1 = pub.publish(1, trainer_tensors(1))
    fast.receive([t1])
    slow.receive([t1])
    t2 = pub.publish(2, trainer_tensors(2))
    fast.receive([t2])  # slow stays on version 1, in the slot version 3 needs
    with pytest.warns(UserWarning, match="slow"):
        t3 = pub.publish(3, trainer_tensors(3))
    assert set(pub.finish()) == {"slow"} and "publish #0" in pub.lost["slow"]
    assert t3.stall_s >= 0.5
    fast.receive([t3])
    assert fast.version == 3
    with pytest.raises(ReceiverLost, match="slow"):
        slow.receive([t3])
    pub.close()


def test_only_the_pull_transports_let_a_receiver_skip_versions() -> None:
    pulls = {kind for kind, mod in TRANSPORTS.items() if mod.Receiver.skips_versions}
    assert pulls == {"object_store", "disk"}


@pytest.mark.parametrize("kind", ["object_store", "disk"])
def test_a_pull_receiver_takes_the_newest_of_several_publishes(ray_session, kind: str) -> None:
    pub, (skipper, follower) = build(kind, ["skipper", "follower"])
    tickets = [pub.publish(version, trainer_tensors(version)) for version in (1, 2, 3)]
    follower.receive([tickets[1]])  # disk keeps the newest two files only
    follower.receive([tickets[2]])
    skipper.receive([tickets[2]])
    assert pub.finish() == {}
    for rcv in (skipper, follower):
        got = rcv.state.model.state_dict()
        assert rcv.version == 3
        assert all(torch.equal(got[name], t) for name, t in trainer_tensors(3).items())
    pub.close()


def test_shm_tells_apart_two_publishes_of_one_version(ray_session) -> None:
    """A warm start publishes version 0 repeatedly; slots are tracked by publish, not version."""
    pub, (rcv,) = build("shm", ["r0"], timeout_s=0.5)
    for _ in range(4):
        rcv.receive([pub.publish(0, trainer_tensors(0))])
    assert pub.finish() == {} and rcv.version == 0
    pub.close()


def test_shm_rejects_a_stale_ticket(ray_session) -> None:
    pub, (rcv,) = build("shm", ["r0"])
    t1 = pub.publish(1, trainer_tensors(1))
    rcv.receive([t1])
    rcv.receive([pub.publish(2, trainer_tensors(2))])
    pub.publish(3, trainer_tensors(3))  # overwrites version 1's slot
    with pytest.raises(RuntimeError, match="stale"):
        rcv.receive([t1])
    pub.close()


def test_dist_names_a_receiver_that_never_receives_within_the_timeout() -> None:
    pub, (ok, hung) = build("dist", ["ok", "hung"], timeout_s=2.0)
    ticket = pub.publish(1, trainer_tensors(1))
    ok.receive([ticket])  # "hung" never calls receive
    with pytest.warns(UserWarning, match="hung"):
        lost = pub.finish()
    assert set(lost) == {"hung"}
    ticket = pub.publish(2, trainer_tensors(2))  # carries on with the receiver that remains
    assert ok.receive([ticket]).version == 2 and pub.finish() == lost
    pub.close()


@pytest.mark.parametrize("streams", [1, 3])
def test_dist_spreads_buckets_over_parallel_pairs(streams: int) -> None:
    mod = TRANSPORTS["dist"]
    pub = mod.Publisher(trainer_tensors(0), ["r0"], bucket_bytes=256, streams=streams)
    assert len(pub.layout.buckets) > streams  # every pair carries some buckets
    rcv = mod.Receiver(make_model(), [pub.address], "r0")
    connect(pub, [rcv])
    assert len(pub.groups["r0"]) == len(rcv.groups[0]) == streams
    for version in (1, 2):
        tensors = trainer_tensors(version)
        stat = receive_all([rcv], pub.publish(version, tensors))[0]
        assert stat.version == version and pub.finish() == {}
        got = rcv.state.model.state_dict()
        assert all(torch.equal(got[name], tensor) for name, tensor in tensors.items())
    pub.close()
    # A payload smaller than one bucket is cut so that each pair carries a share.
    small = mod.Publisher(trainer_tensors(0), ["r0"], bucket_bytes=1 << 20, streams=2)
    assert len(small.layout.buckets) >= 2
    small.close()
    with pytest.raises(ValueError, match="streams must be a positive int"):
        mod.Publisher(trainer_tensors(0), ["r0"], streams=0)


class CountCopies(TorchDispatchMode):
    """Counts the tensor copies run in this thread while active."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


def test_dist_bound_tensors_are_sent_from_the_trainers_own_memory() -> None:
    mod = TRANSPORTS["dist"]
    model = make_model()
    pub = mod.Publisher(model.state_dict(), ["r0"], bucket_bytes=256, streams=2)
    assert pub.writable() == 0.0  # nothing bound: the trainer may always write
    live = dict(model.named_parameters()) | dict(model.named_buffers())
    pub.bind(live)
    for name, tensor in model.state_dict().items():
        assert tensor.data_ptr() == pub.views[name].data_ptr(), name
    assert all(p.requires_grad for p in model.parameters())
    rcv = mod.Receiver(make_model(), [pub.address], "r0")
    connect(pub, [rcv])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for version in (1, 2):
        model.zero_grad()
        model(torch.ones(4, 7)).square().sum().backward()
        pub.writable()
        optimizer.step()  # writes straight into the send buffer
        model.steps.fill_(version)
        with CountCopies() as counted:
            ticket = pub.publish(version, model.state_dict())
        assert counted.copies == 0, "a bound publish copies nothing"
        stat = receive_all([rcv], ticket)[0]
        pub.writable()
        assert pub._pending == [] and pub._issuing is None  # writable waited for the sends
        got, sent = rcv.state.model.state_dict(), model.state_dict()
        assert stat.version == version and rcv.version == version
        assert all(torch.equal(got[name], tensor) for name, tensor in sent.items())
    with CountCopies() as counted:  # an unbound tensor of the right name is copied in
        pub.publish(3, trainer_tensors(3))
    assert counted.copies == len(trainer_tensors(3))
    receive_all([rcv], Ticket("dist", 0, 3))
    assert torch.equal(rcv.state.model.state_dict()["steps"], torch.full((3,), 3))
    with pytest.raises(ValueError, match=r"not in the layout: \['extra'\]"):
        pub.bind({"extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="tensor '0.weight' is torch.float64"):
        pub.bind({"0.weight": torch.zeros(33, 7, dtype=torch.float64)})
    pub.close()


def test_trainer_side_binds_in_place_only_for_dist(ray_session) -> None:
    side = TrainerSide(timeout_s=5.0, bucket_bytes=1 << 20, streams=1, in_place=True)
    with pytest.raises(ValueError, match="sync.in_place=true needs the dist transport, got 'shm'"):
        side.open(TRANSPORTS["shm"], make_model(), ["r0"], "127.0.0.1")
    model = make_model()
    side.open(TRANSPORTS["dist"], model, ["r0"], "127.0.0.1")
    assert side.publisher.bound
    assert model[0].weight.data_ptr() == side.publisher.views["0.weight"].data_ptr()
    side.publisher.close()


def test_bad_input_names_the_problem(ray_session) -> None:
    pub = TRANSPORTS["shm"].Publisher(trainer_tensors(0), ["r0"])
    wrong = dict(trainer_tensors(1))
    wrong.pop("steps")
    with pytest.raises(ValueError, match="missing \\['steps'\\]"):
        pub.publish(1, wrong)
    with pytest.raises(ValueError, match="precision='int4'"):
        TRANSPORTS["shm"].Receiver(make_model(), [pub.address], "r0", precision="int4")
    with pytest.raises(ValueError, match="not among"):
        TRANSPORTS["shm"].Receiver(make_model(), [pub.address], "nobody")
    small = torch.nn.Linear(7, 5)
    with pytest.raises(ValueError, match="do not match the receiver's model"):
        TRANSPORTS["shm"].Receiver(small, [pub.address], "r0")
    with pytest.raises(ValueError, match="'shm' publisher given to a 'disk' receiver"):
        TRANSPORTS["disk"].Receiver(make_model(), [pub.address], "r0")
    pub.close()


def test_disk_without_fsync_delivers_the_same_and_keeps_two_files(tmp_path) -> None:
    mod = TRANSPORTS["disk"]
    pub = mod.Publisher(trainer_tensors(0), ["r0"], directory=str(tmp_path), durable=False)
    rcv = mod.Receiver(make_model(), [pub.address], "r0")
    for version in (1, 2, 3):
        rcv.receive([pub.publish(version, trainer_tensors(version))])
    got = rcv.state.model.state_dict()
    assert all(torch.equal(got[n], t) for n, t in trainer_tensors(3).items())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "shard0-v2.safetensors",
        "shard0-v3.safetensors",
    ]
    pub.close()
