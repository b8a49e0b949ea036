"""A rule reward of your own: partial credit for each right digit of the answer.

The arithmetic job's built-in rule (``exact_answer``) gives 1 for the exact sum and 0 otherwise.
This one gives the fraction of the reference's digits that the completion has right, position by
position, so a near miss earns something. It runs in the rewarder's process; one that raises
scores 0 and is counted in the run's ``score_errors``, like the built-in scorers.

    python examples/custom_rule.py --steps 300 --run-dir runs/partial-credit

Any ``a.b=value`` overrides of configs/arith.yaml may follow.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from relayrl.pipeline import Pipeline

REPO = Path(__file__).resolve().parents[1]


def partial_credit(completion: str, reference: str) -> float:
    """The fraction of ``reference``'s characters that ``completion`` has at the same place; a
    completion of another length earns at most half."""
    completion = completion.strip()
    right = sum(a == b for a, b in zip(completion, reference, strict=False)) / len(reference)
    return right if len(completion) == len(reference) else right / 2


def main(argv: list[str] | None = None) -> int:
    """Train the arithmetic job on the partial-credit reward; print the summary's accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="RL steps (300)")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/custom-rule"))
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides")
    args = parser.parse_args(argv)
    pipeline = Pipeline(
        REPO / "configs" / "arith.yaml",
        [f"steps={args.steps}", *args.overrides],
        rule=partial_credit,
    )
    summary = pipeline.train(args.run_dir)
    print(json.dumps({"eval": summary["eval"], "samples": summary["samples"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
