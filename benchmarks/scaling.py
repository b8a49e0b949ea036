"""Scaling of the async LLM loop: throughput against generator replicas and trainer ranks, with
simulated compute, on the real controller.

Two cores cannot show compute scaling, so compute is replaced by a cost model and everything
else is real: ``controller.run_async`` (its rollout and scoring loops, bounded channels and
staleness gate), Ray actors placed through ``launch.Placement``, ``launch.connect_weight_sync``
and its ``WeightSync``: after every train step every trainer rank ``publish``es through a real
``relayrl.weight_sync`` publisher, and generator replicas take all ranks' tickets in
``update_weights`` through a real receiver, into a tiny two-layer model (33 KB; the only torch
model in any actor): with shm every replica takes every version, with object_store or disk
(receivers may skip versions) a replica takes only the newest, just before its next
``generate``. The cost model:

- generator replica (``SimGenerator``): ``generate`` sleeps ``T`` per token, tokens =
  ``prompts_per_step * group_size * max_new_tokens``, and returns a small ``RolloutBatch`` of that
  shape whose token versions are the replica's current policy version, so lags are real. Like the
  real generator it is a one-call-at-a-time actor: it takes new weights between ``generate``
  calls.
- trainer rank (``SimTrainer``): ``train_step`` sleeps ``S / ranks``, drops groups older than
  ``max_staleness`` and keeps its share of the books as the real trainer does, bumps the version
  and returns a real ``StepResult``. Ranks are separate actors that all get the same batch
  reference; they form no process group. Each publishes its rows of every tensor (the layout
  FSDP2's ``Shard(0)`` gives), so receivers reassemble the model from ``ranks`` shards as they do
  from a real group.
- rewarder replica (``StubRewarder``): a stub, not the real ``Rewarder`` (which runs the
  scorer on each completion): it concatenates the batches, sets reward = finished and returns at
  once.

Every placement runs the loop once per transport in ``--transports`` (object_store, then shm:
what ``sync.transport=auto`` picks on one host), on the same actors, with weight sync rewired in
between; only their publish and receive paths differ. Per run it measures, after a warm-up of
one wave (a batch from every replica; or what twice the wave's ideal time gave, if slower):

- throughput: samples trained per second from the warm-up's last step to the last step, against
  the ideal ``min(M * gen_rate, train_rate)``, ``gen_rate = samples / (T * tokens)``,
  ``train_rate = samples / (S / ranks)`` (samples = prompts * group size per batch). A run is cut
  after ``--deadline-factor`` times its ideal duration (plus 5 s) and measured up to its last step;
- controller CPU per step: ``time.process_time()`` of this (driver) process over the same steps,
  divided by them. It includes the threads of Ray's core worker in the driver; the main thread's
  part (``time.thread_time()``: the asyncio loop that runs the controller) is reported beside
  it, and so is the driver's CPU while idle (Ray's own threads), measured just before the run;
- where the time went: trainer and generator busy fractions, publish stall, receive time, lags
  and stale drops, cores used by each role's processes (from /proc) and by the rest of the
  machine, and each actor process's memory (RSS, and PSS, which splits shared pages).

The replica sweep (trainer ranks 1) makes generation the bottleneck (``S`` small), the ranks
sweep makes training the bottleneck (two fast generators, ``S`` large). In ``run_async`` one gate
admits at most ``max_staleness + 1`` batches at once, so ``max_staleness`` defaults to the number
of replicas (a batch from each in flight; lags then reach about M); one extra point runs 8
replicas at the config default ``max_staleness=2`` to show the gate's cap.

One embedded Ray (``launch.start_ray``, 2 CPUs) serves every configuration; each configuration's
actors are killed and its placement group removed (``launch.stop``) before the next. Starting
the actors (each imports torch for its receiver, ~2 CPU-seconds) takes most of the wall-clock
time: the defaults ran in 10 minutes here, and in 18 while other jobs shared the two cores.

Run from the repository root::

    python benchmarks/scaling.py                                 # the default grids, ~10 min
    python benchmarks/scaling.py --replicas 1 8 --ranks 1 2     # a quick look
    python benchmarks/scaling.py --transports shm --token-ms 15.6   # 4 s batches, shm only

It writes ``benchmarks/results/scaling.json`` and ``.png`` (with the command line, machine and
commit) and prints a Markdown table for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from statistics import mean
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import ray
import torch
from common import git_state, machine, relative, save_result

from relayrl import parallel
from relayrl.checkpoint import Checkpointer
from relayrl.config import Config, load_config
from relayrl.controller import run_async
from relayrl.executors.trainer_core import PolicyCore
from relayrl.launch import WeightSync, connect_weight_sync, publish_weights, start_ray
from relayrl.observability.metrics import MetricsLog, RunTally
from relayrl.observability.tracing import Span, Tracer, busy_seconds
from relayrl.recovery import Recovery
from relayrl.roles import Group, Placed, Role
from relayrl.types import RolloutBatch, RolloutMeta, StepResult
from relayrl.weight_sync import TRANSPORTS, Ticket, chunk_rows
from relayrl.weight_sync.base import TrainerSide
from relayrl.workloads import LLMWorkload

matplotlib.use("Agg")  # benchmark machines have no display

REPO = Path(__file__).resolve().parents[1]
NAME = "scaling"
WIDTH = 64  # the tiny synced model: two WIDTH x WIDTH linear layers (33 KB), rows divide by 8
PROMPT_LEN = 4  # prompt tokens of every simulated sample
IDLE_S = 0.5  # the driver's idle CPU is measured over this long before each run


def tiny_model() -> torch.nn.Module:
    """The model every trainer rank publishes and every generator replica receives."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))


