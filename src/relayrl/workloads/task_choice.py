"""The task choice of an embodied run: how each new training episode's task is drawn, from
DWR's weights (``relayrl.algorithms.dwr``) masked by the curriculum's open stages
(``relayrl.algorithms.curriculum``). The workload feeds it finished episodes and pushes its
weights into the rollout workers' task samplers; a checkpoint keeps its state."""

from __future__ import annotations

from relayrl.algorithms.curriculum import Curriculum
from relayrl.algorithms.dwr import DynamicWeightedResampler
from relayrl.config import Config


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

    def summary(self) -> dict:
        """The curriculum's section of summary.json."""
        c = self.curriculum
        if c is None:
            return {"enabled": False}
        return {
            "enabled": True,
            "stages": list(c.stages),
            "stage": c.current,
            "opened_at_step": dict(zip(c.stages, c.opened_at, strict=False)),
            "stage_success_rate": c.success_rate(),
        }
