"""Placement: start or join Ray and create the executors as actors."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import ray

from relayrl.config import Config
from relayrl.executors.generator import Generator
from relayrl.executors.rewarder import Rewarder
from relayrl.executors.trainer import Trainer


@dataclass
class Executors:
    """Ray actor handles of one LLM run."""

    generator: Any
    rewarder: Any
    trainer: Any

    def all(self) -> dict[str, Any]:
        """Every executor by name."""
        return {"generator": self.generator, "rewarder": self.rewarder, "trainer": self.trainer}


def start_ray(cfg: Config) -> None:
    """Join ``cfg.ray.address`` or start an embedded single-node Ray on loopback."""
    if ray.is_initialized():
        return
    if cfg.ray.address is not None:
        ray.init(address=cfg.ray.address, log_to_driver=True)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=cfg.ray.num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
    )


def place_executors(cfg: Config) -> Executors:
    """Create the generator, rewarder and trainer actors.

    Actors reserve no Ray CPUs: each sets its own torch thread count, and fractional reservations
    on a 2-CPU node can leave a later task unschedulable.
    """
    actor = ray.remote(num_cpus=0, max_restarts=0)
    return Executors(
        generator=actor(Generator).options(name=None).remote(cfg),
        rewarder=actor(Rewarder).remote(cfg),
        trainer=actor(Trainer).remote(cfg),
    )


def pick_transport(requested: str, trainer_node: str, receiver_nodes: list[str]) -> str:
    """The weight-sync transport for a placement: shm on one host, dist across hosts."""
    one_host = all(node == trainer_node for node in receiver_nodes)
    if requested == "auto":
        return "shm" if one_host else "dist"
    if requested == "shm" and not one_host:
        raise ValueError(
            "sync.transport=shm needs the trainer and its receivers on one host; "
            "they were placed on different nodes: use sync.transport=dist or auto"
        )
    return requested


def connect_weight_sync(cfg: Config, ex: Executors) -> str:
    """Open the trainer's publisher for the generator, rendezvous both, return the transport."""
    (trainer_node, trainer_ip), (gen_node, _) = ray.get(
        [ex.trainer.node.remote(), ex.generator.node.remote()]
    )
    transport = pick_transport(cfg.sync.transport, trainer_node, [gen_node])
    address = ray.get(ex.trainer.open_sync.remote(transport, ["generator"], trainer_ip))
    ray.get(ex.generator.open_sync.remote(address, "generator"))
    ray.get([ex.trainer.connect_sync.remote(), ex.generator.connect_sync.remote()])
    return transport


def stop_executors(executors: Executors) -> None:
    """Kill the actors of a run (the Ray instance stays up for the next run).

    The rewarder is asked first to stop its scoring processes, which a kill would orphan.
    """
    with contextlib.suppress(Exception):  # it may already be dead; the kill below still runs
        ray.get(executors.rewarder.close.remote(), timeout=30)
    for handle in executors.all().values():
        ray.kill(handle)
