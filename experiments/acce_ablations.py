"""Ablations of AcceRL's systems mechanisms, one subcommand each (``ABLATIONS``).

``g3``: the inference service's early drain (``experiment.early_drain``). A new weight version is
received beside the forward passes, which wait only for the pointer swap; without it the whole
transfer runs inside the model lock and every request that arrives meanwhile waits for it.

The real ``InferenceService`` runs as a Ray async actor with the real ``VLAPolicy`` built from
``configs/babyai.yaml``; a trainer stand-in actor publishes its weights through the real
weight-sync transport (``--transport``, dist by default: gloo pairs, the cross-host path, where a
receive takes time; same-host shm binds the trainer's slot without copying, so there is no
transfer to hide). N caller actors, separate processes like rollout workers, each loop: one
``act`` with a BabyAI observation, then a simulated env step (``--env-ms``). Both arms run in
one run on the same service, publisher and callers: the run is cut into ``2 x --swaps`` slots of
``--period`` seconds, the arms alternate slot by slot (the flag is set between swaps), and in
each slot the trainer publishes once, half a period in. Per arm:

- request latency as a caller sees it (the Ray round trip), p50 and p95 over the arm's slots;
- p95 of the requests in flight while a swap is (sent before the service serves the new version
  and answered after the publish began), and of the others;
- the trainer-side sync wait: from the start of ``publish`` until ``update_weights`` returns,
  i.e. the service serves the new version; and the receiver's split of it (transfer, and the
  swap's wait for the forward pass in flight).

On CPU a dense policy large enough for a long transfer would also take seconds per forward
pass, unlike a VLA on a GPU (weights of GBs over NCCL, forward passes of tens of ms). So by
default the policy is babyai.yaml's with ``d_model`` 128 and an instruction-embedding table of
``--hash-buckets`` rows: two sizes, ~100 and ~400 MB of weights, a few ms per forward pass each.
The gain grows with the transfer's length against a forward pass's; on a CPU machine it is also
bounded by the CPU the transfer takes from the forward passes it overlaps.

``g1``: value recomputation under lag. ``configs/babyai.yaml`` with ``--preset acce`` at
``max_staleness`` 4, trained with ``trainer.value_recompute=fused`` (GAE from the training
forward's own values, AcceRL's) and ``=off`` (the values the inference service computed when it
acted, up to 4 versions old; the bootstrap value still from the current critic), one run per arm
and seed, the arms taking turns. Per run: held-out success (``env.eval_tasks``) every
``--eval-every`` steps against trained env steps, the final success, the training episodes'
success, the mean lag and wall clock.

``g2``: GIPO against PPO-clip under a forced lag. ``configs/babyai.yaml`` with ``--preset acce``
(GIPO sigma 0.2, neg 1.0), and the same with ``trainer.loss=ppo_clip``, at each
``inference.min_lag`` of ``--lags`` (the trainer publishes the weights of that many versions ago,
so every env step is acted that many versions or more behind the trainer; ``max_staleness`` is the
lag + 2). Per run, as for g1, plus the trainer's fraction of clipped (PPO) or down-weighted to
w < 0.5 (GIPO) tokens and the normalised ESS of the importance weights, per step.

Run from the repository root::

    python experiments/acce_ablations.py g1                        # 150 steps per arm, seed 0
    python experiments/acce_ablations.py g1 --steps 40 --seeds 0 1 # a quicker look, two seeds
    python experiments/acce_ablations.py g1 env.eval_tasks=null --seeds 0   # overrides first
    python experiments/acce_ablations.py g2 env.eval_tasks=null    # lags 1, 4, 8, seed 0
    python experiments/acce_ablations.py g3                        # 6 swaps per arm, dist
    python experiments/acce_ablations.py g3 --swaps 2 --period 1   # a quick look
    python experiments/acce_ablations.py g3 --transport object_store vla.d_model=256

It writes ``experiments/results/acce_ablations_<ablation>.json`` and ``.png`` (with the command
line, the machine and the git state) and prints a Markdown table for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # benchmark machines have no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import git_state, machine, relative, save_result  # noqa: E402
from inference_service import policy_shape, record_observations  # noqa: E402

from relayrl.config import Config, load_config  # noqa: E402
from relayrl.envs.embodied import Observation  # noqa: E402
from relayrl.envs.latency import DELAYS  # noqa: E402
from relayrl.executors.inference_service import InferenceService  # noqa: E402
from relayrl.job import train  # noqa: E402
from relayrl.launch import start_ray  # noqa: E402
from relayrl.models.vla import VLAConfig, VLAPolicy, vla_config  # noqa: E402
from relayrl.weight_sync import TRANSPORTS, Ticket  # noqa: E402
from relayrl.weight_sync.base import TrainerSide  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ACCE = REPO / "configs" / "presets" / "acce.yaml"
ARMS = {"early drain": True, "lock": False}  # arm -> experiment.early_drain
WORKER_NICENESS = "RAY_worker_niceness"
SERVICE = "inference_service"


class Caller:
    """A stand-in rollout worker: ask for an action, 'step' for a drawn time, repeat."""

    def __init__(self, observations: list[Observation], env_dist: str, env_ms: float):
        self.observations = observations
        self.env_dist, self.env_ms = env_dist, env_ms

    def run(self, service, end_at: float, seed: int) -> list[tuple[float, float, int]]:
        """Loop until ``end_at`` (wall clock); (sent at, round-trip seconds, reply version) of
        every request."""
        rng = np.random.default_rng(seed)
        out, i = [], int(rng.integers(len(self.observations)))
        while (sent_at := time.time()) < end_at:
            start = time.perf_counter()
            reply = ray.get(service.act.remote(self.observations[i % len(self.observations)]))
            out.append((sent_at, time.perf_counter() - start, reply.version))
            i += 1
            if self.env_ms > 0:
                time.sleep(DELAYS[self.env_dist](rng, self.env_ms, 1.0) / 1000.0)
        return out


class TrainerStandIn:
    """The trainer's half of weight sync (``TrainerSide``, as the real trainer uses it) over a
    policy's weights, nudged before each publish so that every version differs."""

    def __init__(self, vla: VLAConfig, seed: int):
        torch.manual_seed(seed)
        self.model = VLAPolicy(vla)
        self.side = TrainerSide(timeout_s=60.0, bucket_bytes=256 << 20, streams=2, in_place=False)

    def open(self, transport: str) -> dict:
        """Open the publisher for the service; its address."""
        return self.side.open(TRANSPORTS[transport], self.model, [SERVICE], "127.0.0.1")

    def connect(self) -> None:
        """Rendezvous with the service's receiver."""
        self.side.publisher.connect()

    def publish(self, version: int) -> Ticket:
        """Publish the weights as ``version``."""
        with torch.no_grad():
            self.model.action_head.bias.add_(1e-3)
        return self.side.publish(version, self.model.state_dict())

    def close(self) -> None:
        """Close the publisher."""
        self.side.close()


