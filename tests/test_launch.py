"""Weight-sync wiring without Ray: which receiver is handed which publish, and when."""

from __future__ import annotations

import pytest

from relayrl.launch import Group, WeightSync


class _Method:
    """An actor method stand-in: ``remote`` records the call and returns a name for its result."""

    def __init__(self, calls: list[tuple[str, tuple]], name: str):
        self.calls = calls
        self.name = name

    def remote(self, *args: object) -> str:
        self.calls.append((self.name, args))
        return f"{self.name}#{len(self.calls)}"


class _Actor:
    def __init__(self, calls: list[tuple[str, tuple]], name: str):
        self.publish = _Method(calls, f"{name}.publish")
        self.update_weights = _Method(calls, f"{name}.update_weights")


def _wired(transport: str) -> tuple[WeightSync, list[tuple[str, tuple]]]:
    """Two trainer ranks and three receivers, with every call recorded in order."""
    calls: list[tuple[str, tuple]] = []
    trainer = Group("trainer", [_Actor(calls, f"trainer_{r}") for r in range(2)])
    receivers = {f"g{i}": _Actor(calls, f"g{i}") for i in range(3)}
    return WeightSync(transport, trainer, receivers, "127.0.0.1"), calls


def _updates(calls: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    return [(name.split(".")[0], args) for name, args in calls if name.endswith("update_weights")]


def test_a_pull_receiver_is_handed_only_the_newest_publish_and_only_once() -> None:
    sync, calls = _wired("object_store")
    assert sync.skips_versions
    assert sync.refresh("g0", "g1", "g2") == {}  # each holds what was published before the loop
    assert sync.publish(fan_out=False) == {} and sync.publish(fan_out=False) == {}
    newest = ("trainer_0.publish#3", "trainer_1.publish#4")  # the second publish's tickets
    assert len(calls) == 4 and _updates(calls) == []
    assert list(sync.refresh("g1")) == ["g1"] and sync.refresh("g1") == {}
    assert _updates(calls) == [("g1", newest)]
    assert list(sync.refresh("g0", "g1", "g2")) == ["g0", "g2"]
    assert _updates(calls)[1:] == [("g0", newest), ("g2", newest)]


def test_a_push_transport_hands_every_publish_to_every_receiver() -> None:
    sync, calls = _wired("shm")
    assert not sync.skips_versions
    with pytest.raises(ValueError, match="needs every receiver"):
        sync.publish(fan_out=False)
    for _ in range(2):
        assert list(sync.publish()) == ["g0", "g1", "g2"]
    assert sync.refresh("g0", "g1", "g2") == {}
    assert [name for name, _ in _updates(calls)] == ["g0", "g1", "g2"] * 2
