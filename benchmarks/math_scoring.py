"""Math answer scoring throughput: pairs per second through ScoringPool with 1 and 2 workers.

The pairs come from MATH-500 and GSM8K (the copies shipped with relayrl): every worked solution
against its own answer and against the answers of other rows (fresh random permutations), cycled
to ``--pairs`` items. Own-answer pairs repeat once the pairs outnumber the rows, so the parse cache
in each worker is hit as in RL, where a group of samples shares one reference. Each setting gets a
fresh pool; the start-up time is reported apart from the scoring time. For reference it also
scores in the calling process with no sandbox.

Run from the repository root::

    python benchmarks/math_scoring.py                 # 10,000 pairs
    python benchmarks/math_scoring.py --pairs 2000    # quick check

It writes ``benchmarks/results/math_scoring.json`` and ``.png`` (with the command line and the
machine) and prints a Markdown table for ``docs/math_rewards.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from relayrl.data.datasets import benchmark_file, read_rows
from relayrl.rewards.math import SCORER
from relayrl.rewards.math import _score_unbounded as score  # in-process: no sandbox
from relayrl.rewards.sandbox import ScoringPool

matplotlib.use("Agg")  # benchmark machines have no display

NAME = "math_scoring"
REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    """Build the pairs, time each setting, write the JSON and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=10_000)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)

    pairs = build_pairs(args.pairs, random.Random(args.seed))
    load_before = os.getloadavg()
    cpu_probe = parallel_speedup()
    runs = [run_in_process(pairs)]
    runs += [run_pool(pairs, workers, args.timeout_s) for workers in (1, 2)]
    result = {
        "benchmark": NAME,
        "command": shlex.join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "two_process_speedup_probe": cpu_probe,
        },
        "note": "the machine was shared with other CPU jobs: treat the numbers as noisy",
        "settings": {"pairs": len(pairs), "timeout_s": args.timeout_s, "seed": args.seed},
        "mean_score": runs[0]["mean_score"],
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{NAME}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    png_path = plot(result, args.out / f"{NAME}.png")
    print(markdown_table(result))
    print(f"\nwrote {json_path} and {png_path}", file=sys.stderr)
    return 0


def _burn(iterations: int) -> float:
    """Seconds to run a pure-Python loop: a probe of the CPU time this process gets."""
    start = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i * i
    return time.perf_counter() - start


def parallel_speedup(iterations: int = 5_000_000) -> float:
    """How much faster two busy processes get the same work done than one (2.0: two free cores).

    Other jobs on a shared machine take cores; this says how many were left for the pool.
    """
    with concurrent.futures.ProcessPoolExecutor(max_workers=2) as executor:
        alone = min(executor.submit(_burn, iterations).result() for _ in range(2))
        together = max(executor.map(_burn, [iterations] * 2))
    return round(2 * alone / together, 2)


def build_pairs(count: int, rng: random.Random) -> list[tuple[str, str]]:
    """Solutions against their own answer, then against other rows' answers, cycled to count."""
    math500 = [row for _, row in read_rows(benchmark_file("math500_test"))]
    gsm8k = [row for _, row in read_rows(benchmark_file("gsm8k_test"))]
    rows = [(row["solution"], row["answer"]) for row in math500]
    rows += [(row["answer"], row["answer"].rsplit("####", 1)[1].strip()) for row in gsm8k]
    pairs = list(rows)
    while len(pairs) < count:
        others = [answer for _, answer in rows]
        rng.shuffle(others)
        pairs += [(response, other) for (response, _), other in zip(rows, others, strict=True)]
    pairs = pairs[:count]
    rng.shuffle(pairs)
    return pairs


def run_in_process(pairs: list[tuple[str, str]]) -> dict:
    """Score in this process with no sandbox: the cost of the scorer alone."""
    start = time.perf_counter()
    scores = [score(response, reference) for response, reference in pairs]
    seconds = time.perf_counter() - start
    return {
        "setting": "in-process",
        "workers": 0,
        "start_s": 0.0,
        "score_s": round(seconds, 3),
        "pairs_per_s": round(len(pairs) / seconds, 1),
        "mean_score": round(sum(scores) / len(scores), 4),
        "counters": None,
    }


def run_pool(pairs: list[tuple[str, str]], workers: int, timeout_s: float) -> dict:
    """Score through a fresh ScoringPool with the given number of worker processes."""
    start = time.perf_counter()
    with ScoringPool(SCORER, workers=workers, timeout_s=timeout_s) as pool:
        started = time.perf_counter()
        scores = pool.score_batch(pairs)
        seconds = time.perf_counter() - started
        counters = pool.counters
    return {
        "setting": f"{workers} worker" + ("s" if workers > 1 else ""),
        "workers": workers,
        "start_s": round(started - start, 3),
        "score_s": round(seconds, 3),
        "pairs_per_s": round(len(pairs) / seconds, 1),
        "mean_score": round(sum(scores) / len(scores), 4),
        "counters": counters,
    }


def plot(result: dict, path: Path) -> Path:
    """A bar per setting: scored pairs per second."""
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([r["setting"] for r in runs], [r["pairs_per_s"] for r in runs], color="#4c72b0")
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("pairs / s")
    ax.margins(y=0.15)
    machine = result["machine"]
    ax.set_title(
        f"Math scoring, {result['settings']['pairs']:,} pairs, {machine['cpu_count']} shared CPUs "
        f"(two busy processes ran {machine['two_process_speedup_probe']}x as fast as one)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown_table(result: dict) -> str:
    """The runs as a Markdown table, with the command and machine under it."""
    lines = [
        "| setting | pairs/s | scoring s | start s | timeouts | errors |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        counters = r["counters"] or {"timeouts": "-", "errors": "-"}
        lines.append(
            f"| {r['setting']} | {r['pairs_per_s']:.0f} | {r['score_s']:.1f} | {r['start_s']:.2f} "
            f"| {counters['timeouts']} | {counters['errors']} |"
        )
    machine = result["machine"]
    lines.append(
        f"\nCommand: `{result['command']}`; {result['date']}; {machine['platform']}, "
        f"{machine['cpu_count']} CPUs, load average {machine['load_average_before'][0]} before; "
        f"two busy processes ran {machine['two_process_speedup_probe']}x as fast as one."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
