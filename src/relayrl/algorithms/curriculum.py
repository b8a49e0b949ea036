"""A task curriculum: the env's tasks are stages, opened one after another as they are solved."""

from collections import deque
from collections.abc import Mapping, Sequence


class Curriculum:
    """Ordered stages; the next one opens when the newest open stage is solved or over budget.

    Training starts with the first stage open. After each trainer step the controller records the
    episodes that finished and calls ``advance``: the next stage opens when the newest open stage
    has at least ``promote_at`` success over its last ``window`` episodes (a full window), or when
    it has been the newest for ``max_steps_per_stage`` trainer steps (0: no budget). The budget
    keeps a run that cannot solve a stage, such as an instruction-blind control, moving through the
    same stages, so both see every task. Earlier stages stay open at ``review`` times the newest
    stage's weight (so a solved stage is revisited and not forgotten); ``mask`` is what the task
    weights (DWR's, or uniform) are multiplied by.
    """

    def __init__(
        self,
        stages: Sequence[str],
        *,
        promote_at: float = 0.8,
        window: int = 200,
        max_steps_per_stage: int = 0,
        review: float = 0.1,
    ) -> None:
        stages = list(stages)
        if not stages:
            raise ValueError("stages must name at least one task, got an empty sequence")
        if len(set(stages)) != len(stages):
            raise ValueError(f"stages must be unique, got {stages}")
        if not 0.0 < promote_at <= 1.0:
            raise ValueError(f"promote_at must be in (0, 1], got promote_at={promote_at}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got window={window}")
        if not 0.0 <= review <= 1.0:
            raise ValueError(f"review must be in [0, 1], got review={review}")
        if max_steps_per_stage < 0:
            raise ValueError(f"max_steps_per_stage must be >= 0, got {max_steps_per_stage}")
        self.stages = stages
        self.promote_at = promote_at
        self.window = window
        self.max_steps_per_stage = max_steps_per_stage
        self.review = review
        self.opened_at: list[int] = [0]  # trainer step at which each open stage opened
        self._outcomes: deque[bool] = deque(maxlen=window)

    @property
    def stage(self) -> int:
        """Index of the newest open stage."""
        return len(self.opened_at) - 1

    @property
    def current(self) -> str:
        """The newest open stage."""
        return self.stages[self.stage]

    def record(self, task: str, success: bool) -> None:
        """Add one finished episode; only the newest open stage's episodes decide promotion."""
        if task not in self.stages:
            raise ValueError(f"unknown task {task!r}; stages: {self.stages}")
        if task == self.current:
            self._outcomes.append(success)

    @property
    def outcomes(self) -> tuple[bool, ...]:
        """The newest open stage's recent outcomes, oldest first (at most ``window``)."""
        return tuple(self._outcomes)

    def success_rate(self) -> float | None:
        """The newest open stage's success over its recent window (None before any episode)."""
        if not self._outcomes:
            return None
        return sum(self._outcomes) / len(self._outcomes)

    def advance(self, step: int) -> str | None:
        """Open the next stage if the newest is solved or over budget at trainer ``step``;
        returns the stage opened, or None."""
        if self.stage + 1 >= len(self.stages):
            return None
        solved = len(self._outcomes) == self.window and self.success_rate() >= self.promote_at
        budget = self.max_steps_per_stage
        if not solved and not (budget and step - self.opened_at[-1] >= budget):
            return None
        self.opened_at.append(step)
        self._outcomes.clear()
        return self.current

    def mask(self) -> dict[str, float]:
        """1.0 for the newest open stage, ``review`` for earlier ones, 0.0 for those not yet
        open, in stage order."""
        return {
            task: 1.0 if i == self.stage else self.review if i < self.stage else 0.0
            for i, task in enumerate(self.stages)
        }

    def apply(self, weights: Mapping[str, float]) -> list[float]:
        """Task weights (in stage order) with the unopened stages zeroed, renormalised."""
        mask = self.mask()
        masked = [weights[task] * mask[task] for task in self.stages]
        total = sum(masked)
        if total <= 0:
            raise ValueError(f"every open stage has weight 0: {dict(weights)}")
        return [w / total for w in masked]

    def state_dict(self) -> dict[str, object]:
        """The open stages and the newest one's recent outcomes (picklable)."""
        return {
            "stages": list(self.stages),
            "opened_at": list(self.opened_at),
            "outcomes": list(self._outcomes),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore ``state_dict`` output; the stages must match."""
        if state["stages"] != self.stages:
            raise ValueError(f"state holds stages {state['stages']}, this curriculum {self.stages}")
        self.opened_at = list(state["opened_at"])
        self._outcomes = deque(state["outcomes"], maxlen=self.window)