def sim_batch(samples: int, group_size: int, new_tokens: int, version: int) -> RolloutBatch:
    """A ``RolloutBatch`` of ``samples`` finished completions of ``new_tokens`` tokens each, all
    sampled at ``version``."""
    width = PROMPT_LEN + new_tokens
    versions = np.full((samples, width), -1, dtype=np.int64)
    versions[:, PROMPT_LEN:] = version
    return RolloutBatch(
        tokens=np.ones((samples, width), dtype=np.int64),
        prompt_len=np.full(samples, PROMPT_LEN, dtype=np.int64),
        completion_len=np.full(samples, new_tokens, dtype=np.int64),
        logprobs=np.zeros((samples, width), dtype=np.float32),
        versions=versions,
        finished=np.ones(samples, dtype=bool),
        group_size=group_size,
        answers=["0"] * samples,
    )


class RowShardedSide(TrainerSide):
    """The real trainer side of weight sync, but a rank of ``world > 1`` publishes its rows of
    every plain tensor as if FSDP2 had sharded it ``Shard(0)`` (``shard_pieces`` needs DTensors,
    and these ranks form no process group)."""

    def _share(
        self, state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, tuple[int, ...]]] | None]:
        if self.world == 1:
            return state, None
        tensors, rows = {}, {}
        for name, tensor in state.items():
            start, end = chunk_rows(tensor.shape[0], self.world, self.rank)
            tensors[name] = tensor[start:end]
            rows[name] = (start, tuple(tensor.shape))
        return tensors, rows


class SimTrainer(PolicyCore):
    """A trainer rank whose step costs ``step_s / world`` seconds of sleep; weight sync, version,
    counters and tracing are the real ``PolicyCore``'s, over a tiny model."""

    def __init__(self, cfg: Config, rank: int, world: int, step_s: float):
        torch.set_num_threads(1)
        super().__init__(cfg, tiny_model(), rank=rank, world=world)
        self.step_s = step_s
        self.max_staleness = cfg.max_staleness
        self.sync = RowShardedSide(
            timeout_s=cfg.sync.timeout_s,
            bucket_bytes=cfg.sync.bucket_mb << 20,
            streams=cfg.sync.streams,
            in_place=False,
            rank=rank,
            world=world,
        )

    def train_step(self, batch: RolloutBatch) -> StepResult:
        """Sleep this rank's share of the step; drop stale groups and keep this rank's books as
        ``executors.trainer.Trainer`` does; bump the version."""
        with self.tracer.span("train_step", self.version):
            start = time.perf_counter()
            time.sleep(self.step_s / self.world)
            lag = self.version - batch.min_version
            group_lag = lag.reshape(-1, batch.group_size).max(axis=1)
            keep = np.repeat(group_lag <= self.max_staleness, batch.group_size)
            own = parallel.share(len(group_lag), self.rank, self.world)
            books = np.zeros(len(batch), dtype=bool)
            books[own.start * batch.group_size : own.stop * batch.group_size] = True
            trained, dropped = int((books & keep).sum()), int((books & ~keep).sum())
            self.trained += trained
            self.dropped_stale += dropped
            stepped = bool(keep.any())
            self.version += int(stepped)
            return StepResult(
                stepped=stepped,
                version=self.version,
                received=int(books.sum()),
                trained=trained,
                dropped_stale=dropped,
                lags=np.bincount(lag[books & keep], minlength=self.max_staleness + 1).tolist(),
                train_s=time.perf_counter() - start,
            )


