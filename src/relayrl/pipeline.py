"""Pipelines composed in Python: the LLM pipeline with executors and rewards of your own.

An LLM run is a pipeline of role groups: generator replicas sample completion groups, a chain of
scoring stages scores each batch, and the trainer group learns from it and publishes its weights
to the generators. The stages, in the order a batch passes them:

1. the rewarder (its rule: ``rewarder.scorer``, or a ``rule`` function given here);
2. the ``Stage`` executors given here, in order;
3. the reward models: ``reward_model`` when ``reward_model.path`` is set, then each entry of
   ``reward_models`` in the order declared;
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

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ray import cloudpickle

from relayrl.config import Config, load_config
from relayrl.executors.stages import Stage, StageExecutor, config_stages

__all__ = ["Pipeline", "Stage", "StageExecutor", "config_stages"]


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
