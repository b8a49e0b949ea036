"""Dynamic Weighted Resampling (DWR): start the next episode on a task the policy still fails."""

import random
from collections import deque
from collections.abc import Callable, Sequence


def smoothed_weight(failures: Sequence[bool], window: int, alpha: float) -> float:
    """(failures + alpha) / (episodes + 2 alpha) over the recorded episodes (at most ``window``)."""
    return (sum(failures) + alpha) / (len(failures) + 2 * alpha)


def acce_weight(failures: Sequence[bool], window: int, alpha: float) -> float:
    """(window - successes) + alpha, episodes not yet played counting as successes."""
    # the recorded successes, len - failures, plus the window - len prefilled ones
    successes = window - sum(failures)
    return (window - successes) + alpha


# A task's unnormalised weight from its recent outcomes (true = failed), the window and alpha.
DWR_FORMULAS: dict[str, Callable[[Sequence[bool], int, float], float]] = {
    "smoothed": smoothed_weight,
    "acce": acce_weight,
}


class DynamicWeightedResampler:
    """Samples tasks with probability proportional to a weight of their recent failures.

    formula="smoothed" (default), the Laplace-smoothed failure rate over task k's last ``window``
    episodes:
        w_k = (failures_k + alpha) / (episodes_k + 2 * alpha)
    formula="acce", AcceRL's count form (alpha plays the paper's eps):
        w_k = (window - successes_k) + alpha
    where task k's history starts as ``window`` successes, so an episode not yet played counts as
    a success: an unseen task has weight alpha (eps), the lowest there is, and a task failed in
    every one of its last ``window`` episodes has window + alpha. Either way
    p_k = w_k / sum_j w_j.

    From AcceRL (arXiv:2603.18464), whose rollout workers draw each new episode's task this way so
    that experience concentrates on unsolved tasks. Where we differ: the authors' released code
    weights a task by its failure count in the window plus one; we use the Laplace-smoothed failure
    rate, which equals the count form once every window is full but does not favour a task merely
    because it has been played more often while windows are still filling. A task with no recent
    episodes has f = 1/2, as likely solved as not, and alpha > 0 keeps every task's probability
    above zero, so a solved task is still revisited and a forgotten skill is noticed.

    The acce form follows the issue's reading of the paper ("weights (window - successes) + eps,
    with history initialised to successes"); the paper's own text was not available to us. Since
    prefilled successes add no failures, it is exactly the authors' released code
    (``ds_libero_ppo_discrete.py``: failure count over the last 100 episodes, plus 1) with
    eps = alpha. Under it an unseen task is drawn least, never for being unknown.

    Each rollout worker can hold its own resampler (as in AcceRL) or share one; ``sample`` is
    reproducible for a given ``seed`` and sequence of calls.
    """

    def __init__(
        self,
        tasks: Sequence[str],
        *,
        window: int = 50,
        alpha: float = 1.0,
        formula: str = "smoothed",
        seed: int | None = None,
    ) -> None:
        tasks = list(tasks)
        if not tasks:
            raise ValueError("tasks must name at least one task, got an empty sequence")
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"tasks must be unique, got {tasks}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got window={window}")
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got alpha={alpha}")
        if formula not in DWR_FORMULAS:
            raise ValueError(f"formula must be one of {sorted(DWR_FORMULAS)}, got {formula!r}")
        self.tasks = tasks
        self.window = window
        self.alpha = alpha
        self.formula = formula
        self._weight = DWR_FORMULAS[formula]
        self._failures: dict[str, deque[bool]] = {task: deque(maxlen=window) for task in tasks}
        self._rng = random.Random(seed)

    def record(self, task: str, success: bool) -> None:
        """Add one finished episode of ``task``; the oldest outcome beyond the window drops out."""
        if task not in self._failures:
            raise ValueError(f"unknown task {task!r}; known tasks: {self.tasks}")
        self._failures[task].append(not success)

    def weights(self) -> dict[str, float]:
        """Sampling probability of each task, in the order of ``tasks``; they sum to 1."""
        rates = {
            task: self._weight(failures, self.window, self.alpha)
            for task, failures in self._failures.items()
        }
        total = sum(rates.values())
        return {task: rate / total for task, rate in rates.items()}

    def sample(self) -> str:
        """Draw the task for the next episode."""
        return self._rng.choices(self.tasks, weights=list(self.weights().values()))[0]

    def state_dict(self) -> dict[str, object]:
        """Recent outcomes and the random state, for a checkpoint (picklable)."""
        return {
            "tasks": list(self.tasks),
            "failures": {task: list(failures) for task, failures in self._failures.items()},
            "rng": self._rng.getstate(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore ``state_dict`` output; tasks must match; a smaller window keeps the newest."""
        if state["tasks"] != self.tasks:
            raise ValueError(f"state holds tasks {state['tasks']}, this resampler {self.tasks}")
        self._failures = {
            task: deque(state["failures"][task], maxlen=self.window) for task in self.tasks
        }
        self._rng.setstate(state["rng"])
