"""Soak: long asynchronous runs that lose executors and are killed outright, and still finish.

For each workload (LLM: ``configs/arith.yaml``; embodied: ``configs/babyai.yaml``) this runs
``relayrl train`` as a subprocess in a session of its own, for ``--minutes`` of wall-clock time:

- every 60-120 s (``--kill-every``) a random non-trainer actor process (generator or rewarder;
  inference replica or rollout worker), found by Ray's process title, gets SIGKILL;
- at half time (or once the first run checkpoint exists, if later) the whole run (its process
  session) gets SIGKILL, and ``relayrl train --resume`` continues it, with ``steps`` set so that
  it ends a little after the time budget at the rate measured so far (overall, or over the
  last two minutes if that is faster, plus a quarter);
- every 5 s it samples the resident memory (RSS) of every process of the run by role.

It reports, per workload: the actors killed and the failures in the final ``summary.json``
(by role; a failure after the last checkpoint before the whole-run kill is not in the resumed
run's books), samples lost against generated, the books (``accounted``), peak RSS per role and
its trend (a least-squares slope, MB per minute, of each role's largest RSS over the second half
of the run), and the weight-sync shared-memory files left in ``/dev/shm`` at the end. Run
from the repository root::

    python benchmarks/soak.py                       # 15 minutes each, ~31 minutes
    python benchmarks/soak.py --minutes 4 --workloads llm

It writes ``benchmarks/results/soak.json`` and ``soak.png``: the JSON keeps at most 60 evenly
spaced RSS samples per run (the peaks and trends are of all of them), and every sample goes to
``steps/soak.json.gz`` under ``--out`` (not in git). The run directories and their logs go to
``runs/soak/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, coarse, git_state, machine, save_result, write_steps  # noqa: E402

RUNS = {
    "llm": ("configs/arith.yaml", ["generator.replicas=2", "rewarder.replicas=2"]),
    "embodied": ("configs/babyai.yaml", ["inference.replicas=2"]),
}
VICTIMS = {"llm": ("Generator", "Rewarder"), "embodied": ("InferenceService", "RolloutWorker")}
ROLES = (
    "Trainer",
    "VLATrainer",
    "Generator",
    "Rewarder",
    "InferenceService",
    "RolloutWorker",
    "ReplayBuffer",
)
RSS_POINTS = 60  # of each run's RSS samples (one per 5 s) that soak.json keeps


def session_processes(sid: int) -> dict[int, str]:
    """Live processes of session ``sid`` by pid: their role (a Ray actor class, ``driver``,
    or ``ray`` for Ray's own processes)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        role = "ray"
        if cmd.startswith("ray::"):
            role = cmd[5:].split(".")[0].split()[0]
        elif "relayrl.cli" in cmd:
            role = "driver"
        found[int(proc.name)] = role
    return found


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def shm_bytes() -> int:
    """Bytes of relayrl weight-sync files in /dev/shm."""
    return sum(p.stat().st_size for p in Path("/dev/shm").glob("relayrl-sync-*"))


def start(args: list[str], log: Path) -> subprocess.Popen:
    """``relayrl train ARGS`` in a new session, output to ``log``."""
    with log.open("a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "relayrl.cli", "train", *args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def steps_done(run_dir: Path) -> tuple[int, float]:
    """The last logged RL step and its time (0, 0 before any)."""
    path = run_dir / "metrics.jsonl"
    last = (0, 0.0)
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "samples/trained" in record:
                last = (record["step"], record["time"])
    return last


def soak(workload: str, minutes: float, kill_every: tuple[float, float], out: Path) -> dict:
    """One soak run of ``workload``; returns its result."""
    config, overrides = RUNS[workload]
    run_dir = out / f"soak-{workload}"
    log = out / f"soak-{workload}.log"
    log.unlink(missing_ok=True)
    rng = random.Random(0)
    every = max(int(minutes * 3), 5)  # run checkpoints several times per half
    args = [config, "--run-dir", str(run_dir), "--overwrite", "steps=1000000"]
    args += [*overrides, f"run.checkpoint_every={every}", "log.progress=false"]
    begin = time.time()
    deadline, half = begin + minutes * 60, begin + minutes * 30
    proc = start(args, log)
    first_step = None
    samples: list[dict] = []
    kills: list[dict] = []
    progress: list[tuple[float, int]] = []  # (time, last logged step) of the first run
    next_kill = begin + rng.uniform(*kill_every)
    resumed = False
    while proc.poll() is None or not resumed:
        now = time.time()
        processes = session_processes(proc.pid)
        by_role: dict[str, float] = {}
        for pid, role in processes.items():
            by_role[role] = max(by_role.get(role, 0.0), rss_mb(pid))
        samples.append({"t": now - begin, "rss_mb": by_role})
        step, _ = steps_done(run_dir)
        progress.append((now, step))
        if first_step is None and step:
            first_step = (step, now)
        if now >= next_kill and step:
            victims = [pid for pid, role in processes.items() if role in VICTIMS[workload]]
            if victims:
                pid = rng.choice(victims)
                kills.append({"t": now - begin, "role": processes[pid], "pid": pid, "step": step})
                os.kill(pid, signal.SIGKILL)
            next_kill = now + rng.uniform(*kill_every)
        checkpointed = any((run_dir / "checkpoints").glob("step-*"))
        died = proc.poll() is not None
        if not resumed and died and not checkpointed:
            break  # the run failed before its first checkpoint: nothing to resume
        if not resumed and (now >= half or died) and checkpointed:
            with contextlib.suppress(ProcessLookupError):  # it may have failed on its own
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            while session_processes(proc.pid):
                time.sleep(0.5)
            kills.append(
                {"t": time.time() - begin, "role": "whole run", "step": step, "had_died": died}
            )
            # The faster of the whole first run's rate and its last two minutes': the warm start
            # and a stall after a kill both make the first too slow to finish on time.
            (s0, t0) = first_step or (0, begin)
            rate = (step - s0) / max(now - t0, 1.0)
            recent = [(t, s) for t, s in progress if t >= now - 120 and s]
            if recent and now - recent[0][0] >= 60:
                rate = max(rate, (step - recent[0][1]) / (now - recent[0][0]))
            # A quarter more: an overrun by a minute is harmless, a soak short of its budget is
            # not one (the LLM one fell 1.2 minutes short at the bare rate).
            total = step + max(int(1.25 * rate * (deadline - time.time())), 1)
            proc = start(["--resume", str(run_dir), f"steps={total}"], log)
            resumed = True
        if proc.poll() is not None and resumed:
            break
        time.sleep(5.0)
    proc.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "workload": workload,
        "wall_s": time.time() - begin,
        "status": summary["status"],
        "steps": summary["steps"],
        "kills": kills,
        "failures": {role: len(f) for role, f in summary.get("failures", {}).items()},
        "resumes": summary.get("resumes", []),
        "samples": summary.get("samples", {}),
        "rss": samples,
        "rss_peak_mb": _peaks(samples),
        "rss_trend_mb_per_min": _trends(samples),
        "shm_bytes_at_end": shm_bytes(),
    }


def _peaks(samples: list[dict]) -> dict[str, float]:
    peaks: dict[str, float] = {}
    for s in samples:
        for role, mb in s["rss_mb"].items():
            peaks[role] = max(peaks.get(role, 0.0), mb)
    return peaks


def _trends(samples: list[dict]) -> dict[str, float]:
    """Least-squares slope (MB/min) of each role's largest RSS over the second half."""
    late = samples[len(samples) // 2 :]
    out = {}
    for role in {r for s in late for r in s["rss_mb"]}:
        points = [(s["t"] / 60, s["rss_mb"][role]) for s in late if role in s["rss_mb"]]
        if len(points) < 3:
            continue
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        var = sum((x - mx) ** 2 for x, _ in points)
        out[role] = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return out


def plot(result: dict, path: Path) -> Path:
    """RSS by role over time, one panel per workload, kills marked."""
    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        roles = sorted({r for s in run["rss"] for r in s["rss_mb"]})
        for role in roles:
            points = [(s["t"] / 60, s["rss_mb"][role]) for s in run["rss"] if role in s["rss_mb"]]
            ax.plot(*zip(*points, strict=True), label=role)
        for kill in run["kills"]:
            color = "red" if kill["role"] == "whole run" else "grey"
            ax.axvline(kill["t"] / 60, color=color, lw=0.8, ls="--")
        ax.set_title(f"{run['workload']}: largest RSS per role (dashed: kills; red: whole run)")
        ax.set_xlabel("minutes")
        ax.set_ylabel("MB")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def table(result: dict) -> str:
    """Markdown summary of the runs."""
    lines = [
        "| workload | minutes | steps | actors killed | whole-run kills | failures in the final "
        "summary | lost / generated | accounted | peak RSS MB by role | trend MB/min (2nd half) | "
        "/dev/shm at end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        s = run["samples"]
        peaks = ", ".join(f"{r} {mb:.0f}" for r, mb in sorted(run["rss_peak_mb"].items()))
        trend = ", ".join(f"{r} {v:+.1f}" for r, v in sorted(run["rss_trend_mb_per_min"].items()))
        lines.append(
            f"| {run['workload']} | {run['wall_s'] / 60:.1f} | {run['steps']} | "
            f"{sum(k['role'] != 'whole run' for k in run['kills'])} | "
            f"{sum(k['role'] == 'whole run' for k in run['kills'])} | {run['failures']} | "
            f"{s.get('lost', 0)} / {s.get('generated', 0)} | {s.get('accounted')} | {peaks} | "
            f"{trend} | {run['shm_bytes_at_end']} B |"
        )
    return "\n".join(lines)


def main() -> None:
    """Parse arguments, soak each workload, write the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redraw", type=Path, help="only redraw the table and plot of a result")
    parser.add_argument("--minutes", type=float, default=15.0, help="per workload")
    parser.add_argument("--workloads", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--kill-every", type=float, nargs=2, default=(60.0, 120.0))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    if args.redraw is not None:
        result = json.loads(args.redraw.read_text())
        save_result(args.redraw.parent, args.redraw.stem, result, plot, table(result))
        return
    work = REPO / "runs" / "soak"  # run directories and logs (checkpoints): not results
    work.mkdir(parents=True, exist_ok=True)
    runs = [soak(w, args.minutes, tuple(args.kill_every), work) for w in args.workloads]
    result = {
        "command": "python " + shlex.join(["benchmarks/soak.py", *sys.argv[1:]]),
        "machine": machine(),
        "git": git_state(),
        "runs": runs,
    }
    write_steps(args.out, "soak", result)
    summary = result | {"runs": [run | {"rss": coarse(run["rss"], RSS_POINTS)} for run in runs]}
    save_result(args.out, "soak", summary, plot, table(summary))


if __name__ == "__main__":
    main()