def g1(args: argparse.Namespace) -> tuple[dict, list]:
    """Value recomputation on (fused) and off under lag: one training run per arm and seed."""
    arms = {
        arm: [f"max_staleness={args.staleness}", f"trainer.value_recompute={arm}"]
        for arm in args.arms
    }
    runs = _train_arms("g1", args, arms)
    settings = _settings(args) | {"max_staleness": args.staleness}
    return {"settings": settings, "arms": _arm_means(runs, arms), "runs": runs}, runs


def g2(args: argparse.Namespace) -> tuple[dict, list]:
    """GIPO against PPO-clip at each forced lag: one training run per loss, lag and seed."""
    arms = {
        f"{loss} lag {lag}": [
            f"trainer.loss={loss}",
            f"inference.min_lag={lag}",
            f"max_staleness={lag + 2}",
        ]
        for lag in args.lags
        for loss in args.losses
    }
    runs = _train_arms("g2", args, arms)
    settings = _settings(args) | {"lags": args.lags, "losses": args.losses}
    return {"settings": settings, "arms": _arm_means(runs, arms), "runs": runs}, runs


def _settings(args: argparse.Namespace) -> dict:
    """The settings every training ablation shares."""
    return {
        "config": relative(str(args.config)),
        "preset": relative(str(ACCE)),
        "steps": args.steps,
        "seeds": args.seeds,
        "eval_every": args.eval_every,
        "eval_episodes": args.eval_episodes,
        "overrides": args.overrides,
    }