class SimGenerator:
    """A generator replica whose ``generate`` costs ``token_s`` seconds of sleep per token."""

    name = "generator"

    def __init__(self, shape: dict[str, int], token_s: float, timeout_s: float):
        torch.set_num_threads(1)
        self.samples = shape["prompts_per_step"] * shape["group_size"]
        self.group_size = shape["group_size"]
        self.new_tokens = shape["max_new_tokens"]
        self.token_s = token_s
        self.timeout_s = timeout_s
        self.model = tiny_model().eval()
        self.receiver: Any = None
        self.version = 0
        self.tokens_generated = 0
        self.receive_s: list[float] = []
        self.tracer = Tracer(self.name)

    def generate(self) -> tuple[RolloutMeta, RolloutBatch]:
        """One batch of ``prompts_per_step`` groups, ``max_new_tokens`` tokens per sample."""
        with self.tracer.span("generate", self.version):
            start = time.perf_counter()
            tokens = self.samples * self.new_tokens
            time.sleep(self.token_s * tokens)
            self.tokens_generated += tokens
            batch = sim_batch(self.samples, self.group_size, self.new_tokens, self.version)
            meta = RolloutMeta(
                samples=self.samples,
                tokens=tokens,
                version=self.version,
                resumed=0,
                pending=0,
                busy_s=time.perf_counter() - start,
            )
            return meta, batch

    def evaluate(self, split: str = "heldout") -> RolloutBatch:
        """One group at the current version, at no cost (``LLMWorkload.evaluate`` scores it)."""
        return sim_batch(self.group_size, self.group_size, self.new_tokens, self.version)

    def open_sync(self, addresses: list[dict], name: str = "generator") -> None:
        """Attach a real receiver for the tiny model to every trainer rank's publisher."""
        self.receiver = TRANSPORTS[addresses[0]["kind"]].Receiver(
            self.model, addresses, name, timeout_s=self.timeout_s
        )

    def connect_sync(self) -> None:
        """Rendezvous with the publishers."""
        self.receiver.connect()

    def update_weights(self, *tickets: Ticket) -> int:
        """Swap in the version the tickets (one per trainer rank) carry."""
        with self.tracer.span("update_weights", tickets[0].version):
            stats = self.receiver.receive(tickets)
            self.version = stats.version
        self.receive_s.append(stats.total_s)
        return self.version

    def sync_stats(self) -> dict:
        """Receiver-side seconds of every receive, in order."""
        return {"receive_s": list(self.receive_s)}

    def stats(self) -> dict[str, float]:
        """Counters, named as the real generator names them."""
        return {"version": self.version, "tokens_generated": self.tokens_generated, "pending": 0}

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits


