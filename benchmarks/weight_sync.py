"""Weight sync: every transport side by side, against a plain memory copy of the same bytes.

For models of 10M, 100M and 1B parameters (Llama-like tensor shapes), in fp32 and bf16, with 1, 2
and 4 receivers (each a Ray actor, a separate process), every transport publishes a few versions.
Per publish it measures:

- the trainer-side stall: how long ``publish`` held the trainer;
- the time until every receiver serves the new version: from the start of ``publish`` until the
  last receiver's ``receive`` returned (bytes moved, staging slot filled, swap done), as the
  controller sees it, Ray call overhead included;
- the bytes moved, and in the same run a plain ``copy_`` of those bytes in this process: the
  memcpy reference. Effective bandwidth = model bytes / time until served.

The disk baseline runs twice: ``disk`` fsyncs every checkpoint before the trainer carries on (a
checkpoint on disk), ``disk_cache`` does not (the file may live in the page cache only).

``dist`` runs twice too: ``dist`` packs the trainer's tensors into its send buffer on every
publish; ``dist_inplace`` binds them into that buffer once, so a publish copies nothing, and the
trainer must wait for the sends before it writes its tensors again. Its stall is counted as if the
trainer wrote right after publishing (the worst case: in training, the next batch's forward and
backward run meanwhile).

The first publish of each configuration warms up (page faults, connections); the median of the
rest is reported. Configurations that would not fit in memory are skipped and listed as such.
A linear fit of time against bytes per transport (1 receiver) reports the slope and R^2.

    python benchmarks/weight_sync.py                # the full grid (about 15 minutes here)
    python benchmarks/weight_sync.py --sizes 10M --receivers 1 2 --repeats 3   # a quick look

Writes ``benchmarks/results/weight_sync.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_state, machine, relative, save_result  # noqa: E402

from relayrl.weight_sync import TRANSPORTS  # noqa: E402

SIZES = {"10M": (256, 2), "100M": (768, 11), "1B": (2048, 19)}  # hidden size, layers
VOCAB = 16384
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# benchmark name -> (transport, publisher options, trainer tensors bound into the send buffer);
# "disk" fsyncs each checkpoint (durable), "disk_cache" leaves it in the page cache: the fastest
# any file-based sync can be
VARIANTS = {
    "shm": ("shm", {}, False),
    "dist": ("dist", {}, False),
    "dist_inplace": ("dist", {}, True),
    "object_store": ("object_store", {}, False),
    "disk": ("disk", {"durable": True}, False),
    "disk_cache": ("disk", {"durable": False}, False),
}
ORDER = list(VARIANTS)
WORKER_NICENESS = "RAY_worker_niceness"


def shapes(size: str) -> dict[str, tuple[int, ...]]:
    """Llama-like tensor shapes: embeddings, 4 attention and 2 MLP matrices and 2 norms a layer."""
    h, layers = SIZES[size]
    out: dict[str, tuple[int, ...]] = {"embed": (VOCAB, h)}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            out[f"layer{i}_{name}"] = (h, h)
        out[f"layer{i}_up"] = (4 * h, h)
        out[f"layer{i}_down"] = (h, 4 * h)
        out[f"layer{i}_norm1"] = (h,)
        out[f"layer{i}_norm2"] = (h,)
    out["final_norm"] = (h,)
    out["lm_head"] = (VOCAB, h)
    return out


class Flat(torch.nn.Module):
    """A module holding uninitialised parameters of the given shapes (pages untouched)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(
                name, torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            )


