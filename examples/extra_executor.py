"""An executor of your own in the pipeline: an auditor that penalises malformed completions.

``FormatAuditor`` is a scoring stage (a ``relayrl.pipeline.StageExecutor``): every batch passes
it after the rewarder. It subtracts ``penalty`` from the reward of each finished completion that
is not a plain number, and counts them; the count is its state, so a resumed run
(``--resume``) carries it on, and the run summary's ``stages`` section reports it beside the
samples the stage scored. It runs on replicas of its own, is traced, and is
replaced like any built-in executor if it dies.

    python examples/extra_executor.py --steps 300 --run-dir runs/audited

Any ``a.b=value`` overrides of configs/arith.yaml may follow.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from relayrl.pipeline import Pipeline, Stage, StageExecutor

REPO = Path(__file__).resolve().parents[1]


class FormatAuditor(StageExecutor):
    """Penalise finished completions that are not a plain number; count them."""

    name = "format_auditor"

    def __init__(self, cfg, penalty: float = 0.5):
        super().__init__(cfg)
        self.penalty = penalty
        self.malformed = 0

    def score(self, batch):
        """The batch with ``penalty`` taken off each malformed finished completion's reward."""
        bad = np.array(
            [
                done and not text.strip().isdigit()
                for text, done in zip(batch.completions, batch.finished, strict=True)
            ],
            dtype=bool,
        )
        self.malformed += int(bad.sum())
        rewards = (batch.rewards - self.penalty * bad).astype(np.float32)
        return self.summary(batch), replace(batch, rewards=rewards)

    def stats(self):
        """The base's counters (samples scored, busy time) and the malformed count."""
        return replace(super().stats(), counts={"malformed": self.malformed})

    def state_dict(self):
        """The base's counters and the malformed count, for a resumed run."""
        return super().state_dict() | {"malformed": self.malformed}

    def load_state_dict(self, state):
        """Restore the counts."""
        super().load_state_dict(state)
        self.malformed = state["malformed"]


def main(argv: list[str] | None = None) -> int:
    """Train the arithmetic job with the auditor in the pipeline; print what it counted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="RL steps (300)")
    parser.add_argument("--penalty", type=float, default=0.5, help="reward taken off (0.5)")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/extra-executor"))
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides")
    args = parser.parse_args(argv)
    auditor = Stage("format_auditor", FormatAuditor, kwargs={"penalty": args.penalty})
    pipeline = Pipeline(
        REPO / "configs" / "arith.yaml", [f"steps={args.steps}", *args.overrides], stages=[auditor]
    )
    summary = pipeline.train(args.run_dir)
    audited = summary["stages"]["format_auditor"]
    print(json.dumps({"eval": summary["eval"], "samples": summary["samples"]}, indent=1))
    print(f"format_auditor: {audited['malformed']} of {audited['scored']} samples malformed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
