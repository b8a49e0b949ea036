"""The controller's checkpointer: when a run writes a checkpoint, what goes in it, and how a
resumed run reads it back.

Every ``run.checkpoint_every`` steps, and once on the first Ctrl-C, the ``Checkpointer`` has the
trainer ranks write their own parts, takes every other executor's state and the controller's
books, and commits them as one checkpoint (its files, manifest and atomic rename are
``relayrl.checkpoint_format``). A resume loads the newest checkpoint that passes its manifest and
records itself in ``RUN_DIR/resumes.jsonl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relayrl import faults
from relayrl.checkpoint_format import commit, latest, load_part, part_names, save_part, staging

RESUMES = "resumes.jsonl"  # in the run directory: one line per resume


def resumes(run_dir: Path) -> list[dict]:
    """Every resume of the run in ``run_dir``, oldest first."""
    path = run_dir / RESUMES
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Checkpointer:
    """When a run checkpoints, and what its checkpoint holds.

    The loops call ``maybe`` (or ``due``, ``write`` and ``after``, when they must pause something
    around the write) between two train steps. A checkpoint is due every ``run.checkpoint_every``
    steps, and once after ``request_stop`` (the first Ctrl-C), after which ``after`` raises
    ``KeyboardInterrupt``. ``context`` is the controller's own part: the summary sections of the
    start, and whatever else ``train`` needs to continue.
    """

    _stop_requested = False  # process-wide: set from a signal handler
    _looping = False

    def __init__(self, cfg: Any, run_dir: Path, workload: Any, tally: Any, log: Any):
        self.cfg = cfg
        self.run_dir = run_dir
        self.workload = workload
        self.tally = tally
        self.log = log
        self.context: dict = {}
        self.spans: dict = {}  # executors' spans of earlier sessions of this run
        self.rl_start = time.time()
        self.written: list[Path] = []

    @classmethod
    def request_stop(cls) -> bool:
        """Ask the running loop to checkpoint at the end of the step in progress and stop
        (``after`` raises). False when no loop runs or a stop was already asked for."""
        if not cls._looping or cls._stop_requested:
            return False
        cls._stop_requested = True
        return True

    @classmethod
    def clear_stop(cls) -> None:
        """Forget a stop request (a new run starts)."""
        cls._stop_requested = False

    def due(self) -> bool:
        """Whether a checkpoint is due now, between two steps."""
        steps, every = self.tally.steps, self.cfg.run.checkpoint_every
        periodic = every > 0 and steps % every == 0 and steps < self.cfg.steps
        return periodic or self._stop_requested

    async def maybe(self, in_flight: int = 0) -> None:
        """Write a checkpoint if one is due; ``in_flight``: samples generated but neither trained
        nor dropped now (a resume counts them as ``samples.dropped_resume``)."""
        if self.due():
            await self.write(in_flight)
        self.after()

    def after(self) -> None:
        """Raise ``KeyboardInterrupt`` if a stop was requested (its checkpoint is written)."""
        if self._stop_requested:
            raise KeyboardInterrupt

    async def write(self, in_flight: int = 0, imagined_in_flight: int | None = None) -> Path | None:
        """Write the checkpoint of the current step: trainer ranks write their own parts, every
        other executor's state and the controller's come through here. An executor that dies
        meanwhile skips this checkpoint (None): the next one is due ``checkpoint_every`` later.
        ``imagined_in_flight``: as ``in_flight``, for imagined env steps (world model).

        The workload's ``settle`` runs before its (side-effect free) ``snapshot``, and its
        ``realign`` with the parts written after the commit, so that the run goes on as a resume
        from this checkpoint would."""
        from relayrl.observability.metrics import say
        from relayrl.observability.tracing import collect_spans
        from relayrl.recovery import DEATHS, first_line

        step, w = self.tally.steps, self.workload
        # The books first, before any await: async loops go on counting while executors save.
        controller = self.context | {
            "tally": self.tally.state_dict(),
            "in_flight": in_flight,
            "imagined_in_flight": imagined_in_flight,
            "metrics_bytes": self.log.path.stat().st_size,
            "rl_wall_s": self.context.get("rl_wall_s", 0.0) + time.time() - self.rl_start,
        }
        staged = staging(self.run_dir, step)
        ranks = [rank.save_checkpoint.remote(str(staged)) for rank in w.trainer]
        try:
            await w.settle()
            parts = await w.snapshot()
            spans = collect_spans(w.placed.traced(), self.tally.idle)
            entries = await asyncio.gather(*ranks)
        except DEATHS as err:  # the loop replaces the executor, or stops if it was a rank
            await asyncio.gather(*ranks, return_exceptions=True)  # before their files go
            shutil.rmtree(staged, ignore_errors=True)
            say(f"checkpoint step-{step:08d} skipped: {first_line(err)}")
            return None
        controller["spans"] = merge_spans(self.spans, spans)
        entries += [save_part(staged, name, state) for name, state in parts.items()]
        entries.append(save_part(staged, "controller", controller))
        faults.reach("checkpoint")
        path = commit(staged, step, entries, self.cfg.run.keep_checkpoints)
        self.written.append(path)
        say(f"checkpoint {path.name} written")
        try:
            await w.realign(parts)
        except DEATHS as err:  # the loop replaces the dead executor when it next calls it
            say(f"after checkpoint {path.name}: {first_line(err)}")
        return path

    @classmethod
    @contextlib.contextmanager
    def looping(cls) -> Iterator[None]:
        """While the RL loop runs, a stop request checkpoints first (see ``request_stop``)."""
        cls._looping = True
        try:
            yield
        finally:
            cls._looping = False

    def resume(self) -> dict:
        """Load the newest valid checkpoint of the run directory into this checkpointer and the
        tally, cut the metrics back to its step, and return the executors' parts."""
        from relayrl.observability.metrics import say

        path = latest(self.run_dir, warn=say)
        parts = self.load(path)
        self.written.append(path)
        # What was in flight when the checkpoint was written never reaches this run's trainer.
        dropped = self.context.pop("in_flight")
        self.tally.dropped_resume += dropped
        record = {
            "step": self.tally.steps,
            "checkpoint": path.name,
            "dropped_resume": dropped,
            "time": time.time(),
        }
        if (imagined := self.context.pop("imagined_in_flight", None)) is not None:
            self.tally.imagined_dropped_resume += imagined
            record["imagined_dropped_resume"] = imagined
        # Every resume, also one whose run died before its next checkpoint (and so is not in the
        # books of the checkpoint the next resume takes).
        with (self.run_dir / RESUMES).open("a") as f:
            f.write(json.dumps(record) + "\n")
        with (self.run_dir / "metrics.jsonl").open("r+b") as f:  # later steps are run again
            f.truncate(self.context.pop("metrics_bytes"))
        say(f"resuming {self.run_dir} from {path.name} (step {self.tally.steps})")
        return parts

    def restore(self, parts: dict) -> None:
        """Load the checkpoint ``resume`` found into freshly placed executors, and serve its
        weights to the receivers."""
        import ray

        from relayrl.launch import publish_weights

        w, path = self.workload, self.written[-1]
        ray.get([rank.load_checkpoint.remote(str(path)) for rank in w.trainer])
        w.restore(parts)
        ray.get(publish_weights(w.trainer, w.placed.receivers()))

    def load(self, path: Path) -> dict:
        """The executors' parts of the checkpoint at ``path`` (the controller's and the trainer
        ranks' left out), by executor name; sets ``context`` and ``spans`` from the controller's."""
        controller = load_part(path, "controller")
        self.spans = controller.pop("spans")
        self.tally.load_state_dict(controller.pop("tally"))
        self.context = controller
        return {
            name: load_part(path, name)
            for name in part_names(path)
            if name != "controller" and not name.startswith("trainer_")
        }


def merge_spans(earlier: dict, later: dict) -> dict:
    """Each executor's (busy, waits) spans of an earlier session followed by a later one's."""
    names = earlier.keys() | later.keys()
    empty: tuple[list, list] = ([], [])
    return {
        n: tuple(a + b for a, b in zip(earlier.get(n, empty), later.get(n, empty), strict=True))
        for n in names
    }
