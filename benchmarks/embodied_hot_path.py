"""Embodied hot path: the async pipeline with each env step a Ray call
(``experiment.inference_transport=ray``) against the Unix-socket path (``socket``), beside the
single-process reference, on one machine.

Arms take turns (reference, ray, socket, then again for each repeat) so that load from other
processes falls on each alike; ``--transports`` picks the transport arms (both by default), and
each ``--batched W E`` adds an arm ``socket_WxE``: the socket path with W workers of E envs each
(``rollout.envs_per_worker``). Each pipeline arm trains
``configs/babyai.yaml`` for ``--steps`` trainer steps (too few to learn; the rate is the point)
and reports

- ``env_steps_per_s`` (trained, over the RL window) and ``steady_env_steps_per_s`` (between the
  first and the last trainer step);
- ``perf.busy``: trainer, inference service and rollout workers (in their env);
- CPU seconds per 1,000 trained env steps of every process the run started, by role (sampled
  from ``/proc`` every half second; Ray's own processes are ``ray``), over the whole run;
- the machine's 1-minute load average at the start and end of each arm.

Ray starts its workers at nice 15 unless told otherwise, and the reference runs at nice 0: on a
machine shared with other nice-0 work the pipeline would then get less CPU than the reference for
reasons that have nothing to do with it. ``--ray-niceness`` (0 by default) sets Ray's
``RAY_worker_niceness`` before the first run starts Ray.

The reference arm runs ``benchmarks/babyai_reference.py`` (same policy, same curriculum, one
process, one thread) for ``--reference-minutes`` and reports its env steps per second.

    python benchmarks/embodied_hot_path.py                  # 2 repeats, 20 steps each
    python benchmarks/embodied_hot_path.py --repeats 1 --steps 10

It writes ``benchmarks/results/embodied_hot_path.json`` and ``.png`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from statistics import mean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import ray  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import provenance, relative, save_result  # noqa: E402
from embodied_throughput import steady_rate  # noqa: E402

from relayrl.config import load_config  # noqa: E402
from relayrl.job import train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NAME = "embodied_hot_path"
TRANSPORTS = ("ray", "socket")
WORKER_NICENESS = "RAY_worker_niceness"  # Ray's own spelling
STAGES = ["BabyAI-GoToLocalS5N2-v0", "BabyAI-GoToLocalS6N3-v0", "BabyAI-GoToLocalS7N4-v0"]
ROLES = {  # process title prefix (as /proc/PID/stat shows it, 15 characters) -> role
    "ray::RolloutWor": "rollout_workers",
    "ray::InferenceS": "inference_service",
    "ray::VLATrainer": "trainer",
    "ray::ReplayBuff": "replay_buffer",
}


def main(argv: list[str] | None = None) -> int:
    """Run the arms in turn, write the JSON and the plot, print the table."""
    args = parse_args(argv)
    os.environ[WORKER_NICENESS] = str(args.ray_niceness)
    runs = []
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-") as tmp:
        try:
            for repeat in range(args.repeats):
                if args.reference_minutes > 0:
                    runs.append(run_reference(args, repeat, Path(tmp)))
                for arm, overrides in arms(args).items():
                    say(f"repeat {repeat + 1}/{args.repeats}: {arm}")
                    runs.append(run_pipeline(args, arm, overrides, repeat, Path(tmp)))
        finally:
            ray.shutdown()
    result = {
        "benchmark": NAME,
        **provenance(),
        "settings": {
            "config": relative(str(args.config)),
            "steps": args.steps,
            "repeats": args.repeats,
            "reference_minutes": args.reference_minutes,
            "ray_worker_niceness": args.ray_niceness,
            "overrides": args.overrides,
            "arms": arms(args),
        },
        "arms": summarise(runs),
        "runs": runs,
    }
    save_result(args.out, NAME, result, plot, markdown_table(result))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``overrides`` are ``a.b=value`` items applied to both pipeline arms."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "babyai.yaml")
    parser.add_argument("--steps", type=int, default=20, help="trainer steps per pipeline run")
    parser.add_argument("--repeats", type=int, default=2, help="turns of every arm")
    parser.add_argument(
        "--reference-minutes", type=float, default=1.5, help="reference arm length (0: none)"
    )
    parser.add_argument(
        "--ray-niceness", type=int, default=0, help="nice of Ray's workers (Ray's default: 15)"
    )
    parser.add_argument(
        "--transports",
        nargs="*",
        choices=TRANSPORTS,
        default=list(TRANSPORTS),
        help="an arm per transport, the config's layout otherwise (default: ray socket)",
    )
    parser.add_argument(
        "--batched",
        type=int,
        nargs=2,
        action="append",
        metavar=("W", "E"),
        help="add an arm (repeatable): the socket path with W workers of E envs each",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("overrides", nargs="*", help="a.b=value items for the pipeline arms")
    return parser.parse_args(argv)


def arms(args: argparse.Namespace) -> dict[str, list[str]]:
    """The pipeline arms: name -> the overrides that make it."""
    out = {t: [f"experiment.inference_transport={t}"] for t in args.transports}
    for workers, envs in args.batched or []:
        out[f"socket_{workers}x{envs}"] = [
            "experiment.inference_transport=socket",
            f"rollout.workers={workers}",
            f"rollout.envs_per_worker={envs}",
        ]
    return out


def say(text: str) -> None:
    """Progress on stderr."""
    print(f"[{NAME}] {text}", file=sys.stderr, flush=True)


def run_pipeline(
    args: argparse.Namespace, arm: str, overrides: list[str], repeat: int, tmp: Path
) -> dict:
    """Train one pipeline run and keep the numbers this benchmark reports."""
    cfg = load_config(
        args.config,
        [
            "env.eval_episodes=4",  # evaluation is outside the RL window; keep it short
            "env.eval_workers=1",
            *args.overrides,
            f"steps={args.steps}",
            *overrides,
            "log.every=1",  # the steady rate reads every step's row of metrics.jsonl
            "log.eval_every=0",
            "log.progress=false",
            "log.tensorboard=false",
            f"run.out_dir={tmp}",
        ],
    )
    load = os.getloadavg()[0]
    with CpuSampler() as cpu, contextlib.redirect_stdout(sys.stderr):
        summary = train(cfg, tmp / f"{arm}-{repeat}")
    perf, trained = summary["perf"], summary["samples"]["trained"]
    return {
        "arm": arm,
        "repeat": repeat,
        "env_steps_per_s": summary["rollout"]["env_steps_per_s"],
        "steady_env_steps_per_s": steady_rate(Path(summary["artifacts"]["metrics"])),
        "busy": perf["busy"],
        "inference": perf["inference"],
        "cpu_s_per_1k_steps": {role: 1000 * s / trained for role, s in cpu.by_role().items()},
        "staleness": {k: summary["staleness"][k] for k in ("mean", "max")},
        "accounted": summary["samples"]["accounted"],
        "trained": trained,
        "rl_wall_clock_s": perf["rl_wall_clock_s"],
        "load_1min": [load, os.getloadavg()[0]],
    }


def run_reference(args: argparse.Namespace, repeat: int, tmp: Path) -> dict:
    """The single-process reference for ``--reference-minutes``."""
    say(f"repeat {repeat + 1}/{args.repeats}: reference")
    load = os.getloadavg()[0]
    command = [sys.executable, str(REPO / "benchmarks" / "babyai_reference.py"), "--stages"]
    command += [*STAGES, "--summary-only", "--minutes", str(args.reference_minutes)]
    command += ["--name", "reference", "--out", str(tmp)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    found = json.loads((tmp / "reference.json").read_text())
    return {
        "arm": "reference",
        "repeat": repeat,
        "env_steps_per_s": found["env_steps_per_s"],
        "env_steps": found["env_steps"],
        "load_1min": [load, os.getloadavg()[0]],
    }


class CpuSampler:
    """CPU seconds (user + system) of this process's descendants, by role, sampled from /proc
    while the block runs; a process's last sample counts (actors exit at the run's end)."""

    def __init__(self, period_s: float = 0.5):
        self.period_s = period_s
        self.last: dict[int, tuple[str, float]] = {}
        self.base: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CpuSampler:
        tick = os.sysconf("SC_CLK_TCK")
        for pid in [os.getpid(), *_descendants(os.getpid())]:  # what ran before is not counted
            found = _cpu(pid, tick)
            if found is not None:
                self.base[pid] = found[1]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def by_role(self) -> dict[str, float]:
        """CPU seconds by role; ``ray`` is Ray's own processes, ``driver`` this one."""
        out: dict[str, float] = {}
        for pid, (title, seconds) in self.last.items():
            role = next((r for p, r in ROLES.items() if title.startswith(p)), "ray")
            role = "driver" if pid == os.getpid() else role
            out[role] = out.get(role, 0.0) + seconds - self.base.get(pid, 0.0)
        return out

    def _loop(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(self.period_s):
            for pid in [os.getpid(), *_descendants(os.getpid())]:
                found = _cpu(pid, tick)
                if found is not None:
                    self.last[pid] = found


def _cpu(pid: int, tick: int) -> tuple[str, float] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    title = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    return title, (int(fields[11]) + int(fields[12])) / tick


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def summarise(runs: list[dict]) -> dict:
    """Means per arm, and the socket arm's ratios to the ray arm and to the reference."""
    arms: dict[str, dict] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        arms[arm] = {"env_steps_per_s": mean(r["env_steps_per_s"] for r in mine)}
        if arm != "reference":
            arms[arm]["steady_env_steps_per_s"] = mean(r["steady_env_steps_per_s"] for r in mine)
            arms[arm]["busy"] = {
                k: mean(r["busy"][k] for r in mine) for k in ("trainer", "inference_service")
            }
            roles = {k for r in mine for k in r["cpu_s_per_1k_steps"]}
            arms[arm]["cpu_s_per_1k_steps"] = {
                k: mean(r["cpu_s_per_1k_steps"].get(k, 0.0) for r in mine) for k in sorted(roles)
            }
    ratios = {}
    pipeline = [arm for arm in arms if arm != "reference"]
    for arm in pipeline:
        if "reference" in arms:
            ratios[f"{arm}_over_reference"] = (
                arms[arm]["steady_env_steps_per_s"] / arms["reference"]["env_steps_per_s"]
            )
        if arm != "ray" and "ray" in arms:
            for key in ("env_steps_per_s", "steady_env_steps_per_s"):
                ratios[f"{arm}_over_ray_{key}"] = arms[arm][key] / arms["ray"][key]
    arms["ratios"] = ratios
    return arms


def plot(result: dict, path: Path) -> Path:
    """Env steps/s per arm and run, and CPU seconds per 1,000 env steps by role."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    arms = [a for a in result["arms"] if a != "ratios"]
    for x, arm in enumerate(arms):
        rates = [
            r.get("steady_env_steps_per_s", r["env_steps_per_s"])
            for r in result["runs"]
            if r["arm"] == arm
        ]
        left.bar(x, mean(rates), color="0.8")
        left.scatter([x] * len(rates), rates, color="k", zorder=3, s=12)
    left.set_xticks(range(len(arms)), arms)
    left.set_ylabel("env steps / s (pipeline: steady)")
    pipeline = [a for a in arms if a != "reference"]
    roles = sorted({k for a in pipeline for k in result["arms"][a]["cpu_s_per_1k_steps"]})
    bottom = [0.0] * len(pipeline)
    for role in roles:
        heights = [result["arms"][a]["cpu_s_per_1k_steps"].get(role, 0.0) for a in pipeline]
        right.bar(pipeline, heights, bottom=bottom, label=role)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    right.set_ylabel("CPU seconds per 1,000 trained env steps")
    right.legend(fontsize=7)
    fig.suptitle(result["command"], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown_table(result: dict) -> str:
    """Rates, busy fractions and CPU per role, one row per arm; then the ratios."""
    arms = result["arms"]
    lines = [
        "| arm | env steps/s (window / steady) | trainer busy | inference busy | "
        "CPU s per 1k steps: workers / inference / trainer / buffer / ray / driver |",
        "|---|---|---|---|---|",
    ]
    for arm, a in arms.items():
        if arm == "ratios":
            continue
        if arm == "reference":
            lines.append(f"| reference (1 process) | {a['env_steps_per_s']:.0f} | - | - | - |")
            continue
        cpu = a["cpu_s_per_1k_steps"]
        roles = ("rollout_workers", "inference_service", "trainer", "replay_buffer", "ray")
        shown = " / ".join(f"{cpu.get(k, 0.0):.2f}" for k in (*roles, "driver"))
        lines.append(
            f"| {arm} | {a['env_steps_per_s']:.0f} / "
            f"{a['steady_env_steps_per_s']:.0f} | {a['busy']['trainer']:.2f} | "
            f"{a['busy']['inference_service']:.2f} | {shown} |"
        )
    lines.append("")
    lines += [f"- {k}: {v:.2f}" for k, v in arms["ratios"].items()]
    loads = [x for r in result["runs"] for x in r["load_1min"]]
    lines.append(f"- 1-minute load average during the arms: {min(loads):.1f} to {max(loads):.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
