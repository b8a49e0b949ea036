"""Scoring stages of the LLM workload: ``StageExecutor``, the base of a stage of your own;
``Stage``, the declaration of one stage's replica group; ``config_stages``, a run's chain of them.

A batch passes the stages in order: the rewarder, the stages a pipeline adds, then the reward
model, the reference and the critic where the config asks for them. ``relayrl.pipeline`` exports
these names for scripts.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relayrl.executors.critic import Critic
from relayrl.executors.reference import Reference
from relayrl.executors.reward_model import RewardModel
from relayrl.executors.rewarder import Rewarder
from relayrl.observability.tracing import Span, Tracer
from relayrl.types import RolloutBatch

if TYPE_CHECKING:
    from relayrl.config import Config

BUILT_IN_STAGES: dict[str, type] = {
    "rewarder": Rewarder,
    "reward_model": RewardModel,
    "reference": Reference,
    "critic": Critic,
}
BUILT_IN_ROLES = ("trainer", "generator", *BUILT_IN_STAGES)


class StageExecutor:
    """Base class of a scoring stage of your own: implement ``score``.

    It is constructed on its actor as ``cls(cfg, *args, **kwargs)`` with the run's ``Config``.
    ``score`` takes a ``RolloutBatch`` (rewards already filled by the stages before it) and
    returns ``(summary, batch)``: a dict with ``samples``, ``busy_s``, ``errors`` (samples it
    could not score) and ``timeouts`` (``summary()`` makes one), and the batch the next stage
    receives. The run's books count samples, so a stage changes rewards or adds fields, never
    rows. Override ``state_dict``/``load_state_dict`` if it holds state a resumed run needs.
    """

    name = "stage"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wrap a subclass's ``score`` so every call is traced and its busy time measured."""
        super().__init_subclass__(**kwargs)
        inner = cls.__dict__.get("score")
        if inner is None:
            return

        @functools.wraps(inner)
        def score(self: StageExecutor, batch: RolloutBatch) -> tuple[dict, RolloutBatch]:
            with self.tracer.span(self.name):
                self._started = time.perf_counter()
                return inner(self, batch)

        cls.score = score

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.tracer = Tracer(self.name)
        self._started = time.perf_counter()

    def score(self, batch: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        """Score ``batch``; see the class docstring."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(batch)")

    def summary(self, batch: RolloutBatch, errors: int = 0, timeouts: int = 0) -> dict:
        """The summary ``score`` returns for ``batch``; ``busy_s`` is the time since the last."""
        now = time.perf_counter()
        busy, self._started = now - self._started, now
        return {"samples": len(batch), "busy_s": busy, "errors": errors, "timeouts": timeouts}

    def stats(self) -> dict[str, float]:
        """Counters for the run summary."""
        return {"busy_s": self.tracer.busy_s()}

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits

    def state_dict(self) -> dict:
        """State a resumed run restores; none by default."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""


@dataclass(frozen=True)
class Stage:
    """A scoring stage: ``replicas`` actors of ``cls`` (a ``StageExecutor``), each built as
    ``cls(cfg, *args, **kwargs)``, with the Ray ``resources`` each needs.

    With ``start_policy`` its actors also load the policy as RL started: ``load(path)`` runs with
    the run directory's copy (``start_policy/``) before their first ``score`` and in every
    replacement, and on resume ``load_state_dict`` finds that directory under ``"path"``; the
    reference and the critic are such stages. The built-in stages' names (``rewarder``,
    ``reward_model``, ``reference``, ``critic``) go only with their own classes."""

    name: str
    cls: type
    replicas: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    start_policy: bool = False

    def __post_init__(self) -> None:
        built_in = BUILT_IN_STAGES.get(self.name)
        if built_in is not None:
            if self.cls is not built_in:
                raise ValueError(
                    f"Stage name={self.name!r} is the built-in {self.name} stage "
                    f"({built_in.__name__}); give yours another name"
                )
        elif not re.fullmatch(r"[a-z][a-z0-9_]*", self.name) or self.name in BUILT_IN_ROLES:
            raise ValueError(
                f"Stage name={self.name!r}: use lowercase letters, digits and _, not one of the "
                f"built-in roles {', '.join(BUILT_IN_ROLES)}"
            )
        elif not (isinstance(self.cls, type) and issubclass(self.cls, StageExecutor)):
            raise TypeError(
                f"Stage {self.name!r}: cls={self.cls!r} must be a subclass of "
                "relayrl.pipeline.StageExecutor"
            )
        if self.replicas < 1:
            raise ValueError(f"Stage {self.name!r}: replicas={self.replicas} must be >= 1")
        if self.start_policy and not callable(getattr(self.cls, "load", None)):
            raise TypeError(
                f"Stage {self.name!r}: start_policy=True needs a load(path) method on "
                f"{self.cls.__name__}"
            )


def config_stages(
    cfg: Config,
    stages: Sequence[Stage] = (),
    rule: Callable[[str, str], float] | None = None,
) -> tuple[Stage, ...]:
    """A run's scoring stages in the order a batch passes them: the rewarder (scoring with
    ``rule`` if given), ``stages``, then the reward model, the reference and the critic where the
    config asks for them (the critic last: its advantages come from the final rewards)."""
    chain = [
        Stage("rewarder", Rewarder, cfg.rewarder.replicas, cfg.rewarder.resources, args=(rule,)),
        *stages,
    ]
    if cfg.reward_model is not None:
        rm = cfg.reward_model
        chain.append(Stage("reward_model", RewardModel, rm.replicas, rm.resources))
    if cfg.trainer.kl_coef > 0:
        ref = cfg.reference
        chain.append(Stage("reference", Reference, ref.replicas, ref.resources, start_policy=True))
    if cfg.trainer.advantage == "gae":  # one critic: it learns, and two would learn apart
        chain.append(Stage("critic", Critic, 1, cfg.critic.resources, start_policy=True))
    names = [stage.name for stage in chain]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names must be unique, got {names}")
    return tuple(chain)
