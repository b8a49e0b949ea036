"""The role table: refused before placement when it cannot be placed, and what placement,
replacement, snapshots, receivers and traces take from it."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import pytest
import ray
from conftest import tiny_config

from relayrl.roles import Placed, Role, RoleTableError, check_table, ray_resources
from relayrl.workloads import EmbodiedWorkload, LLMWorkload


def _never(i: int, k: int) -> tuple[tuple, dict]:
    raise AssertionError("a member was built for a table that should have been refused")


def _role(name: str, count: int = 1, **fields) -> Role:
    return Role(name, object, count, _never, **fields)


CLUSTER = {"CPU": 2.0, "memory": 1e9, "node_a": 1.0}


def test_a_duplicate_role_name_is_refused_naming_it():
    with pytest.raises(RoleTableError, match="^role 'generator' appears twice in the role table$"):
        check_table([_role("trainer"), _role("generator"), _role("generator", 2)], CLUSTER)


def test_a_count_below_one_is_refused_naming_the_role():
    with pytest.raises(RoleTableError, match=r"^role 'critic': count=0, must be >= 1$"):
        check_table([_role("trainer"), _role("critic", 0)], CLUSTER)


def test_a_resource_the_cluster_lacks_is_refused_naming_the_role():
    table = [_role("trainer", gpus=1.0), _role("generator")]
    with pytest.raises(RoleTableError, match=r"^role 'trainer': 1 x GPU=1 .* the cluster has 0 "):
        check_table(table, CLUSTER)
    # node_a: 1 fits one member, not the third: the role named is the one that overflows it
    table = [
        _role("generator", 1, resources={"node_a": 0.5}),
        _role("rewarder", 2, resources={"node_a": 0.5}),
    ]
    with pytest.raises(
        RoleTableError,
        match=r"^role 'rewarder': 2 x node_a=0.5 brings the run's node_a to 1.5, the cluster "
        r"has 1 ",
    ):
        check_table(table, CLUSTER)
    # 150 members of 0.01 CPU each are 1.5 CPUs: they fit 2
    check_table([_role("generator", 150)], CLUSTER)
    with pytest.raises(RoleTableError, match="^role 'generator': 201 x CPU=0.01"):
        check_table([_role("generator", 201)], CLUSTER)


def test_a_receiver_of_an_unknown_role_is_refused():
    with pytest.raises(RoleTableError, match="^role 'generator': receives='learner' is not a role"):
        check_table([_role("trainer"), _role("generator", receives="learner")])


def test_a_config_sections_resources_split_into_cpus_gpus_and_node_resources():
    assert ray_resources({"GPU": 1, "node_a": 2}) == {
        "cpus": 0.01,
        "gpus": 1,
        "resources": {"node_a": 2},
    }
    role = Role("trainer", object, 1, _never, **ray_resources({"CPU": 2, "GPU": 0.5}))
    assert role.bundle() == {"CPU": 2, "GPU": 0.5}


def test_the_llm_table_says_who_receives_is_replaced_and_is_saved():
    table = {r.name: r for r in LLMWorkload(tiny_config("trainer.kl_coef=0.1")).table()}
    assert list(table) == ["trainer", "generator", "rewarder", "reference"]
    assert [n for n, r in table.items() if r.receives == "trainer"] == ["generator"]
    assert [n for n, r in table.items() if r.replaced] == ["generator", "rewarder", "reference"]
    assert [n for n, r in table.items() if r.saved == "own_files"] == ["trainer"]
    assert [n for n, r in table.items() if r.close] == ["trainer", "rewarder"]
    # a replacement's seeds are its own: generator replica 1's second incarnation
    args, kwargs = table["generator"].make(1, 2)
    assert kwargs == {"replica": 1 + 2 * 1}


class _Member:
    """A stand-in member: it keeps a state and says its name."""

    def __init__(self, name: str):
        self.name = name
        self.state = {"n": 0}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)

    def get(self) -> tuple[str, dict]:
        return self.name, self.state


def _member(name: str):
    return lambda i, k: ((f"{name}_{i}_{k}",), {})


def test_placement_replacement_and_snapshots_go_over_the_table(ray_session):
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # for _Member
    renewed: list[tuple[int, int]] = []
    generator = Role("generator", _Member, 2, _member("generator"), receives="trainer")
    table = [
        Role("trainer", _Member, 1, _member("trainer"), saved="own_files"),
        dataclasses.replace(
            generator,
            replaced=True,
            saved="state_dict",
            traced=True,
            renew=lambda actor, i, k: renewed.append((i, k)),
        ),
        Role("buffer", _Member, 1, _member("buffer"), saved="state_dict"),
    ]
    placed = Placed.place("colocated", table)
    try:
        assert [g.role for g in placed.all()] == ["trainer", "generator", "buffer"]
        assert list(placed.receivers()) == ["generator_0", "generator_1"]
        assert list(placed.traced()) == ["generator_0", "generator_1"]
        assert placed["absent"].actors == []
        ray.get(placed["generator"][1].load_state_dict.remote({"n": 5}))
        parts = asyncio.run(placed.snapshot())
        assert parts == {"generator_0": {"n": 0}, "generator_1": {"n": 5}, "buffer": {"n": 0}}
        ray.kill(placed["generator"][1])  # its share of the bundle goes to the replacement
        new = placed.recreate("generator", 1, 3)
        assert ray.get(new.get.remote()) == ("generator_1_3", {"n": 0}) and renewed == [(1, 3)]
        placed["generator"].actors[1] = new
        placed.restore(parts)
        assert ray.get(new.get.remote()) == ("generator_1_3", {"n": 5})
        with pytest.raises(ValueError, match="a buffer is not replaced: only members of"):
            placed.recreate("buffer", 0, 1)
        topology = placed.topology()
        assert topology["placement"] == "colocated" and topology["nodes"] == 1
        assert [m["name"] for m in topology["roles"]["generator"]] == ["generator_0", "generator_1"]
    finally:
        placed.stop()


def test_a_table_the_cluster_cannot_hold_is_refused_before_any_actor_or_bundle(ray_session):
    groups = len(ray.util.placement_group_table())
    table = [_role("trainer"), _role("generator", 2, resources={"node_without_it": 1})]
    with pytest.raises(RoleTableError, match="^role 'generator': 2 x node_without_it=1 "):
        Placed.place("colocated", table)
    assert len(ray.util.placement_group_table()) == groups


def test_the_embodied_table_is_known_once_the_env_is_probed():
    w = EmbodiedWorkload(tiny_config("workload=embodied"))
    assert w.placed.all() == [] and w.replay_buffer is None and len(w.workers) == 0
