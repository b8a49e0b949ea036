"""Tracing overhead: the cost of one span, times the spans a run records per step, over step time.

Running a whole job with tracing on and off cannot resolve a fraction of a percent on a shared
2-core machine (run-to-run noise is several percent), so this measures the parts instead:

1. the cost of recording one busy span (``with tracer.span(...)``) and one wait
   (``tracer.wait(...)``), timed over many repetitions in this process;
2. from a finished run's ``trace.json`` and ``summary.json``: spans recorded per RL step (busy
   spans of every executor plus the waits the controller recorded) and the RL step time.

overhead = (busy spans/step x span cost + waits/step x wait cost) / step time, plus the one-off
cost of fetching the spans and writing trace.json at the end, reported separately.

    python benchmarks/tracing_overhead.py RUN_DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_state, machine, relative, shrink_png  # noqa: E402

from relayrl.observability.tracing import Tracer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def record_cost_s(record: Callable[[Tracer], None], repeats: int = 200_000) -> float:
    """Seconds one ``record(tracer)`` call takes (best of five rounds)."""
    best = float("inf")
    for _ in range(5):
        tracer = Tracer("bench", max_spans=repeats + 1)
        start = time.perf_counter()
        for _ in range(repeats):
            record(tracer)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def _one_span(tracer: Tracer) -> None:
    with tracer.span("x", 1):
        pass


def _one_wait(tracer: Tracer) -> None:
    tracer.wait("w", 0.0, 1.0)


def run_counts(run_dir: Path) -> dict:
    """Spans and waits per RL step, step time and trace size of a finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    trace = json.loads((run_dir / "trace.json").read_text())
    start, end = trace["otherData"]["rl_window_us"]
    inside = [e for e in trace["traceEvents"] if e["ph"] == "X" and start <= e["ts"] <= end]
    steps = summary["steps"]
    return {
        "mode": summary["mode"],
        "steps": steps,
        "step_time_s": summary["perf"]["step_time_s"],
        "busy_spans_per_step": sum(e["cat"] == "work" for e in inside) / steps,
        "waits_per_step": sum(e["cat"] == "wait" for e in inside) / steps,
        "trace_bytes": (run_dir / "trace.json").stat().st_size,
        "trace_write_s": summary["perf"]["trace_write_s"],
        "rl_wall_clock_s": summary["perf"]["rl_wall_clock_s"],
    }


def main(argv: list[str] | None = None) -> int:
    """Measure, write benchmarks/results/tracing_overhead.{json,png}, print a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="finished run directories")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)

    span_s, wait_s = record_cost_s(_one_span), record_cost_s(_one_wait)
    rows = []
    for run_dir in args.run_dirs:
        counts = run_counts(run_dir)
        per_step = counts["busy_spans_per_step"] * span_s + counts["waits_per_step"] * wait_s
        rows.append(
            counts
            | {
                "overhead_s_per_step": per_step,
                "overhead_fraction": per_step / counts["step_time_s"],
            }
        )
    result = {
        "command": shlex.join(["python", *(relative(a) for a in sys.argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git_state(),
        "span_cost_us": span_s * 1e6,
        "wait_cost_us": wait_s * 1e6,
        "runs": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tracing_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([r["mode"] for r in rows], [100 * r["overhead_fraction"] for r in rows])
    ax.axhline(2.0, color="red", linestyle="--", label="2% budget")
    ax.set_ylabel("tracing overhead, % of step time")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "tracing_overhead.png", dpi=90)
    shrink_png(args.out / "tracing_overhead.png")
    print(f"span {span_s * 1e6:.2f} us, wait {wait_s * 1e6:.2f} us")
    print(
        "| mode | step time (s) | spans/step | waits/step | overhead/step (us) | % of step "
        "| trace fetch+write at the end (s) | % of RL wall-clock |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['step_time_s']:.4f} | {r['busy_spans_per_step']:.1f} | "
            f"{r['waits_per_step']:.1f} | {r['overhead_s_per_step'] * 1e6:.1f} | "
            f"{100 * r['overhead_fraction']:.4f}% | {r['trace_write_s']:.2f} | "
            f"{100 * r['trace_write_s'] / r['rl_wall_clock_s']:.2f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
