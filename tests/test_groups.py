"""Role groups through Ray: a sharded trainer group publishing straight to generator replicas."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray
import torch
from conftest import tiny_config
from safetensors.torch import load_file

from relayrl.launch import connect_weight_sync, publish_weights
from relayrl.roles import Placement, Role
from relayrl.workloads import LLMWorkload


def _served(generator) -> dict[str, torch.Tensor]:
    """The weights a generator replica serves now, copied out of its actor."""
    return ray.get(
        generator.__ray_call__.remote(
            lambda g: {k: v.detach().clone() for k, v in g.model.state_dict().items()}
        )
    )


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_each_rank_sends_its_half_and_every_replica_serves_the_full_weights(
    ray_session, tmp_path, transport
):
    cfg = tiny_config(
        "trainer.ranks=2",
        "generator.replicas=2",
        f"sync.transport={transport}",
        "generator.prompts_per_step=4",
        "generator.group_size=4",
        "task.digits=1",
        "task.heldout_size=20",
        "trainer.lr=1e-2",
    )
    w = LLMWorkload(cfg)
    try:
        w.place()
        assert connect_weight_sync(cfg, w.trainer, w.receivers()).transport == transport
        ray.get(publish_weights(w.trainer, w.receivers()))
        for step in range(2):
            _, batch = w.generators[step % 2].generate.options(num_returns=2).remote()
            _, scored = ray.get(w.rewarders[0].score.options(num_returns=2).remote(batch))
            scored.rewards = np.arange(len(scored), dtype=np.float32) % 2  # a signal in each group
            ref = ray.put(scored)
            results = ray.get([rank.train_step.remote(ref) for rank in w.trainer])
            assert all(r.version == step + 1 for r in results)
            assert ray.get(publish_weights(w.trainer, w.receivers())) == [step + 1] * 2
        ray.get([rank.save_pretrained.remote(str(tmp_path / "ckpt")) for rank in w.trainer])
        full = load_file(tmp_path / "ckpt" / "model.safetensors")
        for generator in w.generators:
            served = _served(generator)
            assert all(torch.equal(served[name], full[name]) for name in full)
        stats = ray.get([rank.sync_stats.remote() for rank in w.trainer])
        sent = [s["payload_bytes"] for s in stats]
        model = sum(t.numel() * t.element_size() for t in _served(w.generators[0]).values())
        assert sum(sent) == model and max(sent) < 0.6 * model
        assert all(s["lost"] == {} for s in stats)
    finally:
        w.placed.stop()


def test_with_a_pull_transport_a_replica_takes_only_the_newest_version_before_it_generates(
    ray_session,
):
    cfg = tiny_config(
        "generator.replicas=3",
        "sync.transport=object_store",
        "generator.prompts_per_step=2",
        "generator.group_size=2",
        "task.digits=1",
        "task.heldout_size=20",
    )
    w = LLMWorkload(cfg)
    try:
        w.place()
        sync = connect_weight_sync(cfg, w.trainer, w.receivers())
        ray.get(publish_weights(w.trainer, w.receivers()))  # version 0 everywhere, as prepare does
        for _ in range(3):
            ray.get(w.trainer[0].bump_version.remote())
            assert sync.publish(fan_out=False) == {}
        assert ray.get(sync.refresh("generator_1")["generator_1"]) == 3
        meta, batch = ray.get(w.generators[1].generate.options(num_returns=2).remote())
        assert meta.version == 3 and set(batch.versions[batch.versions >= 0].tolist()) == {3}
        summary = sync.summary()
        assert summary["publishes"] == 4 and summary["lost"] == {}
        assert summary["receives"] == {"generator_0": 1, "generator_1": 2, "generator_2": 1}
        assert summary["skipped"] == {"generator_0": 3, "generator_1": 2, "generator_2": 3}
    finally:
        w.placed.stop()


_COUNTS = {"trainer": 1, "generator": 10, "rewarder": 1}


class _Probe:
    """The lightest actor: it only says which node it runs on."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_a_colocated_placement_of_many_actors_starts_every_one(ray_session):
    # Twelve 0.01-CPU shares summed as floats fell one Ray unit (1e-4) short of twelve actors.
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # for _Probe
    table = [Role(name, _Probe, n, lambda i, k: ((), {})) for name, n in _COUNTS.items()]
    placement = Placement("colocated", table)
    try:
        roles = [("trainer", 0), *(("generator", i) for i in range(10)), ("rewarder", 0)]
        actors = [ray.remote(_Probe).options(**placement.options(*r)).remote() for r in roles]
        assert len(set(ray.get([a.node.remote() for a in actors], timeout=60))) == 1
    finally:
        for actor in actors:
            ray.kill(actor)
        placement.close()
