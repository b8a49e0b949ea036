"""Scoring stages of the LLM workload: ``Stage``, the declaration of one stage's replica group,
and ``config_stages``, a run's chain of them; every stage's executor is a ``StageExecutor``
(``relayrl.executors.stage_executor``), the built-in ones too.

A batch passes the stages in order: the rewarder, the stages a pipeline adds, then the reward
models (``reward_model``, then each of ``reward_models``), the reference and the critic where the
config asks for them. ``relayrl.pipeline`` exports these names for scripts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relayrl.config import LLM_ROLES
from relayrl.executors.critic import Critic
from relayrl.executors.reference import Reference
from relayrl.executors.reward_model import RewardModel
from relayrl.executors.rewarder import Rewarder
from relayrl.executors.stage_executor import StageExecutor

if TYPE_CHECKING:
    from relayrl.config import Config

__all__ = ["BUILT_IN_STAGES", "Stage", "StageExecutor", "config_stages"]

BUILT_IN_STAGES: dict[str, type[StageExecutor]] = {
    "rewarder": Rewarder,
    "reward_model": RewardModel,
    "reference": Reference,
    "critic": Critic,
}
BUILT_IN_ROLES = LLM_ROLES


@dataclass(frozen=True)
class Stage:
    """A scoring stage: ``replicas`` actors of ``cls`` (a ``StageExecutor``), each built as
    ``cls(cfg, *args, **kwargs)``, with the Ray ``resources`` each needs.

    With ``start_policy`` its actors also load the policy as RL started: ``load(path)`` runs with
    the run directory's copy (``start_policy/``) before their first ``score`` and in every
    replacement, and on resume ``load_state_dict`` finds that directory under ``"path"``; the
    reference and the critic are such stages. The built-in stages' names (``rewarder``,
    ``reward_model``, ``reference``, ``critic``) go only with their own classes; a stage of
    another name may use a built-in class (each ``reward_models`` entry is a ``RewardModel``)."""

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
    ``rule`` if given), ``stages``, then the reward models (``reward_model``, then each of
    ``reward_models`` in the order declared), the reference and the critic where the config asks
    for them (the critic last: its advantages come from the final rewards)."""
    chain = [
        Stage("rewarder", Rewarder, cfg.rewarder.replicas, cfg.rewarder.resources, args=(rule,)),
        *stages,
    ]
    if cfg.reward_model is not None:
        rm = cfg.reward_model
        chain.append(Stage("reward_model", RewardModel, rm.replicas, rm.resources))
    for rm in cfg.reward_models:
        chain.append(Stage(rm.name, RewardModel, rm.replicas, rm.resources, args=(rm.name,)))
    if cfg.trainer.kl_coef > 0:
        ref = cfg.reference
        chain.append(Stage("reference", Reference, ref.replicas, ref.resources, start_policy=True))
    if cfg.trainer.advantage == "gae":  # one critic: it learns, and two would learn apart
        chain.append(Stage("critic", Critic, 1, cfg.critic.resources, start_policy=True))
    names = [stage.name for stage in chain]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names must be unique, got {names}")
    return tuple(chain)
