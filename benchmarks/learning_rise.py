"""The rise in held-out accuracy that tests/test_learning.py asserts, measured over seeds.

One warm start (seed 0, built as the test builds it), then the test's RL run once per seed; writes
``results/learning_rise.json`` with each seed's accuracy before and after, the rises and their
minimum, from which the test's threshold is set.

    python benchmarks/learning_rise.py [--seeds 0 1 2 3 4]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from common import git_state, machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_learning import RL_STEPS, WARM_STEPS, rl_accuracy, warm_checkpoint  # noqa: E402


def main() -> None:
    """Run the seeds and write the result file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        started = time.time()
        checkpoint = warm_checkpoint(Path(tmp) / "warm")
        warm_s = time.time() - started
        for seed in args.seeds:
            started = time.time()
            start, end = rl_accuracy(checkpoint, Path(tmp) / f"run-{seed}", seed)
            runs.append(
                {"seed": seed, "start": start, "end": end, "rise": end - start}
                | {"wall_s": round(time.time() - started, 1)}
            )
            print(json.dumps(runs[-1]), flush=True)
    result = {
        "command": shlex.join(["python", *sys.argv]),
        "machine": machine(),
        "git": git_state(),
        "warm_steps": WARM_STEPS,
        "rl_steps": RL_STEPS,
        "warm_start_s": round(warm_s, 1),
        "runs": runs,
        "min_rise": min(r["rise"] for r in runs),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learning_rise.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
