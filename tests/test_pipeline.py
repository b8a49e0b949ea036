"""The pipeline's stage list: the built-in stages are Stage declarations, checked like yours."""

from __future__ import annotations

import pytest
from conftest import tiny_config

from relayrl.executors.critic import Critic
from relayrl.executors.reference import Reference
from relayrl.executors.rewarder import Rewarder
from relayrl.pipeline import Pipeline, Stage, StageExecutor, config_stages
from relayrl.workloads.llm import LLMWorkload


class Mine(StageExecutor):
    """A stage of a user's that changes nothing."""

    name = "mine"

    def score(self, batch):
        return self.summary(batch), batch


class MineFromStart(Mine):
    """A stage of a user's that also loads the start policy."""

    def load(self, path: str) -> None:
        self.path = path


def _full_config(tmp_path):
    """Every optional stage on: a reward model path, a KL term and a critic."""
    (tmp_path / "rm").mkdir()
    return tiny_config(
        f"reward_model.path={tmp_path / 'rm'}",
        "reward_model.replicas=2",
        "trainer.kl_coef=0.1",
        "trainer.advantage=gae",
    )


def test_the_config_makes_the_built_in_stages_in_order_around_yours(tmp_path):
    cfg = _full_config(tmp_path)
    chain = config_stages(cfg, [Stage("mine", Mine, replicas=3)])
    assert [s.name for s in chain] == ["rewarder", "mine", "reward_model", "reference", "critic"]
    assert [s.replicas for s in chain] == [cfg.rewarder.replicas, 3, 2, 1, 1]
    assert [s.name for s in chain if s.start_policy] == ["reference", "critic"]
    assert [s.name for s in config_stages(tiny_config())] == ["rewarder"]


def test_the_workload_places_one_group_per_stage_with_its_replicas(tmp_path):
    cfg = _full_config(tmp_path)
    mine = Stage("mine", Mine, replicas=3, resources={"x": 1})
    workload = Pipeline(cfg, stages=[mine]).workload()
    roles = {role.name: role for role in workload.table()}
    assert list(roles) == [
        "trainer",
        "generator",
        "rewarder",
        "mine",
        "reward_model",
        "reference",
        "critic",
    ]
    assert (roles["mine"].count, roles["mine"].resources) == (3, {"x": 1})
    assert roles["reward_model"].count == 2 and roles["reward_model"].replaced
    assert [name for name, role in roles.items() if role.renew] == ["reference", "critic"]
    assert [name for name, role in roles.items() if role.receives] == ["generator"]
    assert [g.role for g in workload.scorers()] == list(roles)[2:]
    assert [g.role for g in workload._from_start()] == ["reference", "critic"]
    assert [g.role for g in LLMWorkload(tiny_config()).scorers()] == ["rewarder"]


def test_a_built_in_stage_name_goes_only_with_its_own_class():
    assert Stage("reference", Reference, start_policy=True).cls is Reference
    with pytest.raises(ValueError, match="name='reference' is the built-in reference stage"):
        Stage("reference", Mine)
    with pytest.raises(ValueError, match="name='critic' is the built-in critic stage"):
        Stage("critic", Rewarder)
    with pytest.raises(ValueError, match="not one of the built-in roles"):
        Stage("trainer", Mine)
    with pytest.raises(TypeError, match="must be a subclass of relayrl.pipeline.StageExecutor"):
        Stage("plain", dict)


def test_start_policy_needs_a_load_method():
    assert Stage("value", MineFromStart, start_policy=True).start_policy
    with pytest.raises(TypeError, match=r"start_policy=True needs a load\(path\) method on Mine"):
        Stage("value", Mine, start_policy=True)
    assert Stage("critic", Critic, start_policy=True).start_policy


def test_stage_names_are_unique_over_the_whole_chain(tmp_path):
    with pytest.raises(ValueError, match="stage names must be unique"):
        Pipeline(tiny_config(), stages=[Stage("mine", Mine), Stage("mine", Mine)])
    with pytest.raises(ValueError, match="first scoring stage must be the rewarder"):
        LLMWorkload(tiny_config(), stages=[Stage("mine", Mine)])
