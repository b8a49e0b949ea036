"""A receiver process killed mid-transfer is named within the timeout; the rest carry on."""

from __future__ import annotations

import sys
import time

import pytest
import ray
import torch

from relayrl.weight_sync import TRANSPORTS

SHAPES = {"a": (4096, 2048), "b": (4096, 2048), "c": (2048,)}  # 64 MiB of fp32


def tensors(version: int) -> dict[str, torch.Tensor]:
    return {n: torch.full(s, float(version)) for n, s in SHAPES.items()}


class Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))


@ray.remote(num_cpus=0)
class Receiving:
    """A receiver in its own process, as in a run."""

    def __init__(self, address: dict, name: str, timeout_s: float):
        self.receiver = TRANSPORTS[address["kind"]].Receiver(
            Flat(), [address], name, timeout_s=timeout_s
        )

    def connect(self) -> None:
        self.receiver.connect()

    def receive(self, ticket) -> int:
        return self.receiver.receive([ticket]).version

    def value(self) -> float:
        with self.receiver.serving():
            return float(self.receiver.state.model.a.detach()[0, 0])


def start(kind: str, timeout_s: float):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test modules: not importable
    pub = TRANSPORTS[kind].Publisher(tensors(0), ["alive", "doomed"], timeout_s=timeout_s)
    actors = {n: Receiving.remote(pub.address, n, timeout_s) for n in ("alive", "doomed")}
    ray.get([a.value.remote() for a in actors.values()])  # started, as executors are by then
    connecting = [a.connect.remote() for a in actors.values()]
    pub.connect()
    ray.get(connecting)
    return pub, actors


@pytest.mark.parametrize("kind", ["dist", "shm"])
def test_a_receiver_killed_mid_transfer_is_named_and_the_others_carry_on(ray_session, kind):
    pub, actors = start(kind, timeout_s=2.0)  # the dead-publisher test below moves as much
    ticket = pub.publish(1, tensors(1))
    ray.get([a.receive.remote(ticket) for a in actors.values()])
    assert pub.finish() == {}
    # Version 2 is in flight to both (dist: sends issued; shm: in the slot) when "doomed" dies
    # before taking it; its process is gone mid-transfer.
    ticket = pub.publish(2, tensors(2))
    ray.kill(actors["doomed"])
    assert ray.get(actors["alive"].receive.remote(ticket), timeout=30) == 2
    start_s = time.monotonic()
    with pytest.warns(UserWarning, match="doomed"):
        if kind == "shm":  # version 3 needs the slot the dead receiver still holds
            ticket = pub.publish(3, tensors(3))
        lost = pub.finish()
    assert time.monotonic() - start_s < 2.0 + 5.0  # within the timeout, no hang
    assert set(lost) == {"doomed"}
    if kind == "shm":
        assert ray.get(actors["alive"].receive.remote(ticket), timeout=30) == 3
    ticket = pub.publish(5, tensors(5))
    assert ray.get(actors["alive"].receive.remote(ticket), timeout=30) == 5
    assert ray.get(actors["alive"].value.remote()) == 5.0
    assert pub.finish() == lost
    pub.close()
    ray.kill(actors["alive"])


@ray.remote(num_cpus=0)
class Publishing:
    """A trainer shard in its own process."""

    def __init__(self, timeout_s: float):
        self.publisher = TRANSPORTS["dist"].Publisher(tensors(0), ["r"], timeout_s=timeout_s)

    def address(self) -> dict:
        return self.publisher.address

    def connect(self) -> None:
        self.publisher.connect()

    def publish(self, version: int):
        return self.publisher.publish(version, tensors(version))


def test_a_dead_publisher_fails_the_receiver_with_its_address(ray_session):
    """The other direction: the trainer process dies; the receiver names it, no hang."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = Publishing.remote(2.0)
    address = ray.get(trainer.address.remote())
    receiver = TRANSPORTS["dist"].Receiver(Flat(), [address], "r", timeout_s=2.0)
    connecting = trainer.connect.remote()
    receiver.connect()
    ray.get(connecting)
    ticket = ray.get(trainer.publish.remote(1))
    assert receiver.receive([ticket]).version == 1
    ticket = ray.get(trainer.publish.remote(2))
    ray.kill(trainer)
    time.sleep(0.5)
    start_s = time.monotonic()
    with pytest.raises(RuntimeError, match=f"trainer shard 0 at 127.0.0.1:{address['port']}"):
        receiver.receive([ticket])
    assert time.monotonic() - start_s < 2.0 + 5.0
    assert receiver.version == 1  # still serving the last whole version
