"""The task choice of an embodied run: how each new training episode's task is drawn, from
DWR's weights (``relayrl.algorithms.dwr``) masked by the curriculum's open stages
(``relayrl.algorithms.curriculum``). The workload feeds it finished episodes and pushes its
weights into the rollout workers' task samplers (``feedback``); a checkpoint keeps its state."""

from __future__ import annotations

import asyncio
from typing import Any

from relayrl.algorithms.curriculum import Curriculum
from relayrl.algorithms.dwr import DynamicWeightedResampler
from relayrl.config import Config
from relayrl.executors.worker_side import set_task_weights
from relayrl.recovery import DEATHS


class TaskChoice:
    """How each new training episode's task is drawn: DWR's weights (uniform when DWR is off),
    with the stages the curriculum has not opened yet masked out."""

    def __init__(self, cfg: Config, tasks: tuple[str, ...]):
        r = cfg.rollout
        self.use_dwr = r.dwr
        self.dwr = DynamicWeightedResampler(
            tasks,
            window=r.dwr_window,
            alpha=r.dwr_alpha,
            formula=r.dwr_formula,
            seed=cfg.run.seed,
        )
        self.curriculum = (
            Curriculum(
                tasks,
                promote_at=r.curriculum_promote_at,
                window=r.curriculum_window,
                max_steps_per_stage=r.curriculum_max_steps,
                review=r.curriculum_review,
            )
            if r.curriculum
            else None
        )

    def state_dict(self) -> dict:
        """DWR's and the curriculum's state."""
        c = self.curriculum
        return {"dwr": self.dwr.state_dict(), "curriculum": c.state_dict() if c else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        self.dwr.load_state_dict(state["dwr"])
        if self.curriculum is not None:
            self.curriculum.load_state_dict(state["curriculum"])

    def record(self, task: str, success: bool) -> None:
        """One finished training episode."""
        self.dwr.record(task, success)
        if self.curriculum is not None:
            self.curriculum.record(task, success)

    def weights(self) -> list[float]:
        """The task weights the workers draw with, in the env's task order."""
        base = self.dwr.weights() if self.use_dwr else dict.fromkeys(self.dwr.tasks, 1.0)
        if self.curriculum is not None:
            return self.curriculum.apply(base)
        total = sum(base.values())
        return [w / total for w in base.values()]

    def push(self, workers: Any) -> list:
        """Set the task weights of every one of ``workers``' samplers (refs to the calls)."""
        weights = self.weights()
        return [w.__ray_call__.remote(set_task_weights, weights) for w in workers]

    async def feedback(self, workers: Any, step: int) -> dict[str, float]:
        """Drain ``workers``' finished episodes into DWR and the curriculum before trainer step
        ``step``, push the new task weights to their samplers, and return the rollout success
        rate of those episodes and the newest stage's success over its window (the curriculum's
        promotion measure)."""
        drained = await asyncio.gather(
            *(w.episode_results.remote() for w in workers), return_exceptions=True
        )
        for found in drained:  # a worker that died is replaced by the loop
            if isinstance(found, BaseException) and not isinstance(found, DEATHS):
                raise found
        results = [r for rs in drained if not isinstance(rs, BaseException) for r in rs]
        for r in results:
            self.record(r.task, r.success)
        opened = self.curriculum.advance(step) if self.curriculum is not None else None
        if opened is not None or (self.use_dwr and results):
            self.push(workers)  # the next reset draws with them; nothing waits for it
        out = {"rollout/episodes": float(len(results))}
        if results:
            out["rollout/success_rate"] = sum(r.success for r in results) / len(results)
        if (c := self.curriculum) is not None:
            out["curriculum/stage"] = float(c.stage)
            out["curriculum/stage_episodes"] = float(len(c.outcomes))
            if c.outcomes:
                out["curriculum/stage_success"] = c.success_rate()
        return out

    def summary(self) -> dict:
        """The dwr and curriculum sections of summary.json."""
        c = self.curriculum
        dwr = {"enabled": self.use_dwr, "weights": self.dwr.weights()}
        if c is None:
            return {"dwr": dwr, "curriculum": {"enabled": False}}
        return {
            "dwr": dwr,
            "curriculum": {
                "enabled": True,
                "stages": list(c.stages),
                "stage": c.current,
                "opened_at_step": dict(zip(c.stages, c.opened_at, strict=False)),
                "stage_success_rate": c.success_rate(),
            },
        }
