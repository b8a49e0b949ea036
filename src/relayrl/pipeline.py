"""Pipelines composed in Python: the LLM pipeline with executors and rewards of your own.

An LLM run is a pipeline of role groups: generator replicas sample completion groups, a chain of
scoring stages scores each batch, and the trainer group learns from it and publishes its weights
to the generators. The stages, in the order a batch passes them:

1. the rewarder (its rule: ``rewarder.scorer``, or a ``rule`` function given here);
2. the ``Stage`` executors given here, in order;
3. the reward model, when ``reward_model.path`` is set;
4. the reference policy, when ``trainer.kl_coef`` > 0;
5. the critic, when ``trainer.advantage`` = gae.

The built-in stages are ``Stage`` declarations too (``config_stages`` makes them from a config),
so a run is one list of stages and the workload has no branch per executor. A script declares
the extra parts and runs the pipeline under the same controller machinery as ``relayrl train``:
placement, the staleness gate, weight sync, tracing, failure recovery (a dead stage replica is
replaced and its batch counted as lost), run checkpoints and the summary. The YAML workloads are
this pipeline with nothing added: for ``workload: llm``, ``relayrl train`` runs
``LLMWorkload(cfg)``, whose stages are ``config_stages(cfg)``, as ``Pipeline(cfg).workload()``.

::

    from relayrl.pipeline import Pipeline, Stage, StageExecutor

    class LengthPenalty(StageExecutor):
        def __init__(self, cfg, per_token):
            super().__init__(cfg)
            self.per_token = per_token

        def score(self, batch):
            rewards = batch.rewards - self.per_token * batch.completion_len
            return self.summary(batch), replace(batch, rewards=rewards.astype("float32"))

    Pipeline("configs/arith.yaml", ["steps=100"],
             stages=[Stage("length_penalty", LengthPenalty, kwargs={"per_token": 0.01})],
    ).train("runs/mine")

See docs/api.md and examples/.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import cloudpickle

from relayrl.config import Config, load_config
from relayrl.executors.critic import Critic
from relayrl.executors.reference import Reference
from relayrl.executors.reward_model import RewardModel
from relayrl.executors.rewarder import Rewarder
from relayrl.observability.tracing import Span, Tracer
from relayrl.types import RolloutBatch

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
    if cfg.reward_model.path is not None:
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


def _ship_by_value(code: Any) -> None:
    """Let Ray's workers load ``code`` (a stage class, a rule function) whatever module defines
    it: a module of the user's, which the workers could not import, is pickled by value."""
    module = getattr(code, "__module__", None)
    if module is None or module == "__main__" or module.split(".")[0] == "relayrl":
        return  # __main__ is pickled by value anyway; relayrl is installed everywhere
    if module in sys.modules:
        cloudpickle.register_pickle_by_value(sys.modules[module])


class Pipeline:
    """The LLM pipeline of a config, with ``stages`` and a ``rule`` reward of your own.

    ``config`` is a ``Config``, or a YAML path (None: the defaults) that ``overrides``
    (``a.b=value`` items) apply to. ``rule(completion, reference) -> float`` replaces the
    rewarder's scorer; it runs in the rewarder's process, and one that raises scores 0 and is
    counted, as the built-in scorers are. Stage classes and the rule may live in any module of
    yours: one Ray's workers cannot import (a script's folder, a test file) is shipped by value.
    """

    def __init__(
        self,
        config: Config | str | Path | None = None,
        overrides: Sequence[str] = (),
        *,
        stages: Sequence[Stage] = (),
        rule: Callable[[str, str], float] | None = None,
    ) -> None:
        if isinstance(config, Config):
            cfg = config
            if overrides:
                raise ValueError("overrides apply to a YAML config; edit the Config instead")
        else:
            cfg = load_config(None if config is None else Path(config), list(overrides))
        if cfg.workload != "llm":
            raise ValueError(f"Pipeline is the LLM pipeline; workload={cfg.workload!r}")
        self.cfg = cfg
        self.stages = config_stages(cfg, stages, rule)  # every stage, the built-in ones too
        for code in [*(stage.cls for stage in stages), rule]:
            _ship_by_value(code)

    def workload(self) -> Any:
        """The ``LLMWorkload`` that runs this pipeline."""
        from relayrl.workloads.llm import LLMWorkload

        return LLMWorkload(self.cfg, stages=self.stages)

    def train(self, run_dir: str | Path, *, resume: bool = False) -> dict:
        """Run the pipeline in ``run_dir`` (or resume it there); returns the run summary."""
        from relayrl.job import train

        return train(self.cfg, Path(run_dir), resume=resume, workload=self.workload())
