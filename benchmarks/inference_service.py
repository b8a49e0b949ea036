"""The inference service alone: dynamic batching, latency and throughput against concurrent callers.

The real ``InferenceService`` runs as a Ray async actor with the real ``VLAPolicy`` at the size
``configs/babyai.yaml`` describes (``vla`` section, views and action space of the BabyAI env). N
caller actors, separate processes like rollout workers, each loop: send one BabyAI observation
(recorded from the real env under random actions) with a blocking ``act`` call, then sleep for a
simulated env step (``--env-ms``, drawn from the latency wrapper's distributions; 0 by default,
so each caller asks again at once and the service sees its full load). For each
(``max_batch``, ``max_wait_ms``) setting and each number of callers it measures, over a fixed
window after a warm-up:

- throughput: requests answered per second (callers' count of round trips inside the window);
- per-request latency as a caller sees it (the Ray round trip: queue, forward, transport), mean,
  p50 and p95, and the service's own latency (queue wait plus forward) and queue wait;
- the batch-size distribution of the forward passes and their mean, the forward time per batch;
- the service's busy fraction (its forward spans inside the window) and CPU use (its process CPU
  seconds per second), and the whole machine's CPU use (``/proc/stat``), to see where the CPU
  saturates.

Each service first answers one full batch and one request, so torch's first calls stay out of the
windows.

Run from the repository root::

    python benchmarks/inference_service.py                      # 4 settings x 1..32 callers
    python benchmarks/inference_service.py --settings 16/5 --callers 1 4 --duration 2
    python benchmarks/inference_service.py --env-ms 20 --env-dist lognormal   # straggling envs

It writes ``benchmarks/results/inference_service.json`` and ``.png`` (with the command line and
the machine) and prints a Markdown table for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # benchmark machines have no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_state, machine, relative, save_result  # noqa: E402

from relayrl.config import Config, load_config  # noqa: E402
from relayrl.envs.embodied import Observation  # noqa: E402
from relayrl.envs.latency import DELAYS  # noqa: E402
from relayrl.executors.inference_service import InferenceService  # noqa: E402
from relayrl.executors.worker_side import build_env
from relayrl.launch import start_ray  # noqa: E402
from relayrl.models.vla import VLAPolicy, vla_config  # noqa: E402
from relayrl.observability.tracing import busy_seconds  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NAME = "inference_service"
RECORDED_OBSERVATIONS = 64  # cycled through by every caller


class Caller:
    """A stand-in rollout worker: ask the service for an action, 'step' for a drawn time, repeat."""

    def __init__(self, observations: list[Observation], env_dist: str, env_ms: float, sigma: float):
        self.observations = observations
        self.env_dist, self.env_ms, self.sigma = env_dist, env_ms, sigma

    def run(self, service, start_at: float, end_at: float, seed: int) -> list[float]:
        """Loop until ``end_at`` (wall clock); returns the round-trip seconds of the requests sent
        at or after ``start_at`` and answered by ``end_at``."""
        rng = np.random.default_rng(seed)
        latencies, i = [], int(rng.integers(len(self.observations)))
        while (sent_at := time.time()) < end_at:
            start = time.perf_counter()
            ray.get(service.act.remote(self.observations[i % len(self.observations)]))
            took = time.perf_counter() - start
            if sent_at >= start_at and time.time() <= end_at:
                latencies.append(took)
            i += 1
            if self.env_ms > 0:
                time.sleep(DELAYS[self.env_dist](rng, self.env_ms, self.sigma) / 1000.0)
        return latencies


def main(argv: list[str] | None = None) -> int:
    """Measure every (setting, callers) point, write the JSON and the plot, print the table."""
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    observations = record_observations(cfg)
    views, dims, vocab = policy_shape(cfg)
    vla = vla_config(cfg.vla, image_size=cfg.env.image_size, views=views, dims=dims, vocab=vocab)
    threads = args.threads or cfg.ray.threads_per_executor
    start_ray(cfg)
    points = []
    try:
        caller = ray.remote(num_cpus=0, max_restarts=0)(Caller)
        callers = [
            caller.remote(observations, args.env_dist, args.env_ms, args.env_sigma)
            for _ in range(max(args.callers))
        ]
        # Process start-up must not eat into the first point's warm-up.
        ray.get([handle.__ray_ready__.remote() for handle in callers])
        for max_batch, max_wait_ms in args.settings:
            torch.manual_seed(cfg.run.seed)  # the same weights for every setting
            service = ray.remote(num_cpus=0, max_restarts=0)(InferenceService).remote(
                VLAPolicy(vla), max_batch=max_batch, max_wait_ms=max_wait_ms, threads=threads
            )
            try:
                # Torch's first calls on each batch shape are slow: keep them out of the windows.
                ray.get(service.act_batch.remote(observations[:max_batch]))
                ray.get(service.act.remote(observations[0]))
                for n in args.callers:
                    print(
                        f"[{NAME}] max_batch={max_batch} max_wait_ms={max_wait_ms:g}: {n} callers",
                        file=sys.stderr,
                    )
                    point = measure(service, callers[:n], args.warmup, args.duration)
                    points.append({"max_batch": max_batch, "max_wait_ms": max_wait_ms, **point})
            finally:
                ray.get(service.close.remote())
                ray.kill(service)
        for handle in callers:
            ray.kill(handle)
    finally:
        ray.shutdown()
    params = sum(p.numel() for p in VLAPolicy(vla).parameters())
    result = {
        "benchmark": NAME,
        "command": shlex.join(["python", *(relative(arg) for arg in sys.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine() | {"load_average_at_start": args.load_at_start},
        "git": git_state(),
        "settings": {
            "config": relative(str(args.config)),
            "settings": [{"max_batch": b, "max_wait_ms": w} for b, w in args.settings],
            "callers": args.callers,
            "env": {"dist": args.env_dist, "mean_ms": args.env_ms, "sigma": args.env_sigma},
            "warmup_s": args.warmup,
            "duration_s": args.duration,
            "threads": threads,
            "overrides": [relative(item) for item in args.overrides],
        },
        "policy": {
            "parameters": params,
            "vla": cfg.vla.model_dump(mode="json"),
            "image_shape": list(observations[0].image.shape),
        },
        "points": points,
        "saturation": saturation(points, args.settings),
    }
    save_result(args.out, NAME, result, plot, markdown_table(result))
    return 0


def parse_setting(text: str) -> tuple[int, float]:
    """``MAX_BATCH/MAX_WAIT_MS`` -> (max_batch, max_wait_ms)."""
    try:
        batch, wait = text.split("/")
        setting = int(batch), float(wait)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"setting {text!r} must look like MAX_BATCH/MAX_WAIT_MS, e.g. 16/5"
        ) from None
    if setting[0] < 1 or setting[1] < 0:
        raise argparse.ArgumentTypeError(
            f"setting {text!r}: max_batch must be >= 1 and max_wait_ms >= 0"
        )
    return setting


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items for the config (model size)."""
    parser = argparse.ArgumentParser(
        description="The inference service alone: batch sizes, latency and throughput against "
        "the number of concurrent callers, for several batching settings.",
    )
    parser.add_argument(
        "--config", type=Path, default=REPO / "configs" / "babyai.yaml", help="configs/babyai.yaml"
    )
    parser.add_argument(
        "--settings",
        type=parse_setting,
        nargs="+",
        default=[(1, 0.0), (8, 2.0), (16, 5.0), (32, 5.0)],
        help="MAX_BATCH/MAX_WAIT_MS pairs (1/0 8/2 16/5 32/5)",
    )
    parser.add_argument(
        "--callers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="caller counts"
    )
    parser.add_argument(
        "--env-ms", type=float, default=0.0, help="mean simulated env step between requests (0)"
    )
    parser.add_argument(
        "--env-dist", choices=sorted(DELAYS), default="constant", help="its distribution"
    )
    parser.add_argument("--env-sigma", type=float, default=1.0, help="lognormal: sigma of the log")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each window")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per point")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the service (default: ray.threads_per_executor of the config)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks" / "results",
        help="folder for the JSON and PNG (benchmarks/results)",
    )
    parser.add_argument("overrides", nargs="*", help="a.b=value config overrides")
    args = parser.parse_args(argv)
    if min(args.callers) < 1:
        parser.error(f"--callers must all be >= 1, got {args.callers}")
    if args.env_ms < 0:
        parser.error(f"--env-ms must be >= 0, got {args.env_ms}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.duration <= 0:
        parser.error(f"--duration must be > 0, got {args.duration}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    args.callers = sorted(set(args.callers))
    args.load_at_start = os.getloadavg()[0]
    return args


def policy_shape(cfg: Config) -> tuple[int, int, int]:
    """(views, action dims, action vocab) of the config's env."""
    env = build_env(cfg.env.model_copy(update={"latency": "none"}), cfg.run.seed)
    try:
        views = env.reset().image.shape[0]
        return views, env.action_space.dims, env.action_space.vocab
    finally:
        env.close()


def record_observations(cfg: Config) -> list[Observation]:
    """Observations of the config's env under uniformly random actions, episodes back to back."""
    env = build_env(cfg.env.model_copy(update={"latency": "none"}), cfg.run.seed)
    rng = np.random.default_rng(cfg.run.seed)
    try:
        observations = [env.reset(seed=cfg.run.seed)]
        while len(observations) < RECORDED_OBSERVATIONS:
            space = env.action_space
            tokens = rng.integers(space.vocab, size=space.dims)
            result = env.step(space.to_env(tokens))
            done = result.terminated or result.truncated
            observations.append(env.reset(seed=int(rng.integers(2**31))) if done else result.obs)
        return observations
    finally:
        env.close()


def measure(service, callers: list, warmup: float, duration: float) -> dict:
    """Run ``callers`` against ``service`` for ``warmup + duration`` seconds; the numbers of the
    last ``duration`` seconds."""
    # Callers start on a shared wall-clock schedule, so they all load the service in the window.
    start_at = time.time() + 0.2 + warmup
    end_at = start_at + duration
    runs = [c.run.remote(service, start_at, end_at, seed) for seed, c in enumerate(callers)]
    time.sleep(max(0.0, start_at - time.time()))
    ray.get(service.reset_stats.remote())
    reset_at, cpu_before = time.time(), machine_cpu()
    service_cpu_before = ray.get(service.__ray_call__.remote(_process_cpu_s))
    latencies = np.concatenate([np.asarray(r, dtype=np.float64) for r in ray.get(runs)]) * 1e3
    stats = ray.get(service.stats.remote())
    service_cpu = ray.get(service.__ray_call__.remote(_process_cpu_s)) - service_cpu_before
    stats_window = time.time() - reset_at
    forward_spans = [s for s in ray.get(service.trace.remote())[0] if s.name == "forward"]
    cpu_after = machine_cpu()
    forwards = stats.forwards
    return {
        "callers": len(callers),
        "requests": int(latencies.size),
        "requests_per_s": latencies.size / duration,
        "latency_ms": _summary(latencies),
        "service": {
            "latency_ms_mean": stats.latency_ms_mean,
            "latency_ms_p50": stats.latency_ms_p50,
            "latency_ms_p95": stats.latency_ms_p95,
            "queue_ms_mean": stats.queue_ms_mean,
            "forwards": forwards,
            "forward_ms_mean": 1e3 * stats.busy_s / forwards if forwards else 0.0,
            "busy": busy_seconds(forward_spans, start_at, end_at) / duration,
            "cpu": service_cpu / stats_window,
        },
        "batch_sizes": {str(size): count for size, count in stats.batch_sizes.items()},
        "mean_batch": stats.mean_batch,
        "batch_p50": batch_percentile(stats.batch_sizes, 50),
        "batch_max": max(stats.batch_sizes, default=0),
        "machine_cpu": cpu_fraction(cpu_before, cpu_after),
    }


def batch_percentile(hist: dict[int, int], q: float) -> int:
    """The ``q``-th percentile (0-100) of the forward passes' batch sizes, from their histogram."""
    sizes = sorted(hist)
    if not sizes:
        return 0
    counts = np.cumsum([hist[size] for size in sizes])
    return sizes[int(np.searchsorted(counts, q / 100.0 * counts[-1]))]


def _process_cpu_s(_service: InferenceService) -> float:
    """CPU seconds of the service's process (run inside the actor through ``__ray_call__``)."""
    return time.process_time()


def _summary(ms: np.ndarray) -> dict[str, float]:
    if not ms.size:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0}
    return {
        "mean": float(ms.mean()),
        "p50": float(np.percentile(ms, 50)),
        "p95": float(np.percentile(ms, 95)),
    }


def machine_cpu() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores from /proc/stat; None where there is none."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Fraction of all cores busy between two ``machine_cpu`` readings."""
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def saturation(points: list[dict], settings: list[tuple[int, float]]) -> list[dict]:
    """Per setting: the best throughput and the fewest callers that reach 90% of it."""
    out = []
    for max_batch, max_wait_ms in settings:
        mine = [p for p in points if (p["max_batch"], p["max_wait_ms"]) == (max_batch, max_wait_ms)]
        best = max(p["requests_per_s"] for p in mine)
        knee = min(p["callers"] for p in mine if p["requests_per_s"] >= 0.9 * best)
        out.append(
            {
                "max_batch": max_batch,
                "max_wait_ms": max_wait_ms,
                "max_requests_per_s": best,
                "callers_at_90pct": knee,
            }
        )
    return out


def _label(point: dict) -> str:
    return f"max_batch {point['max_batch']}, wait {point['max_wait_ms']:g} ms"


def plot(result: dict, path: Path) -> Path:
    """Throughput, latency, mean batch and CPU use against callers, one line per setting."""
    points = result["points"]
    settings = [(s["max_batch"], s["max_wait_ms"]) for s in result["settings"]["settings"]]
    callers = result["settings"]["callers"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    (thr, lat), (batch, cpu) = axes
    for (max_batch, max_wait_ms), color in zip(settings, plt.cm.tab10.colors, strict=False):
        mine = [p for p in points if (p["max_batch"], p["max_wait_ms"]) == (max_batch, max_wait_ms)]
        xs = [p["callers"] for p in mine]
        label = _label(mine[0])
        thr.plot(xs, [p["requests_per_s"] for p in mine], "o-", color=color, label=label)
        lat.plot(xs, [p["latency_ms"]["p50"] for p in mine], "o-", color=color, label=label)
        lat.plot(xs, [p["latency_ms"]["p95"] for p in mine], "^:", color=color)
        batch.plot(xs, [p["mean_batch"] for p in mine], "o-", color=color, label=label)
        cpu.plot(xs, [p["service"]["cpu"] for p in mine], "o-", color=color, label=label)
        if all(p["machine_cpu"] is not None for p in mine):
            cpu.plot(xs, [p["machine_cpu"] for p in mine], "^:", color=color)
    titles = {
        thr: ("requests per second", "throughput"),
        lat: ("caller round trip (ms)", "latency: p50 (solid), p95 (dotted)"),
        batch: ("requests per forward pass", "mean batch size"),
        cpu: ("fraction", "CPU: service process (solid), whole machine (dotted)"),
    }
    for ax, (ylabel, title) in titles.items():
        ax.set_xscale("log", base=2)
        ax.set_xticks(callers, [str(n) for n in callers])
        ax.set_xlabel("concurrent callers")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
    lat.set_yscale("log")
    env = result["settings"]["env"]
    fig.suptitle(
        f"relayrl inference service, VLA {result['policy']['parameters'] / 1e6:.2f}M params, "
        f"env step {env['dist']} {env['mean_ms']:g} ms between requests",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown_table(result: dict) -> str:
    """A table and footer lines to paste into docs/benchmarks.md."""
    lines = [
        "| max_batch / max_wait | callers | requests/s | batch mean / p50 / max "
        "| round trip mean / p50 / p95 "
        "(ms) | service queue (ms) | forward (ms) | service busy / CPU | machine CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        lat, service = p["latency_ms"], p["service"]
        machine_cpu = "n/a" if p["machine_cpu"] is None else f"{p['machine_cpu']:.2f}"
        lines.append(
            f"| {p['max_batch']} / {p['max_wait_ms']:g} ms | {p['callers']} "
            f"| {p['requests_per_s']:.0f} "
            f"| {p['mean_batch']:.1f} / {p['batch_p50']} / {p['batch_max']} "
            f"| {lat['mean']:.1f} / {lat['p50']:.1f} / {lat['p95']:.1f} "
            f"| {service['queue_ms_mean']:.1f} | {service['forward_ms_mean']:.1f} "
            f"| {service['busy']:.2f} / {service['cpu']:.2f} | {machine_cpu} |"
        )
    knees = "; ".join(
        f"{s['max_batch']} / {s['max_wait_ms']:g} ms: {s['max_requests_per_s']:.0f} req/s, "
        f"90% of it from {s['callers_at_90pct']} callers"
        for s in result["saturation"]
    )
    env = result["settings"]["env"]
    lines += [
        "",
        f"Best throughput per setting: {knees}.",
        f"VLA {result['policy']['parameters'] / 1e6:.2f}M parameters, images "
        f"{result['policy']['image_shape']}, {result['settings']['threads']} torch thread(s); env "
        f"step between requests {env['dist']} {env['mean_ms']:g} ms; "
        f"{result['settings']['duration_s']:g} s per point after "
        f"{result['settings']['warmup_s']:g} s warm-up. Command: `{result['command']}`; "
        f"{result['machine']['platform']}, {result['machine']['cpu_count']} CPUs, torch "
        f"{result['machine']['torch']}, ray {result['machine']['ray']}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