def _train_arms(name: str, args: argparse.Namespace, arms: dict[str, list[str]]) -> list[dict]:
    """Train ``args.config`` with ``--preset acce`` once per arm (its overrides) and seed, the
    arms taking turns within a seed; returns what ``_run_record`` keeps of each run, also
    written to ``acce_ablations_NAME.partial.json`` as each run ends."""
    runs = []
    with tempfile.TemporaryDirectory(prefix=f"relayrl-{name}-") as tmp:
        for seed in args.seeds:
            for index, (arm, arm_overrides) in enumerate(arms.items()):
                overrides = [
                    *args.overrides,
                    *arm_overrides,
                    f"steps={args.steps}",
                    f"run.seed={seed}",
                    f"env.eval_episodes={args.eval_episodes}",
                    f"log.eval_every={args.eval_every}",
                    "log.progress=false",
                    "log.tensorboard=false",
                    f"run.out_dir={tmp}",
                ]
                cfg = load_config(args.config, overrides, presets=[ACCE])
                print(f"[{name}] {arm}, seed {seed}", file=sys.stderr, flush=True)
                with contextlib.redirect_stdout(sys.stderr):
                    summary = train(cfg, Path(tmp) / f"arm{index}-{seed}")
                runs.append(_run_record(arm, seed, summary))
                # A sweep killed part-way keeps the runs that finished.
                partial = args.out / f"acce_ablations_{name}.partial.json"
                partial.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    return runs


def _arm_means(runs: list[dict], arms: dict[str, list[str]]) -> dict[str, dict]:
    """Per arm: the final success, mean over seeds and per seed, and the mean clip fraction and
    ESS over every step of its runs."""
    out = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        out[arm] = {
            "final_success_mean": float(np.mean([r["final_success"] for r in mine])),
            "final_success_per_seed": [r["final_success"] for r in mine],
            "clip_frac_mean": float(np.mean([r["clip_frac_mean"] for r in mine])),
            "ess_mean": float(np.mean([r["ess_mean"] for r in mine])),
        }
    return out


def _run_record(arm: str, seed: int, summary: dict) -> dict:
    """What an ablation keeps of one run: the held-out curve against trained env steps, the
    trainer's clip fraction and ESS per step, and the rest."""
    lines = Path(summary["artifacts"]["metrics"]).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    trained = {
        r["step"]: r["samples/trained_total"] for r in records if "samples/trained_total" in r
    }
    trained[0] = 0.0
    curve = [
        (trained.get(r["step"], 0.0), r["eval/success_rate"])
        for r in records
        if "eval/success_rate" in r
    ]
    end, trained_end = summary["eval"]["end"]["success_rate"], float(summary["samples"]["trained"])
    if not curve or curve[-1][0] != trained_end:  # the end evaluation may be logged already
        curve.append((trained_end, end))
    rollout = [r["rollout/success_rate"] for r in records if "rollout/success_rate" in r]
    health = [
        (r["step"], r["loss/clip_frac"], r["loss/ess"], r.get("staleness/mean", float("nan")))
        for r in records
        if "loss/clip_frac" in r
    ]
    return {
        "arm": arm,
        "seed": seed,
        "final_success": end,
        "curve": curve,
        "health": health,  # (step, clip_frac, ess, mean lag of the step's samples)
        "clip_frac_mean": float(np.mean([h[1] for h in health])) if health else float("nan"),
        "ess_mean": float(np.mean([h[2] for h in health])) if health else float("nan"),
        "rollout_success_last10": float(np.mean(rollout[-10:])) if rollout else None,
        "staleness_mean": summary["staleness"]["mean"],
        "trained_env_steps": summary["samples"]["trained"],
        "dropped_stale": summary["samples"]["dropped_stale"],
        "accounted": summary["samples"]["accounted"],
        "rl_wall_clock_s": summary["perf"]["rl_wall_clock_s"],
    }