class StubRewarder:
    """Scores at once: reward 1 for a finished completion (every simulated one)."""

    name = "rewarder"

    def __init__(self):
        self.tracer = Tracer(self.name)

    def score(self, *batches: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        """The batches as one, with rewards filled in, and the summary the loop reads."""
        with self.tracer.span("score"):
            start = time.perf_counter()
            batch = RolloutBatch.concat(batches)
            rewards = batch.finished.astype(np.float32)
            summary = {
                "samples": len(batch),
                "errors": 0,
                "timeouts": 0,
                "reward_mean": float(rewards.mean()) if len(batch) else 0.0,
                "busy_s": time.perf_counter() - start,
            }
            return summary, replace(batch, rewards=rewards)

    def close(self) -> None:
        """Nothing to release."""

    def stats(self) -> dict[str, float]:
        """No counters."""
        return {}

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits


class ScalingWorkload(LLMWorkload):
    """The LLM workload with cost-model executors in place of the real ones."""

    def __init__(self, cfg: Config, token_s: float, step_s: float):
        super().__init__(cfg)
        self.token_s = token_s
        self.step_s = step_s

    def table(self) -> list[Role]:
        """The LLM workload's first three roles with the simulated executors in place of the
        real ones; replicas get plain numbers, not the Config: unpickling it would import
        relayrl.config (and what it imports) into every one of up to 64 replica processes."""
        cfg = self.cfg
        ranks = cfg.trainer.ranks
        shape = {
            k: getattr(cfg.generator, k)
            for k in ("prompts_per_step", "group_size", "max_new_tokens")
        }
        real = {role.name: role for role in super().table()}
        return [
            dataclasses.replace(
                real["trainer"],
                cls=SimTrainer,
                make=lambda r, _: ((cfg, r, ranks, self.step_s), {}),
            ),
            dataclasses.replace(
                real["generator"],
                cls=SimGenerator,
                make=lambda i, _: ((shape, self.token_s, cfg.sync.timeout_s), {}),
            ),
            dataclasses.replace(
                real["rewarder"], cls=StubRewarder, make=lambda i, _: ((), {}), close=None
            ),
        ]

    def place(self) -> None:
        """Place the simulated roles as ``LLMWorkload.place`` places the real ones (no process
        group: see the module doc)."""
        self.placed = Placed.place(self.cfg.placement, self.table())

    def prepare(self, log: MetricsLog) -> dict:
        """Publish version 0 to every replica (no warm start) and evaluate once."""
        ray.get(publish_weights(self.trainer, self.receivers()))
        return {"eval": {"start": asyncio.run(self.evaluate())}}


class TimedTally(RunTally):
    """``RunTally`` that also notes, after each train step, the time, the samples trained so far
    and this process's CPU time (all threads, and the main thread alone)."""

    def __init__(self, steps: int):
        super().__init__(steps, progress=False)
        self.marks: list[tuple[float, int, float, float]] = []

    def on_trained(self, result: StepResult) -> dict[str, float]:
        """Keep the books, then note the mark."""
        out = super().on_trained(result)
        self.marks.append((time.time(), self.trained, time.process_time(), time.thread_time()))
        return out


def probe(actor: Any) -> dict[str, float]:
    """Run inside an actor (``actor.__ray_call__.remote(probe)``): its process id, resident
    memory and proportional set size (shared pages split between the processes that map them)."""
    return {"pid": os.getpid(), **memory()}


def memory() -> dict[str, float]:
    """This process's RSS and PSS in MiB."""
    found = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Rss", "Pss"):
                found[key.lower() + "_mib"] = int(value.split()[0]) / 1024
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far, summed by thread name (Ray names its C++
    threads; the main thread, which runs the asyncio loop, is ``main``)."""
    found: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = "main" if int(tid) == os.getpid() else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rpartition(")")[2].split()
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12]))
    return {name: ticks / os.sysconf("SC_CLK_TCK") for name, ticks in found.items()}


def machine_cpu() -> tuple[float, float]:
    """Busy and total CPU seconds of the whole machine so far, over all cores (/proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / tick, sum(ticks) / tick


def ray_system_pids() -> list[int]:
    """Process ids of the embedded Ray's own processes (raylet with the object store, GCS, ...)."""
    node = ray._private.worker._global_node  # private: no public API lists them
    if node is None:
        return []
    return [info.process.pid for infos in node.all_processes.values() for info in infos]


def main(argv: list[str] | None = None) -> int:
    """Run both sweeps in one Ray instance, write the JSON and the plot, print the table."""
    args = parse_args(argv)
    load_before = os.getloadavg()
    started = time.time()
    placements = plan(args)
    points: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="relayrl-scaling-") as tmp:
        try:
            start_ray(load_config(None, [f"ray.num_cpus={args.num_cpus}"]))
            system = ray_system_pids()
            for i, point in enumerate(placements):
                print(
                    f"[{NAME}] {i + 1}/{len(placements)}: {point['sweep']} sweep, "
                    f"{point['replicas']} replicas, {point['ranks']} ranks, "
                    f"max_staleness {point['max_staleness']}",
                    file=sys.stderr,
                )
                for found in run_point(args, point, Path(tmp), system):
                    print(f"[{NAME}]   {brief(found)}", file=sys.stderr)
                    points.append(found)
        finally:
            ray.shutdown()
    speedups(points)
    result = {
        "benchmark": NAME,
        "command": shlex.join(["python", *(relative(arg) for arg in sys.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine() | {"loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "git": git_state(),
        "wall_clock_s": time.time() - started,
        "settings": settings(args),
        "points": points,
        "acceptance": acceptance(points),
    }
    save_result(args.out, NAME, result, plot, markdown_table(result))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description="Async-loop throughput against generator replicas and trainer ranks, with "
        "simulated compute on the real controller, Ray placement and weight sync.",
    )
    parser.add_argument(
        "--replicas", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64], help="replica sweep"
    )
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 4, 8], help="ranks sweep")
    parser.add_argument(
        "--transports",
        nargs="+",
        choices=["shm", "object_store", "disk"],
        default=["object_store", "shm"],
        help="sync.transport of each run; every placement runs them all, one after the other, on "
        "the same actors (object_store shm)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="generator.prompts_per_step (4)")
    parser.add_argument("--group-size", type=int, default=8, help="generator.group_size (8)")
    parser.add_argument("--new-tokens", type=int, default=8, help="generator.max_new_tokens (8)")
    parser.add_argument(
        "--token-ms",
        type=float,
        default=2000 / 256,
        help="replica sweep: generation ms per token T (7.8: a 256-token batch takes 2 s)",
    )
    parser.add_argument(
        "--step-ms", type=float, default=10.0, help="replica sweep: train ms per step S (10)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="replica sweep: measured waves of M batches (3)"
    )
    parser.add_argument(
        "--rank-generators", type=int, default=2, help="ranks sweep: generator replicas (2)"
    )
    parser.add_argument(
        "--rank-token-ms",
        type=float,
        default=100 / 256,
        help="ranks sweep: generation ms per token (0.39: a batch takes 0.1 s)",
    )
    parser.add_argument(
        "--rank-step-ms", type=float, default=1000.0, help="ranks sweep: train ms per step S (1000)"
    )
    parser.add_argument(
        "--steps-per-rank",
        type=int,
        default=6,
        help="ranks sweep: measured steps per trainer rank (6: about 6 S of measurement)",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="max_staleness of every point (default: the number of generator replicas)",
    )
    parser.add_argument(
        "--gate-replicas",
        type=int,
        default=8,
        help="replicas of the extra point at the config default max_staleness=2 (0: none)",
    )
    parser.add_argument(
        "--deadline-factor",
        type=float,
        default=2.0,
        help="a run is cut after this many times its ideal duration, plus 5 s (2)",
    )
    parser.add_argument("--rewarders", type=int, default=1, help="rewarder replicas (1)")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the embedded Ray (2)")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks" / "results",
        help="folder for the JSON and PNG (benchmarks/results)",
    )
    args = parser.parse_args(argv)
    if min([*args.replicas, *args.ranks, args.rounds, args.steps_per_rank], default=1) < 1:
        parser.error("--replicas, --ranks, --rounds and --steps-per-rank must be >= 1")
    args.replicas = sorted(set(args.replicas))
    args.ranks = sorted(set(args.ranks))
    return args


def settings(args: argparse.Namespace) -> dict:
    """The cost model and grids, for the result file."""
    samples = args.prompts * args.group_size
    tokens = samples * args.new_tokens
    return {
        "samples_per_batch": samples,
        "tokens_per_batch": tokens,
        "prompt_len": PROMPT_LEN,
        "transports": args.transports,
        "rewarder": "stub (concatenates, reward = finished, returns at once)",
        "rewarders": args.rewarders,
        "ray_num_cpus": args.num_cpus,
        "synced_model_bytes": 2 * (WIDTH * WIDTH + WIDTH) * 4,
        "replica_sweep": {
            "replicas": args.replicas,
            "token_s": args.token_ms / 1e3,
            "batch_generate_s": args.token_ms / 1e3 * tokens,
            "train_step_s": args.step_ms / 1e3,
            "warmup_steps": "M (one wave), or what the first 2 ideal waves' time gave",
            "measured_steps": f"{args.rounds} * M, unless cut by the deadline",
        },
        "ranks_sweep": {
            "ranks": args.ranks,
            "generators": args.rank_generators,
            "token_s": args.rank_token_ms / 1e3,
            "batch_generate_s": args.rank_token_ms / 1e3 * tokens,
            "train_step_s_one_rank": args.rank_step_ms / 1e3,
            "warmup_steps": "generators (one wave)",
            "measured_steps": f"{args.steps_per_rank} * ranks",
        },
        "max_staleness": "replicas" if args.max_staleness is None else args.max_staleness,
        "deadline": f"{args.deadline_factor} x ideal duration + 5 s",
    }


def plan(args: argparse.Namespace) -> list[dict]:
    """Every placement to run, in order."""
    stale = args.max_staleness
    samples = args.prompts * args.group_size
    size = {"samples": samples, "tokens": samples * args.new_tokens}
    replica_sweep = {"token_s": args.token_ms / 1e3, "step_s": args.step_ms / 1e3, "ranks": 1}
    points = [
        {"sweep": "replicas", "replicas": m, "max_staleness": m if stale is None else stale}
        | replica_sweep
        | {"warmup": m, "measured": args.rounds * m}
        for m in args.replicas
    ]
    if args.gate_replicas:
        m = args.gate_replicas
        points.append(
            {"sweep": "gate", "replicas": m, "max_staleness": 2}
            | replica_sweep
            | {"warmup": m, "measured": args.rounds * m}
        )
    m = args.rank_generators
    points += [
        {
            "sweep": "ranks",
            "replicas": m,
            "ranks": r,
            "max_staleness": m if stale is None else stale,
            "token_s": args.rank_token_ms / 1e3,
            "step_s": args.rank_step_ms / 1e3,
            "warmup": m,
            "measured": args.steps_per_rank * r,
        }
        for r in args.ranks
    ]
    for point in points:
        point |= size
        gen_rate = point["samples"] / (point["token_s"] * point["tokens"])
        point["train_rate"] = point["samples"] / (point["step_s"] / point["ranks"])
        point["gen_rate_per_replica"] = gen_rate
        point["ideal_samples_per_s"] = min(point["replicas"] * gen_rate, point["train_rate"])
        ideal_steps_per_s = point["ideal_samples_per_s"] / point["samples"]
        point["ideal_warmup_s"] = point["warmup"] / ideal_steps_per_s
        point["ideal_loop_s"] = (point["warmup"] + point["measured"]) / ideal_steps_per_s
    return points


def config_for(args: argparse.Namespace, point: dict, transport: str, tmp: Path) -> Config:
    """The run config of one point and transport."""
    return load_config(
        None,
        [
            "mode=async",
            f"steps={point['warmup'] + point['measured']}",
            "run.checkpoint_every=0",  # the loop is measured, not its checkpoints
            f"max_staleness={point['max_staleness']}",
            f"generator.replicas={point['replicas']}",
            f"generator.prompts_per_step={args.prompts}",
            f"generator.group_size={args.group_size}",
            f"generator.max_new_tokens={args.new_tokens}",
            f"generator.max_new_tokens_per_step={args.new_tokens}",
            f"rewarder.replicas={args.rewarders}",
            f"trainer.ranks={point['ranks']}",
            f"sync.transport={transport}",
            f"ray.num_cpus={args.num_cpus}",
            "log.tensorboard=false",
            "log.progress=false",
            "log.eval_every=0",
            f"run.out_dir={tmp}",
        ],
    )


def run_point(args: argparse.Namespace, point: dict, tmp: Path, system: list[int]) -> list[dict]:
    """Place one configuration, run the real async loop on it once per transport (rewiring
    weight sync in between), measure, and stop its actors."""
    configs = [config_for(args, point, t, tmp) for t in args.transports]
    workload = ScalingWorkload(configs[0], point["token_s"], point["step_s"])
    placing = time.time()
    found = []
    try:
        workload.place()
        for i, cfg in enumerate(configs):
            if i:  # let every queued call end, then close the last transport's publishers
                ray.get([a.stats.remote() for g in workload.groups() for a in g])
                ray.get([rank.close_sync.remote() for rank in workload.trainer])
            workload.cfg = cfg
            sync = connect_weight_sync(cfg, workload.trainer, workload.receivers())
            workload.prepare(None)
            ready_s = time.time() - placing
            name = f"{point['sweep']}-{point['replicas']}-{point['ranks']}-{sync.transport}"
            run_dir = tmp / name
            run_dir.mkdir(parents=True)
            found.append(
                run_loop(point, workload, sync, cfg, run_dir, system, args.deadline_factor)
                | {"transport": sync.transport, "ready_s": ready_s}
            )
            placing = time.time()
    finally:
        workload.placed.stop()
    return found


def run_loop(
    point: dict,
    workload: ScalingWorkload,
    sync: WeightSync,
    cfg: Config,
    run_dir: Path,
    system: list[int],
    deadline_factor: float,
) -> dict:
    """``controller.run_async`` on the placed workload, cut at the deadline; the numbers."""
    roles = {g.role: ray.get([a.__ray_call__.remote(probe) for a in g]) for g in workload.groups()}
    pids = {role: [p["pid"] for p in found] for role, found in roles.items()}
    pids["ray_system"] = system
    before_stalls = [len(s["stall_s"]) for s in ray.get(_sync_stats(workload.trainer))]
    before_receives = [len(s["receive_s"]) for s in ray.get(_sync_stats(workload.generators))]
    # What the driver burns with nothing to do (Ray's threads), to tell it from per-step work.
    idle_cpu, idle_wall = time.process_time(), time.time()
    time.sleep(IDLE_S)
    idle_cores = (time.process_time() - idle_cpu) / (time.time() - idle_wall)
    log = MetricsLog(run_dir, tensorboard=False)
    tally = TimedTally(cfg.steps)
    deadline = deadline_factor * point["ideal_loop_s"] + 5.0
    tally.start()
    cpu = {role: sum(map(cpu_seconds, found)) for role, found in pids.items()}
    busy, total = machine_cpu()
    threads = thread_cpu()
    wall, main_cpu, main_thread = time.time(), time.process_time(), time.thread_time()
    try:
        workload.recovery = Recovery(workload.placed, sync, tally)
        ckpt = Checkpointer(cfg, run_dir, workload, tally, log)
        loop = asyncio.run(
            asyncio.wait_for(run_async(cfg, workload, sync, tally, log, ckpt), deadline)
        )
    except asyncio.TimeoutError:
        loop = {"in_flight": None}
    finally:
        log.close()
    loop_wall = time.time() - wall
    threads = {name: t - threads.get(name, 0.0) for name, t in thread_cpu().items()}
    loop_cpu = {
        "driver": time.process_time() - main_cpu,
        **{role: sum(map(cpu_seconds, found)) - cpu[role] for role, found in pids.items()},
    }
    busy_after, total_after = machine_cpu()
    machine_busy = busy_after - busy
    cores = (total_after - total) / loop_wall
    loop_cpu["other_processes"] = machine_busy - sum(loop_cpu.values())
    stalls = [
        s["stall_s"][n:]
        for s, n in zip(ray.get(_sync_stats(workload.trainer)), before_stalls, strict=True)
    ]
    receives = [
        s["receive_s"][n:]
        for s, n in zip(ray.get(_sync_stats(workload.generators)), before_receives, strict=True)
    ]
    traces = {g.role: ray.get([a.trace.remote() for a in g]) for g in workload.groups()}
    found = measure(point, tally, traces, stalls, receives)
    if "window_s" in found:
        found["controller_cpu_s_per_step_above_idle"] = (
            found["controller_cpu_s_per_step"]
            - idle_cores * found["window_s"] / found["measured_steps"]
        )
    return found | {
        "driver_idle_cores": idle_cores,
        "timed_out": loop["in_flight"] is None,
        "deadline_s": deadline,
        "loop": {
            "wall_s": loop_wall,
            "steps": tally.steps,
            "cpu_s_per_step": (time.process_time() - main_cpu) / max(tally.steps, 1),
            "main_thread_cpu_s_per_step": (time.thread_time() - main_thread) / max(tally.steps, 1),
            "in_flight": loop["in_flight"],
            "publishes": len(stalls[0]),
            "receives": sum(len(r) for r in receives),
            "cores_used_by": {role: s / loop_wall for role, s in loop_cpu.items()},
            "driver_threads_cores": {
                name: t / loop_wall
                for name, t in sorted(threads.items(), key=lambda item: -item[1])
                if t > 0
            },
            "machine_cores": cores,
            "machine_busy_fraction": machine_busy / (cores * loop_wall),
        },
        "memory_mib": {
            role: {
                "rss_mean": mean(p["rss_mib"] for p in found),
                "rss_max": max(p["rss_mib"] for p in found),
                "pss_mean": mean(p["pss_mib"] for p in found),
                "pss_total": sum(p["pss_mib"] for p in found),
            }
            for role, found in roles.items()
        }
        | {"driver": memory()},
        "mem_available_mib": _mem_available_mib(),
    }


def _sync_stats(group: Group) -> list[Any]:
    return [a.sync_stats.remote() for a in group]


def _mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(
    point: dict,
    tally: TimedTally,
    traces: dict[str, list[tuple[list[Span], list[Span]]]],
    stalls: list[list[float]],
    receives: list[list[float]],
) -> dict:
    """The numbers of one run, over the window from the end of the warm-up to the last step.

    The warm-up is one wave (a batch from every replica), or the steps done within twice its
    ideal time when the run is slower than that."""
    marks = tally.marks
    cap = marks[0][0] + 2 * point["ideal_warmup_s"] if marks else 0.0
    warm = min(point["warmup"] - 1, max(sum(1 for m in marks if m[0] <= cap) - 1, 0))
    out = {k: point[k] for k in ("sweep", "replicas", "ranks", "max_staleness")}
    out |= {
        k: point[k]
        for k in ("ideal_samples_per_s", "gen_rate_per_replica", "train_rate", "samples")
    }
    if len(marks) - warm < 3:  # too few steps after the warm-up to measure a rate
        nan = float("nan")
        return out | {
            "throughput_samples_per_s": nan,
            "ratio_to_ideal": nan,
            "controller_cpu_s_per_step": nan,
            "controller_main_thread_cpu_s_per_step": nan,
            "publish_stall_s": {},
            "staleness": tally.staleness(),
            "samples_books": {
                "generated": tally.generated,
                "trained": tally.trained,
                "dropped_stale": tally.dropped_stale,
            },
        }
    first, last = marks[warm], marks[-1]
    steps = len(marks) - 1 - warm
    window = last[0] - first[0]
    throughput = (last[1] - first[1]) / window
    stall = [max(s) for s in zip(*stalls, strict=False)]
    receive = [r for found in receives for r in found]
    return out | {
        "warmup_steps": warm + 1,
        "measured_steps": steps,
        "window_s": window,
        "throughput_samples_per_s": throughput,
        "ratio_to_ideal": throughput / point["ideal_samples_per_s"],
        "controller_cpu_s_per_step": (last[2] - first[2]) / steps,
        "controller_main_thread_cpu_s_per_step": (last[3] - first[3]) / steps,
        "controller_cores": (last[2] - first[2]) / window,
        "busy": {
            role: mean(busy_seconds(spans, first[0], last[0]) / window for spans, _ in found)
            for role, found in traces.items()
        },
        "publish_stall_s": {"mean": mean(stall), "max": max(stall)} if stall else {},
        "receive_s": {"mean": mean(receive), "max": max(receive)} if receive else {},
        "staleness": tally.staleness(),
        "samples_books": {
            "generated": tally.generated,
            "trained": tally.trained,
            "dropped_stale": tally.dropped_stale,
        },
    }


def speedups(points: list[dict]) -> None:
    """Each point's throughput over its sweep's first point with the same transport (1
    replica, or 1 rank); the gate point is compared with the replica sweep."""
    for p in points:
        sweep = "replicas" if p["sweep"] == "gate" else p["sweep"]
        base = next(q for q in points if q["sweep"] == sweep and q["transport"] == p["transport"])
        p["speedup"] = p["throughput_samples_per_s"] / base["throughput_samples_per_s"]


def acceptance(points: list[dict]) -> dict:
    """The issue's targets per transport: 8 replicas >= 7x one replica, 64 replicas >= 0.8x
    the ideal."""
    out: dict[str, Any] = {}
    for transport in dict.fromkeys(p["transport"] for p in points):
        by = {
            p["replicas"]: p
            for p in points
            if p["sweep"] == "replicas" and p["transport"] == transport
        }
        mine: dict[str, Any] = {}
        if 8 in by and 1 in by:
            mine["speedup_8_replicas"] = by[8]["speedup"]
            mine["speedup_8_replicas_ge_7"] = by[8]["speedup"] >= 7
        if 64 in by:
            mine["ratio_to_ideal_64_replicas"] = by[64]["ratio_to_ideal"]
            mine["ratio_to_ideal_64_replicas_ge_0.8"] = by[64]["ratio_to_ideal"] >= 0.8
        out[transport] = mine
    return out


def brief(p: dict) -> str:
    """One progress line."""
    if "window_s" not in p:
        return f"{p['transport']}: too few steps to measure ({p['loop']['steps']})"
    return (
        f"{p['transport']}: {p['throughput_samples_per_s']:.1f} samples/s (ideal "
        f"{p['ideal_samples_per_s']:.1f}, {p['ratio_to_ideal']:.2f}x), controller CPU "
        f"{1e3 * p['controller_cpu_s_per_step']:.2f} ms/step, {p['loop']['receives']} receives "
        f"for {p['loop']['publishes']} publishes, ready in {p['ready_s']:.1f} s, "
        f"loop {p['loop']['wall_s']:.1f} s{' (cut)' if p['timed_out'] else ''}"
    )


def plot(result: dict, path: Path) -> Path:
    """Throughput against replicas and against ranks (with the ideal), one line per transport,
    and controller CPU per step."""
    points = result["points"]
    transports = result["settings"]["transports"]
    colors = dict(zip(transports, ["tab:blue", "tab:orange", "tab:green"], strict=False))
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 5.5))
    for ax, sweep, label in (
        (left, "replicas", "generator replicas (trainer ranks 1)"),
        (middle, "ranks", "trainer ranks"),
    ):
        key = "ranks" if sweep == "ranks" else "replicas"
        mine = [p for p in points if p["sweep"] == sweep]
        if not mine:  # a run without this sweep (e.g. --ranks with no value)
            ax.set_visible(False)
            continue
        for transport in transports:
            line = [p for p in mine if p["transport"] == transport]
            ax.plot(
                [p[key] for p in line],
                [p["throughput_samples_per_s"] for p in line],
                "o-",
                color=colors[transport],
                label=f"measured, {transport}",
            )
            for p in line:
                ax.annotate(
                    f"{p['ratio_to_ideal']:.2f}",
                    (p[key], p["throughput_samples_per_s"]),
                    fontsize=7,
                    color=colors[transport],
                )
        ideal = [p for p in mine if p["transport"] == transports[0]]
        xs = [p[key] for p in ideal]
        ax.plot(xs, [p["ideal_samples_per_s"] for p in ideal], "k:", label="ideal")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(label)
        ax.set_ylabel("samples trained per second")
        ax.set_title(f"throughput vs {key} (labels: measured / ideal)")
    for p in points:
        if p["sweep"] == "gate":
            left.plot(
                [p["replicas"]],
                [p["throughput_samples_per_s"]],
                "x",
                color=colors[p["transport"]],
                markersize=9,
                label=f"max_staleness={p['max_staleness']}, {p['transport']}",
            )
    for ax in (left, middle):
        if ax.get_visible():
            ax.legend(fontsize=7)
    for transport in transports:
        for sweep, marker in (("replicas", "o"), ("ranks", "s")):
            line = [p for p in points if p["sweep"] == sweep and p["transport"] == transport]
            if line:
                right.plot(
                    [p[sweep] for p in line],
                    [1e3 * p["controller_cpu_s_per_step"] for p in line],
                    marker=marker,
                    linestyle="-" if sweep == "replicas" else "--",
                    color=colors[transport],
                    label=f"{sweep} sweep, {transport}",
                )
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    ticks = sorted({p["replicas"] for p in points} | {p["ranks"] for p in points})
    right.set_xticks(ticks, [str(x) for x in ticks])
    right.set_xlabel("replicas (solid) or ranks (dashed)")
    right.set_ylabel("controller (driver process) CPU ms per train step")
    right.set_title("controller CPU per step")
    right.legend(fontsize=7)
    s = result["settings"]
    fig.suptitle(
        f"relayrl run_async scaling, simulated compute; replica sweep "
        f"{s['replica_sweep']['batch_generate_s']:g} s/batch, "
        f"{s['replica_sweep']['train_step_s']:g} s/step; ranks sweep "
        f"{s['ranks_sweep']['batch_generate_s']:g} s/batch, "
        f"{s['ranks_sweep']['train_step_s_one_rank']:g} s/step at 1 rank; "
        f"{s['samples_per_batch']} samples/batch",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown_table(result: dict) -> str:
    """A table and a footer line to paste into docs/benchmarks.md."""
    head = [
        "sweep",
        "transport",
        "replicas",
        "ranks",
        "max_staleness",
        "samples/s",
        "ideal",
        "/ ideal",
        "speed-up",
        "controller CPU ms/step (process / main thread)",
        "busy trainer / generators",
        "publish stall ms",
        "lag mean / max",
        "dropped",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in result["points"]:
        busy = p.get("busy", {})
        cut = " (cut)" if p["timed_out"] else ""
        cells = [
            p["sweep"],
            p["transport"],
            str(p["replicas"]),
            str(p["ranks"]),
            str(p["max_staleness"]),
            f"{p['throughput_samples_per_s']:.1f}{cut}",
            f"{p['ideal_samples_per_s']:.1f}",
            f"{p['ratio_to_ideal']:.2f}",
            f"{p['speedup']:.2f}x",
            f"{1e3 * p['controller_cpu_s_per_step']:.1f} / "
            f"{1e3 * p['controller_main_thread_cpu_s_per_step']:.1f}",
            f"{busy.get('trainer', float('nan')):.2f} / {busy.get('generator', float('nan')):.2f}",
            f"{1e3 * p['publish_stall_s'].get('mean', float('nan')):.1f}",
            f"{p['staleness']['mean']:.1f} / {p['staleness']['max']}",
            str(p["samples_books"]["dropped_stale"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    m = result["machine"]
    lines += [
        "",
        f"Acceptance: {result['acceptance']}. Command: `{result['command']}`; {m['platform']}, "
        f"{m['cpu_count']} CPUs, load average before/after {m['loadavg_before'][0]:.1f} / "
        f"{m['loadavg_after'][0]:.1f}, torch {m['torch']}, ray {m['ray']}; commit "
        f"{result['git'].get('commit')} (dirty: {result['git'].get('dirty')}); "
        f"{result['wall_clock_s']:.0f} s in all.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