def trainer_tensors(size: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The trainer's tensors, each filled with a value of its own (cheap, checkable)."""
    return {
        name: torch.full(shape, float(i % 97) + 0.5, dtype=dtype)
        for i, (name, shape) in enumerate(shapes(size).items())
    }


@ray.remote(num_cpus=0)
class BenchReceiver:
    """One receiver process: a model of the benchmark's shapes behind a transport receiver."""

    def __init__(self, size: str, dtype: str):
        torch.set_num_threads(1)
        self.model = Flat(shapes(size), DTYPES[dtype])
        self.receiver = None

    def open(self, address: dict, name: str, timeout_s: float) -> None:
        self.receiver = TRANSPORTS[address["kind"]].Receiver(
            self.model, [address], name, timeout_s=timeout_s
        )

    def connect(self) -> None:
        self.receiver.connect()

    def receive(self, ticket) -> dict:
        stats = self.receiver.receive([ticket])
        return {"fetch_s": stats.fetch_s, "drain_s": stats.drain_s, "total_s": stats.total_s}

    def fingerprint(self) -> list[float]:
        """First and last element of every tensor, as served."""
        with self.receiver.serving():
            return [float(t.flatten()[j]) for t in self.model.parameters() for j in (0, -1)]


def memcpy_s(nbytes: int, repeats: int) -> float:
    """Median seconds of one plain copy of ``nbytes`` between two warm buffers."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def extra_bytes(transport: str, nbytes: int, receivers: int) -> int:
    """Memory a configuration needs beyond the trainer's tensors (from the transports' design)."""
    receiver_slots = 2 * nbytes * receivers
    return {
        "shm": 2 * nbytes,
        "dist": nbytes + receiver_slots,
        "object_store": 2 * nbytes + receiver_slots,
        "disk": receiver_slots + nbytes * receivers,
    }[VARIANTS[transport][0]] + receivers * (400 << 20)


def run_one(
    transport: str, size: str, dtype: str, receivers: int, repeats: int, timeout_s: float
) -> dict:
    """Publish ``repeats`` versions through ``transport``; timings of each."""
    tensors = trainer_tensors(size, DTYPES[dtype])
    names = [f"r{i}" for i in range(receivers)]
    actors = [BenchReceiver.remote(size, dtype) for _ in names]
    kind, options, in_place = VARIANTS[transport]
    pub = TRANSPORTS[kind].Publisher(tensors, names, timeout_s=timeout_s, **options)
    if in_place:
        pub.bind(tensors)
    try:
        pairs = zip(actors, names, strict=True)
        opened = [a.open.remote(pub.address, n, timeout_s) for a, n in pairs]
        ray.get(opened)
        connecting = [a.connect.remote() for a in actors]
        pub.connect()
        ray.get(connecting)
        publishes = []
        for version in range(1, repeats + 2):
            tensors["final_norm"].fill_(float(version))
            start = time.perf_counter()
            ticket = pub.publish(version, tensors)
            receiving = [a.receive.remote(ticket) for a in actors]
            write_wait = pub.writable() if in_place else 0.0
            stats = ray.get(receiving)
            served = time.perf_counter() - start
            lost = pub.finish()
            publishes.append(
                {
                    "stall_s": ticket.stall_s + write_wait,
                    "served_s": served,
                    "receiver_fetch_s": max(s["fetch_s"] for s in stats),
                    "lost": lost,
                }
            )
        expected = [float(t.flatten()[j]) for t in tensors.values() for j in (0, -1)]
        identical = all(f == expected for f in ray.get([a.fingerprint.remote() for a in actors]))
        return {"bytes": pub.layout.nbytes, "publishes": publishes, "identical": identical}
    finally:
        pub.close()
        for actor in actors:
            ray.kill(actor)
        del tensors, pub, actors  # shm mappings and buffers go with the publisher
        gc.collect()
        settle_memory()


def settle_memory(timeout_s: float = 20.0) -> None:
    """Wait until killed receiver processes have handed their memory back (it is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    last = available_bytes()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = available_bytes()
        if now - last < 64 << 20:
            return
        last = now


def summarize(one: dict, memcpy: float) -> dict:
    """Medians over the publishes after the first, and bandwidths against memcpy."""
    rest = one["publishes"][1:] or one["publishes"]
    stall = statistics.median(p["stall_s"] for p in rest)
    served = statistics.median(p["served_s"] for p in rest)
    return {
        "bytes": one["bytes"],
        "identical": one["identical"],
        "stall_s": stall,
        "served_s": served,
        "effective_gbps": one["bytes"] / served / 1e9,
        "memcpy_s": memcpy,
        "memcpy_gbps": one["bytes"] / memcpy / 1e9,
        "fraction_of_memcpy": memcpy / served,
        "warmup_served_s": one["publishes"][0]["served_s"],
        "lost": one["publishes"][-1]["lost"],
    }


def fit(rows: list[dict]) -> dict:
    """Least-squares time = a + bytes / bandwidth, with R^2."""
    x = np.array([r["bytes"] for r in rows], dtype=float)
    y = np.array([r["served_s"] for r in rows], dtype=float)
    if len(rows) < 2:
        return {}
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    r2 = 1 - float((residual**2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30))
    return {"intercept_s": float(intercept), "gbps": float(1 / slope / 1e9), "r2": r2}


def main(argv: list[str] | None = None) -> int:
    """Run the grid and write the result files."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    rows, skipped = [], []
    started = time.time()
    for size in args.sizes:
        for dtype in args.dtypes:
            # A fresh Ray instance per size and dtype: the object store keeps the pages of freed
            # objects resident, which would leave too little memory for the 1B configurations.
            start_ray(args.object_store_gb)
            nbytes = sum(int(np.prod(s)) * DTYPES[dtype].itemsize for s in shapes(size).values())
            memcpy = memcpy_s(nbytes, args.repeats)
            for receivers in args.receivers:
                for transport in args.transports:
                    need = nbytes + extra_bytes(transport, nbytes, receivers)
                    config = {"transport": transport, "size": size, "dtype": dtype}
                    config["receivers"] = receivers
                    available = available_bytes()
                    if need > args.memory_fraction * available:
                        reason = f"needs ~{need / 2**30:.1f} GiB of {available / 2**30:.1f}"
                        skipped.append(config | {"reason": reason})
                        print(f"skip {config}: {reason}", file=sys.stderr)
                        continue
                    one = run_one(transport, size, dtype, receivers, args.repeats, args.timeout_s)
                    row = config | summarize(one, memcpy)
                    rows.append(row)
                    print(
                        f"{transport:12s} {size:4s} {dtype} x{receivers}: stall "
                        f"{row['stall_s'] * 1e3:8.1f} ms, served {row['served_s'] * 1e3:8.1f} ms, "
                        f"{row['effective_gbps']:5.2f} GB/s = {row['fraction_of_memcpy']:.0%} of "
                        f"memcpy, identical={row['identical']}",
                        file=sys.stderr,
                    )
            ray.shutdown()
    fits = {
        f"{t}/{d}": fit(
            [r for r in rows if r["transport"] == t and r["dtype"] == d and r["receivers"] == 1]
        )
        for t in args.transports
        for d in args.dtypes
    }
    result = {
        "benchmark": "weight_sync",
        "command": shlex.join(["python", *(relative(a) for a in sys.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git_state(),
        "wall_clock_s": time.time() - started,
        "repeats": args.repeats,
        "ray_worker_niceness": int(os.environ[WORKER_NICENESS]),
        "rows": rows,
        "skipped": skipped,
        "fits": fits,
        "ratios": ratios(rows),
    }
    save_result(args.out, "weight_sync", result, plot, table(result))
    return 0


def start_ray(object_store_gb: int) -> None:
    """An embedded two-CPU Ray instance on loopback whose workers run at normal priority.

    Ray starts its workers at nice 15. The receivers are workers while the trainer side is this
    process (nice 0), so on two cores a transport whose two ends run at once (dist) would starve
    its receivers; in a run every executor is a worker and they share one priority.
    """
    os.environ[WORKER_NICENESS] = "0"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=object_store_gb << 30,
        configure_logging=False,
    )


def ratios(rows: list[dict]) -> dict:
    """The issue's comparisons: disk / shm and disk / dist at 1B, 4-receiver / 1-receiver stall."""

    def find(transport: str, size: str, dtype: str, receivers: int) -> dict | None:
        for r in rows:
            if (r["transport"], r["size"], r["dtype"], r["receivers"]) == (
                transport,
                size,
                dtype,
                receivers,
            ):
                return r
        return None

    out: dict = {}
    for dtype in DTYPES:
        for slow in ("disk", "disk_cache"):
            base = find(slow, "1B", dtype, 1)
            for fast in ("shm", "dist", "dist_inplace"):
                row = find(fast, "1B", dtype, 1)
                if base and row:
                    out[f"{slow}_over_{fast}_1B_{dtype}"] = base["served_s"] / row["served_s"]
        for transport in ("shm", "dist", "dist_inplace"):
            for size in SIZES:
                one, four = find(transport, size, dtype, 1), find(transport, size, dtype, 4)
                if one and four:
                    out[f"stall_4_over_1_{transport}_{size}_{dtype}"] = (
                        four["stall_s"] / one["stall_s"]
                    )
    return out


def table(result: dict) -> str:
    """The Markdown table for docs/benchmarks.md."""
    lines = [
        "| transport | size | dtype | receivers | MB | stall ms | served ms | GB/s | of memcpy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['transport']} | {r['size']} | {r['dtype']} | {r['receivers']} | "
            f"{r['bytes'] / 1e6:.0f} | {r['stall_s'] * 1e3:.1f} | {r['served_s'] * 1e3:.1f} | "
            f"{r['effective_gbps']:.2f} | {r['fraction_of_memcpy']:.0%} |"
        )
    lines.append("")
    for key, value in result["fits"].items():
        if value:
            lines.append(
                f"- fit {key}: {value['gbps']:.2f} GB/s slope, "
                f"{value['intercept_s'] * 1e3:.1f} ms intercept, R^2 {value['r2']:.4f}"
            )
    for key, value in result["ratios"].items():
        lines.append(f"- {key}: {value:.2f}")
    for s in result["skipped"]:
        lines.append(f"- skipped {s}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Time until served against bytes (1 receiver), and stall against receivers (100M)."""
    rows = result["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for transport in ORDER:
        for dtype, marker in (("fp32", "o"), ("bf16", "s")):
            pts = sorted(
                (r["bytes"], r["served_s"])
                for r in rows
                if r["transport"] == transport and r["dtype"] == dtype and r["receivers"] == 1
            )
            if pts:
                x, y = zip(*pts, strict=True)
                left.loglog(x, y, marker=marker, label=f"{transport} {dtype}")
    memcpy = sorted({(r["bytes"], r["memcpy_s"]) for r in rows})
    if memcpy:
        x, y = zip(*memcpy, strict=True)
        left.loglog(x, y, "k--", label="memcpy")
    left.set_xlabel("model bytes")
    left.set_ylabel("seconds until the receiver serves it")
    left.set_title("1 receiver")
    left.legend(fontsize=7)
    for transport in ORDER:
        pts = sorted(
            (r["receivers"], r["stall_s"] * 1e3)
            for r in rows
            if r["transport"] == transport and r["size"] == "100M" and r["dtype"] == "fp32"
        )
        if pts:
            x, y = zip(*pts, strict=True)
            right.plot(x, y, marker="o", label=transport)
    right.set_xlabel("receivers")
    right.set_ylabel("trainer stall per publish (ms)")
    right.set_title("100M parameters, fp32")
    right.set_yscale("log")
    right.legend(fontsize=7)
    fig.suptitle(f"weight sync — {result['machine']['platform']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--receivers", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--transports", nargs="+", default=ORDER, choices=ORDER)
    parser.add_argument("--repeats", type=int, default=3, help="timed publishes after a warm-up")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--object-store-gb", type=int, default=10)
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.85,
        help="skip a configuration needing more than this fraction of available memory",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


if __name__ == "__main__":
    raise SystemExit(main())
