"""Run metrics: JSONL (always), TensorBoard (optional), a progress bar, and run-level tallies.

Metric names are stable namespaces: ``loss/*``, ``rollout/*``, ``perf/*``, ``staleness/*``,
``samples/*``, ``eval/*``, ``sync/*``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from relayrl.observability.books import Books
from relayrl.observability.tracing import Tracer
from relayrl.types import StepResult


def say(message: str) -> None:
    """One start-up phase on stderr, so that a run is never silent for minutes."""
    print(f"relayrl: {message}", file=sys.stderr, flush=True)


class MetricsLog:
    """Appends one JSON line per logged step to ``metrics.jsonl``; mirrors it to TensorBoard and,
    when a project is given, to Weights & Biases."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool,
        wandb_project: str | None = None,
        wandb_mode: str = "offline",
        config: dict | None = None,
    ):
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._writer = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if wandb_project is not None:
            import wandb

            self._wandb = wandb.init(
                project=wandb_project,
                name=run_dir.name,
                dir=str(run_dir),
                mode=wandb_mode,
                config=config,
                settings=wandb.Settings(console="off", silent=True),
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write the scalar metrics of ``step``."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        self._file.write(json.dumps({"step": step, "time": time.time(), **scalars}) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close the files."""
        self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()


class Tracers(dict):
    """Tracers by executor name, each made on first use."""

    def __missing__(self, name: str) -> Tracer:
        self[name] = Tracer(name)
        return self[name]


TALLIED = (
    "steps",
    "updates",
    "skipped_nonfinite",
    "generated",
    "trained",
    "dropped_stale",
    "dropped_resume",
    "lost",
    "failures",
    "score_errors",
    "score_timeouts",
    "lag_hist",
    "trained_tokens",
    "dropped_tokens",
    "gen_s",
    "score_s",
    "train_s",
    "ratio_sum",
    "ratio_steps",
    "imagined_trained",
    "imagined_dropped_resume",
)  # what a checkpoint keeps of a RunTally


class EssWatch:
    """Warns when the importance weights' effective sample size (``loss/ess``) stays under
    ``below`` for ``steps`` train steps in a row: the batch's update rests on a few samples, the
    sign that off-policy training is about to go wrong. One warning per such stretch."""

    def __init__(self, below: float, steps: int):
        self.below = below
        self.steps = steps
        self.streak = 0
        self.warnings = 0

    def see(self, step: int, metrics: dict[str, float]) -> str | None:
        """Take a step's metrics; the warning to give now, if any."""
        ess = metrics.get("loss/ess")
        if ess is None or self.below <= 0:
            return None
        self.streak = self.streak + 1 if ess < self.below else 0
        if self.streak != self.steps:
            return None
        self.warnings += 1
        return (
            f"warning: step {step}: the effective sample size of the importance weights "
            f"(loss/ess) has stayed under {self.below} for {self.steps} steps (now {ess:.3f}); "
            "the samples are far off-policy: lower max_staleness or use a correcting loss "
            "(trainer.loss), see docs/architecture.md"
        )


@dataclass(frozen=True)
class Failure:
    """One executor that died (or, a weight-sync receiver, missed ``sync.timeout_s``) and was
    replaced, and what died with it; summary.json's ``failures`` lists these by role."""

    role: str
    name: str
    time: float  # unix seconds when it was found dead
    step: int  # train steps taken by then
    reason: str  # the first line of the error
    lost: int = 0  # samples counted as generated that died with it
    unfinished: int | None = 0  # work in progress it held, never counted (None: unknown)

    def joined(self, lost: int, unfinished: int | None) -> Failure:
        """This death as another loop saw it too: what that loop ``lost`` and held added (an
        ``unfinished`` unknown in either makes the whole unknown)."""
        held = None if None in (self.unfinished, unfinished) else self.unfinished + unfinished
        return dataclasses.replace(self, lost=self.lost + lost, unfinished=held)


class RunTally:
    """Run-level counts the controller keeps while the loop runs: samples, lags, step times."""

    def __init__(self, steps: int, progress: bool, ess_watch: EssWatch | None = None):
        self.ess = ess_watch or EssWatch(0.0, 1)
        self.steps = 0  # batches the trainer consumed
        self.updates = 0  # optimizer steps (a batch with no learning signal takes none)
        self.skipped_nonfinite = 0  # optimizer steps skipped for a nan or inf loss or grad norm
        self.generated = 0
        self.trained = 0
        self.dropped_stale = 0
        self.imagined_trained = 0  # embodied with imagination: imagined env steps trained
        self.dropped_resume = 0  # in flight at a checkpoint a resume continued from
        self.imagined_dropped_resume = 0  # the same for imagined env steps
        self.lost = 0  # counted as generated, then died with an executor
        self.failures: list[Failure] = []  # executors that died and were replaced, oldest first
        self.score_errors = 0
        self.score_timeouts = 0
        self.lag_hist: Counter[int] = Counter()
        self.trained_tokens = 0  # LLM: completion tokens of the trained samples
        self.dropped_tokens = 0  # LLM: completion tokens of the samples dropped stale
        self.gen_s: list[float] = []
        self.score_s: list[float] = []
        self.train_s: list[float] = []
        # Sum and count of the optimizer steps' loss/ratio_mean (the token mean of pi/mu): how
        # far generation's mu is from the trained policy, through staleness and precision.
        self.ratio_sum = 0.0
        self.ratio_steps = 0
        self.idle = Tracers()  # waits the controller sees, by executor name
        self._recent: dict[str, float] = {}
        self._total = steps
        self._progress = progress
        self._start = time.perf_counter()
        self._bar: tqdm | None = None

    def start(self) -> None:
        """The RL phase begins: start the clock and the progress bar."""
        self._start = time.perf_counter()
        self._bar = tqdm(
            total=self._total,
            initial=self.steps,
            desc="rl",
            unit="step",
            disable=not self._progress,
            dynamic_ncols=True,
        )

    def state_dict(self) -> dict:
        """The counts and per-step times, for a run checkpoint (the failures as plain dicts)."""
        state = {k: copy.deepcopy(getattr(self, k)) for k in TALLIED}
        return state | {"failures": [dataclasses.asdict(f) for f in self.failures]}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved (a count an older checkpoint lacks stays 0)."""
        for key in TALLIED:
            if key in state:
                setattr(self, key, copy.deepcopy(state[key]))
        self.failures = [Failure(**f) for f in state.get("failures", [])]

    def on_failure(self, failure: Failure) -> int:
        """An executor died: record ``failure`` and count the samples lost with it; returns its
        index in ``failures``."""
        self.failures.append(failure)
        self.lost += failure.lost
        return len(self.failures) - 1

    def on_failure_seen_again(self, index: int, lost: int, unfinished: int | None) -> None:
        """Another loop saw death ``index`` (of ``failures``) too: what it ``lost`` and held
        join that record."""
        self.failures[index] = self.failures[index].joined(lost, unfinished)
        self.lost += lost

    def books(self, in_flight: Mapping[str, int] | None = None, **beside: Any) -> Books:
        """The books of the samples the controller counts (an LLM run's), with the samples
        ``in_flight`` by place (None: unknown) and the counts ``beside`` them."""
        return Books(
            unit="samples",
            generated=self.generated,
            trained=self.trained,
            dropped={"stale": self.dropped_stale, "resume": self.dropped_resume},
            lost=self.lost,
            in_flight=in_flight,
            beside=beside,
        )

    def failure_summary(self) -> dict[str, list[dict]]:
        """summary.json's ``failures``: each role's deaths, oldest first, as plain dicts."""
        by_role: dict[str, list[dict]] = {}
        for failure in self.failures:
            by_role.setdefault(failure.role, []).append(dataclasses.asdict(failure))
        return by_role

    def on_generated(self, samples: int, busy_s: float) -> None:
        """A generate call finished with ``samples`` completed samples."""
        self.generated += samples
        self.gen_s.append(busy_s)

    def on_scored(self, busy_s: float, errors: int, timeouts: int) -> None:
        """A score call finished; ``errors`` and ``timeouts`` samples of it scored 0."""
        self.score_s.append(busy_s)
        self.score_errors += errors
        self.score_timeouts += timeouts

    def on_trained(self, result: StepResult) -> dict[str, float]:
        """A train step finished; returns the metrics to log for it."""
        self.trained += result.trained
        self.dropped_stale += result.dropped_stale
        self.trained_tokens += result.trained_tokens
        self.dropped_tokens += result.dropped_tokens
        self.skipped_nonfinite += result.skipped_nonfinite
        self.train_s.append(result.train_s)
        for lag, count in enumerate(result.lags):
            if count:
                self.lag_hist[lag] += count
        self.steps += 1
        self.updates += int(result.stepped)
        self._bar.update(1)
        elapsed = time.perf_counter() - self._start
        out = dict(result.metrics)
        if "loss/ratio_mean" in out:
            self.ratio_sum += out["loss/ratio_mean"]
            self.ratio_steps += 1
        if warning := self.ess.see(self.steps, out):
            say(warning)
        out |= {
            "samples/received": float(result.received),
            "samples/trained": float(result.trained),
            "samples/dropped_stale": float(result.dropped_stale),
            "perf/train_s": result.train_s,
            "perf/samples_per_s": self.trained / max(elapsed, 1e-9),
            "perf/step_time_s": elapsed / max(self.steps, 1),
            "samples/generated_total": float(self.generated),
            "samples/trained_total": float(self.trained),
            "samples/dropped_stale_total": float(self.dropped_stale),
            "reward/errors": float(self.score_errors),
            "reward/timeouts": float(self.score_timeouts),
            # The run total: only every log.every-th step is logged, so a per-step count of a
            # rare skip would mostly go unseen.
            "loss/skipped_nonfinite": float(self.skipped_nonfinite),
        }
        if result.imagined_received:
            self.imagined_trained += result.imagined_trained
            out["samples/imagined_trained"] = float(result.imagined_trained)
            out["samples/imagined_trained_total"] = float(self.imagined_trained)
        if "rollout/accuracy" in out:
            self._recent = {
                "reward": out["rollout/reward_mean"],
                "acc": out["rollout/accuracy"],
                "lag": out["staleness/mean"],
                "smp/s": out["perf/samples_per_s"],
            }
            self._bar.set_postfix({k: f"{v:.2f}" for k, v in self._recent.items()}, refresh=False)
        return out

    def staleness(self) -> dict:
        """Mean, max and histogram of trained samples' lag (trainer version - sample version),
        and ``ratio_mean``: the mean over optimizer steps of each step's token mean of pi/mu
        (``loss/ratio_mean``; None before the first), which stale or lower-precision
        generation moves away from 1."""
        total = sum(self.lag_hist.values())
        mean = sum(lag * n for lag, n in self.lag_hist.items()) / total if total else 0.0
        return {
            "mean": mean,
            "max": max(self.lag_hist, default=0),
            "hist": {str(lag): self.lag_hist[lag] for lag in sorted(self.lag_hist)},
            "ess_warnings": self.ess.warnings,
            "ratio_mean": self.ratio_sum / self.ratio_steps if self.ratio_steps else None,
        }

    def lengths(self) -> dict:
        """Mean completion length of the samples trained and of those dropped stale over the
        run (LLM); the dropped mean is None when nothing was dropped."""
        return {
            "trained_len_mean": self.trained_tokens / self.trained if self.trained else 0.0,
            "dropped_len_mean": (
                self.dropped_tokens / self.dropped_stale if self.dropped_stale else None
            ),
        }

    def close(self) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