def g1_plot(result: dict, raw: list, path: Path) -> Path:
    """Held-out success against trained env steps, one line per run."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = {arm: f"C{i}" for i, arm in enumerate(result["arms"])}
    for run in result["runs"]:
        steps, success = zip(*run["curve"], strict=True)
        ax.plot(
            np.asarray(steps) / 1000,
            success,
            marker="o",
            color=colours[run["arm"]],
            alpha=0.9 if run["seed"] == result["settings"]["seeds"][0] else 0.5,
            label=f"value_recompute={run['arm']}, seed {run['seed']}",
        )
    s = result["settings"]
    ax.set_xlabel("trained env steps (thousands)")
    ax.set_ylabel(f"held-out success ({s['eval_episodes']} episodes)")
    ax.set_title(f"G.1: --preset acce, max_staleness {s['max_staleness']}", fontsize=9)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def g1_table(result: dict) -> str:
    """One row per run, then the mean final success per arm."""
    lines = [
        "| value_recompute | seed | final held-out success | training success (last 10 steps) "
        "| mean lag | trained env steps | RL wall clock (s) | books balance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        rollout = r["rollout_success_last10"]
        lines.append(
            f"| {r['arm']} | {r['seed']} | {r['final_success']:.3f} "
            f"| {'-' if rollout is None else f'{rollout:.3f}'} | {r['staleness_mean']:.2f} "
            f"| {r['trained_env_steps']} | {r['rl_wall_clock_s']:.0f} | {r['accounted']} |"
        )
    lines.append("")
    for arm, row in result["arms"].items():
        lines.append(f"- {arm}: mean final success {row['final_success_mean']:.3f}")
    lines += ["", f"Command: `{result['command']}`."]
    return "\n".join(lines)


def g2_plot(result: dict, raw: list, path: Path) -> Path:
    """One column per lag: held-out success against trained env steps, then the clip (or
    down-weight) fraction and the ESS per step, one line per loss and seed."""
    s = result["settings"]
    lags, losses = s["lags"], s["losses"]
    fig, axes = plt.subplots(3, len(lags), figsize=(4.2 * len(lags), 9), squeeze=False)
    colours = {loss: f"C{i}" for i, loss in enumerate(losses)}
    for run in result["runs"]:
        loss, lag = run["arm"].split(" lag ")
        col = lags.index(int(lag))
        style = {"color": colours[loss], "alpha": 0.9 if run["seed"] == s["seeds"][0] else 0.5}
        label = f"{loss}, seed {run['seed']}"
        steps, success = zip(*run["curve"], strict=True)
        axes[0][col].plot(np.asarray(steps) / 1000, success, marker="o", label=label, **style)
        if run["health"]:
            step, clip, ess, _ = zip(*run["health"], strict=True)
            axes[1][col].plot(step, _smooth(clip), label=label, **style)
            axes[2][col].plot(step, _smooth(ess), label=label, **style)
    for col, lag in enumerate(lags):
        axes[0][col].set_title(f"inference.min_lag {lag} (max_staleness {lag + 2})", fontsize=9)
        axes[0][col].set_xlabel("trained env steps (thousands)")
        axes[0][col].set_ylim(-0.02, 1.02)
        axes[1][col].set_ylim(bottom=0)
        axes[2][col].set_ylim(0, 1.02)
        for row in range(1, 3):
            axes[row][col].set_xlabel("trainer step")
        for row in range(3):
            axes[row][col].grid(True, alpha=0.3)
    axes[0][0].set_ylabel(f"held-out success ({s['eval_episodes']} episodes)")
    axes[1][0].set_ylabel("clipped / down-weighted tokens\n(10-step mean)")
    axes[2][0].set_ylabel("importance-weight ESS\n(10-step mean)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("G.2: GIPO(0.2, 1.0) against PPO-clip, --preset acce, forced lag", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _smooth(values: tuple[float, ...], window: int = 10) -> np.ndarray:
    """Trailing mean over ``window`` steps (shorter at the start)."""
    x = np.asarray(values, dtype=float)
    sums = np.cumsum(np.insert(x, 0, 0.0))
    counts = np.minimum(np.arange(1, len(x) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(x) + 1) - counts]) / counts


def g2_table(result: dict) -> str:
    """One row per run, then the mean final success per arm."""
    lines = [
        "| loss | forced lag | seed | final held-out success | training success (last 10 steps) "
        "| clipped / down-weighted | ESS | mean lag | trained env steps | stale drops "
        "| RL wall clock (s) | books balance |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        loss, lag = r["arm"].split(" lag ")
        rollout = r["rollout_success_last10"]
        lines.append(
            f"| {loss} | {lag} | {r['seed']} | {r['final_success']:.3f} "
            f"| {'-' if rollout is None else f'{rollout:.3f}'} | {r['clip_frac_mean']:.3f} "
            f"| {r['ess_mean']:.3f} | {r['staleness_mean']:.2f} | {r['trained_env_steps']} "
            f"| {r['dropped_stale']} | {r['rl_wall_clock_s']:.0f} | {r['accounted']} |"
        )
    lines.append("")
    for arm, row in result["arms"].items():
        lines.append(f"- {arm}: mean final success {row['final_success_mean']:.3f}")
    lines += ["", f"Command: `{result['command']}`."]
    return "\n".join(lines)


def g3(args: argparse.Namespace) -> tuple[dict, list]:
    """Early drain against the model lock, alternating slot by slot, for each policy size: the
    result, and per size every request (sent at, seconds, version) for the plot (too many for
    the JSON)."""
    cfg = load_config(args.config, args.overrides)
    observations = record_observations(cfg)
    views, dims, vocab = policy_shape(cfg)
    threads = args.threads or cfg.ray.threads_per_executor
    # Every part of the benchmark is a Ray worker; at Ray's default nice 15 any other process on
    # the machine would take their CPU first.
    os.environ[WORKER_NICENESS] = "0"
    start_ray(cfg)
    sizes, raw = [], []
    try:
        for buckets in args.hash_buckets:
            sized = vla_config(
                cfg.vla, image_size=cfg.env.image_size, views=views, dims=dims, vocab=vocab
            )
            vla = dataclasses.replace(sized, hash_buckets=buckets)
            print(f"[g3] hash_buckets={buckets}", file=sys.stderr)
            swaps, requests = g3_size(args, cfg, vla, observations, threads)
            policy = VLAPolicy(vla)
            state = policy.state_dict().values()
            sizes.append(
                {
                    "hash_buckets": buckets,
                    "parameters": sum(p.numel() for p in policy.parameters()),
                    "megabytes": sum(t.numel() * t.element_size() for t in state) / 1e6,
                    "vla": dataclasses.asdict(vla),
                    "swaps": swaps,
                    "arms": {arm: summarize(arm, swaps, requests) for arm in ARMS},
                }
            )
            raw.append(requests)
    finally:
        ray.shutdown()
    return {
        "settings": {
            "config": relative(str(args.config)),
            "overrides": [relative(item) for item in args.overrides],
            "transport": args.transport,
            "swaps_per_arm": args.swaps,
            "period_s": args.period,
            "callers": args.callers,
            "env": {"dist": args.env_dist, "mean_ms": args.env_ms},
            "threads": threads,
            "max_batch": cfg.inference.max_batch,
            "max_wait_ms": cfg.inference.max_wait_ms,
        },
        "sizes": sizes,
    }, raw


def g3_size(
    args: argparse.Namespace,
    cfg: Config,
    vla: VLAConfig,
    observations: list[Observation],
    threads: int,
) -> tuple[list[dict], list[tuple[float, float, int]]]:
    """Both arms on one service, publisher and set of callers: every swap, every request."""
    torch.manual_seed(cfg.run.seed)
    service = ray.remote(num_cpus=0, max_restarts=0)(InferenceService).remote(
        VLAPolicy(vla),
        max_batch=cfg.inference.max_batch,
        max_wait_ms=cfg.inference.max_wait_ms,
        threads=threads,
        sync_timeout_s=cfg.sync.timeout_s,
    )
    trainer = ray.remote(num_cpus=0, max_restarts=0)(TrainerStandIn).remote(vla, cfg.run.seed)
    caller = ray.remote(num_cpus=0, max_restarts=0)(Caller)
    callers = [caller.remote(observations, args.env_dist, args.env_ms) for _ in range(args.callers)]
    try:
        address = ray.get(trainer.open.remote(args.transport))
        ray.get(service.open_sync.remote([address], SERVICE))
        ray.get([trainer.connect.remote(), service.connect_sync.remote()])
        # The first receive and torch's first calls on each batch shape stay out of the slots.
        ray.get(service.update_weights.remote(trainer.publish.remote(0)))
        ray.get(service.act_batch.remote(observations[: cfg.inference.max_batch]))
        ray.get(service.act.remote(observations[0]))
        ray.get([handle.__ray_ready__.remote() for handle in callers])
        slots = [arm for _ in range(args.swaps) for arm in ARMS]
        start_at = time.time() + args.warmup
        end_at = start_at + len(slots) * args.period
        runs = [c.run.remote(service, end_at, seed) for seed, c in enumerate(callers)]
        swaps = []
        for i, arm in enumerate(slots):
            slot_start = start_at + i * args.period
            _sleep_until(slot_start)
            ray.get(service.__ray_call__.remote(_set_early_drain, ARMS[arm]))
            _sleep_until(slot_start + args.period / 2)
            began = time.time()
            ticket = trainer.publish.remote(i + 1)
            version = ray.get(service.update_weights.remote(ticket))
            swaps.append(
                {
                    "arm": arm,
                    "version": version,
                    "slot": [slot_start, slot_start + args.period],
                    "publish_at": began,
                    "served_at": time.time(),
                    "stall_s": ray.get(ticket).stall_s,
                }
            )
        requests = [r for run in ray.get(runs) for r in run]
        receiver = ray.get(service.sync_stats.remote())
        ray.get(service.close.remote())
        ray.get(trainer.close.remote())
    finally:
        for handle in [service, trainer, *callers]:
            ray.kill(handle)
    for swap, receive_s, drain_s in zip(
        swaps, receiver["receive_s"][1:], receiver["drain_s"][1:], strict=True
    ):
        swap["sync_wait_s"] = swap["served_at"] - swap["publish_at"]
        swap["receive_s"], swap["drain_s"] = receive_s, drain_s
    return swaps, requests


def _set_early_drain(service: InferenceService, on: bool) -> None:
    """Flip the arm (run inside the actor through ``__ray_call__``, between swaps)."""
    service.early_drain = on


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.time()))


def summarize(arm: str, swaps: list[dict], requests: list[tuple[float, float, int]]) -> dict:
    """One arm's latency percentiles (all, during a swap, the rest) and sync waits; ``stale``
    counts replies sent after a swap was served that carry an older version (must be 0)."""
    mine = [s for s in swaps if s["arm"] == arm]
    all_ms, during_ms, other_ms, stale = [], [], [], 0
    for sent, took, version in requests:
        swap = next((s for s in mine if s["slot"][0] <= sent < s["slot"][1]), None)
        if swap is None:
            continue
        all_ms.append(took * 1e3)
        overlaps = sent < swap["served_at"] and sent + took > swap["publish_at"]
        (during_ms if overlaps else other_ms).append(took * 1e3)
        stale += sent >= swap["served_at"] and version < swap["version"]
    waits = np.asarray([s["sync_wait_s"] for s in mine]) * 1e3
    return {
        "swaps": len(mine),
        "requests": len(all_ms),
        "requests_during_swap": len(during_ms),
        "latency_ms": _percentiles(all_ms),
        "during_swap_ms": _percentiles(during_ms),
        "outside_swap_ms": _percentiles(other_ms),
        "sync_wait_ms": {"mean": float(waits.mean()), "max": float(waits.max())},
        "receive_ms_mean": 1e3 * float(np.mean([s["receive_s"] for s in mine])),
        "drain_ms_mean": 1e3 * float(np.mean([s["drain_s"] for s in mine])),
        "publish_stall_ms_mean": 1e3 * float(np.mean([s["stall_s"] for s in mine])),
        "stale": int(stale),
    }


def _percentiles(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {"p50": 0.0, "p95": 0.0, "max": 0.0}
    values = np.asarray(ms)
    return {
        "p50": float(np.percentile(values, 50)),
        "p95": float(np.percentile(values, 95)),
        "max": float(values.max()),
    }


def g3_plot(result: dict, raw: list, path: Path) -> Path:
    """Latency of every request against time around its slot's swap, one panel per arm (the
    largest policy), and the percentiles and sync waits of every size."""
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    colors = dict(zip(ARMS, ("tab:green", "tab:red"), strict=True))
    size, requests = result["sizes"][-1], raw[-1]
    for arm, ax in zip(ARMS, axes[:2], strict=True):
        for swap in (s for s in size["swaps"] if s["arm"] == arm):
            xs, ys = [], []
            for sent, took, _ in requests:
                if swap["slot"][0] <= sent < swap["slot"][1]:
                    xs.append(1e3 * (sent - swap["publish_at"]))
                    ys.append(1e3 * took)
            ax.plot(xs, ys, ".", ms=3, color=colors[arm], alpha=0.5)
            ax.axvspan(0, 1e3 * swap["sync_wait_s"], color=colors[arm], alpha=0.05)
        ax.set_yscale("log")
        ax.set_xlim(-400, 600)
        ax.set_xlabel("request sent, ms after publish began (shaded: until served)")
        ax.set_ylabel("round trip (ms)")
        ax.set_title(f"{arm}, {size['megabytes']:.0f} MB: every request of its swaps", fontsize=10)
    bars = axes[2]
    keys = [
        ("p95", lambda a: a["latency_ms"]["p95"]),
        ("p95 in swap", lambda a: a["during_swap_ms"]["p95"]),
        ("sync wait", lambda a: a["sync_wait_ms"]["mean"]),
    ]
    groups = [
        (f"{name}\n{s['megabytes']:.0f} MB", get, s) for s in result["sizes"] for name, get in keys
    ]
    width = 0.8 / len(ARMS)
    for k, arm in enumerate(ARMS):
        values = [get(s["arms"][arm]) for _, get, s in groups]
        bars.bar(np.arange(len(groups)) + k * width, values, width, label=arm, color=colors[arm])
    bars.set_xticks(
        np.arange(len(groups)) + width / 2, [label for label, _, _ in groups], fontsize=7
    )
    bars.set_ylabel("ms")
    bars.legend()
    bars.set_title("act latency, and the trainer's sync wait (mean)", fontsize=10)
    settings = result["settings"]
    fig.suptitle(
        f"G.3 early drain: VLA policy over {settings['transport']}, {settings['callers']} callers, "
        f"{settings['swaps_per_arm']} swaps per arm and size",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def g3_table(result: dict) -> str:
    """A table and footer lines to paste into docs/benchmarks.md."""
    lines = [
        "| weights | arm | requests (in swaps) | p50 / p95 (ms) | p95 in swap (ms) "
        "| p95 outside swaps (ms) | sync wait mean / max (ms) | receive / drain (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios, stale = [], 0
    for size in result["sizes"]:
        for arm, a in size["arms"].items():
            lines.append(
                f"| {size['megabytes']:.0f} MB | {arm} "
                f"| {a['requests']} ({a['requests_during_swap']}) "
                f"| {a['latency_ms']['p50']:.1f} / {a['latency_ms']['p95']:.1f} "
                f"| {a['during_swap_ms']['p95']:.1f} | {a['outside_swap_ms']['p95']:.1f} "
                f"| {a['sync_wait_ms']['mean']:.0f} / {a['sync_wait_ms']['max']:.0f} "
                f"| {a['receive_ms_mean']:.0f} / {a['drain_ms_mean']:.1f} |"
            )
            stale += a["stale"]
        on, off = size["arms"]["early drain"], size["arms"]["lock"]
        ratio = off["during_swap_ms"]["p95"] / max(on["during_swap_ms"]["p95"], 1e-9)
        ratios.append(f"{ratio:.1f}x at {size['megabytes']:.0f} MB")
    settings = result["settings"]
    env = settings["env"]
    first = result["sizes"][0]
    rows = ", ".join(str(s["hash_buckets"]) for s in result["sizes"])
    params = ", ".join(f"{s['parameters'] / 1e6:.0f}M" for s in result["sizes"])
    lines += [
        "",
        f"p95 in a swap falls {', '.join(ratios)} with the early drain. Replies sent after a "
        f"swap was served that carried an older version: {stale}.",
        f"VLA {first['vla']['d_model']}-wide, instruction table of {rows} rows ({params} "
        f"parameters); "
        f"transport {settings['transport']}, {settings['callers']} callers with env step "
        f"{env['dist']} {env['mean_ms']:g} ms, max_batch {settings['max_batch']} / "
        f"{settings['max_wait_ms']:g} ms, {settings['threads']} torch thread(s); arms alternate "
        f"in slots of {settings['period_s']:g} s, {settings['swaps_per_arm']} swaps per arm and "
        f"size. Command: `{result['command']}`; {result['machine']['platform']}, "
        f"{result['machine']['cpu_count']} CPUs (load average "
        f"{result['machine']['load_average_at_start']:.1f} at start), torch "
        f"{result['machine']['torch']}, ray {result['machine']['ray']}, commit "
        f"{result['git'].get('commit', '?')}.",
    ]
    return "\n".join(lines)


# name -> (run: args -> (result, raw data), plot: (result, raw data, path) -> path, table)
ABLATIONS: dict[str, tuple[Callable, Callable, Callable[[dict], str]]] = {
    "g1": (g1, g1_plot, g1_table),
    "g2": (g2, g2_plot, g2_table),
    "g3": (g3, g3_plot, g3_table),
}


def main(argv: list[str] | None = None) -> int:
    """Run one ablation, write its JSON and plot, print its table."""
    args = parse_args(argv)
    run, plot, table = ABLATIONS[args.ablation]
    load_at_start = os.getloadavg()[0]
    result = {
        "benchmark": f"acce_ablations_{args.ablation}",
        "command": shlex.join(["python", *(relative(arg) for arg in sys.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine() | {"load_average_at_start": load_at_start},
        "git": git_state(),
    }
    measured, raw = run(args)
    result |= measured
    save_result(
        args.out, result["benchmark"], result, lambda r, path: plot(r, raw, path), table(result)
    )
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: an ablation and its options; ``overrides`` are ``a.b=value`` items."""
    parser = argparse.ArgumentParser(description="Ablations of AcceRL's systems mechanisms.")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "experiments" / "results",
        help="folder for the JSON and PNG (experiments/results)",
    )
    sub = parser.add_subparsers(dest="ablation", required=True)
    g1_args = sub.add_parser("g1", help="trainer.value_recompute fused against off, under lag")
    g1_args.add_argument(
        "--config", type=Path, default=REPO / "configs" / "babyai.yaml", help="configs/babyai.yaml"
    )
    g1_args.add_argument("--steps", type=int, default=150, help="train steps per run (150)")
    g1_args.add_argument("--staleness", type=int, default=4, help="max_staleness (4)")
    g1_args.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed values (0)")
    g1_args.add_argument(
        "--arms", nargs="+", choices=["fused", "pass", "off"], default=["fused", "off"]
    )
    g1_args.add_argument("--eval-every", type=int, default=25, help="steps between evals (25)")
    g1_args.add_argument("--eval-episodes", type=int, default=32, help="episodes per eval (32)")
    g1_args.add_argument("overrides", nargs="*", default=[], help="a.b=value config overrides")
    g2_args = sub.add_parser("g2", help="GIPO against PPO-clip at forced lags")
    g2_args.add_argument(
        "--config", type=Path, default=REPO / "configs" / "babyai.yaml", help="configs/babyai.yaml"
    )
    g2_args.add_argument("--steps", type=int, default=150, help="train steps per run (150)")
    g2_args.add_argument(
        "--lags", type=int, nargs="+", default=[1, 4, 8], help="inference.min_lag values (1 4 8)"
    )
    g2_args.add_argument(
        "--losses", nargs="+", choices=["gipo", "ppo_clip"], default=["gipo", "ppo_clip"]
    )
    g2_args.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed values (0)")
    g2_args.add_argument("--eval-every", type=int, default=25, help="steps between evals (25)")
    g2_args.add_argument("--eval-episodes", type=int, default=32, help="episodes per eval (32)")
    g2_args.add_argument("overrides", nargs="*", default=[], help="a.b=value config overrides")
    g = sub.add_parser("g3", help="experiment.early_drain: latency while weights swap")
    g.add_argument(
        "--config", type=Path, default=REPO / "configs" / "babyai.yaml", help="configs/babyai.yaml"
    )
    g.add_argument("--transport", choices=sorted(TRANSPORTS), default="dist", help="(dist)")
    g.add_argument("--swaps", type=int, default=6, help="swaps per arm (6)")
    g.add_argument("--period", type=float, default=2.0, help="seconds per slot, one swap each (2)")
    g.add_argument("--callers", type=int, default=8, help="concurrent callers (8)")
    g.add_argument("--env-ms", type=float, default=5.0, help="mean env step between requests (5)")
    g.add_argument("--env-dist", choices=sorted(DELAYS), default="constant", help="(constant)")
    g.add_argument(
        "--hash-buckets",
        type=int,
        nargs="+",
        default=[200_000, 800_000],
        help="rows of the instruction-embedding table, one policy size each: weight bytes at "
        "little compute (200000 800000: ~100 and ~400 MB)",
    )
    g.add_argument("--warmup", type=float, default=1.0, help="seconds before the first slot (1)")
    g.add_argument(
        "--threads", type=int, default=None, help="service torch threads (ray.threads_per_executor)"
    )
    g.add_argument(
        "overrides",
        nargs="*",
        default=["vla.d_model=128"],
        help="a.b=value config overrides (vla.d_model=128)",
    )
    args = parser.parse_args(argv)
    if args.ablation == "g1":
        if min(args.steps, args.staleness, args.eval_every, args.eval_episodes) < 1:
            parser.error("--steps, --staleness, --eval-every and --eval-episodes must be >= 1")
        return args
    if args.ablation == "g2":
        if min(args.steps, args.eval_every, args.eval_episodes, *args.lags) < 1:
            parser.error("--steps, --lags, --eval-every and --eval-episodes must be >= 1")
        return args
    if args.swaps < 1 or args.callers < 1 or args.period <= 0 or min(args.hash_buckets) < 1:
        parser.error("--swaps, --callers, --hash-buckets must be >= 1 and --period > 0")
    return args


if __name__ == "__main__":
    sys.exit(main())
