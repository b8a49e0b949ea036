"""``Recovery.replace`` in isolation (fake actors, no Ray): one death seen by several loops is
recorded and replaced once, and a replacement outlives the cancelled loop that started it; the
failure records' summary and checkpoint forms."""

from __future__ import annotations

import asyncio
import json
import threading

from relayrl.launch import Group
from relayrl.observability.metrics import Failure, RunTally
from relayrl.recovery import Recovery


class FakeId:
    """What an actor handle's ``_actor_id`` offers: ``hex()``."""

    def __init__(self, n: int):
        self.n = n

    def hex(self) -> str:
        return f"{self.n:04x}"


class FakeActor:
    """An actor handle with an id."""

    def __init__(self, n: int):
        self._actor_id = FakeId(n)


class FakeSync:
    """Weight sync with no receivers."""

    receivers: dict = {}


class FakeWorkload:
    """Makes a new actor per ``recreate`` once the test releases it, and counts them."""

    def __init__(self, released: bool = True):
        self.made: list[FakeActor] = []
        self.lock = threading.Lock()
        self.started, self.release = threading.Event(), threading.Event()
        if released:
            self.release.set()

    def recreate(self, role: str, index: int, incarnation: int) -> FakeActor:
        self.started.set()
        assert self.release.wait(10), "the test never released the recreate"
        with self.lock:
            self.made.append(FakeActor(100 + len(self.made)))
            return self.made[-1]


def _setup(released: bool = True) -> tuple[Recovery, Group, FakeWorkload, RunTally]:
    tally = RunTally(steps=1, progress=False)
    workload = FakeWorkload(released)
    group = Group("rewarder", [FakeActor(1)])
    return Recovery(workload, FakeSync(), tally), group, workload, tally


def test_one_death_seen_by_two_loops_is_recorded_once_with_both_losses():
    recovery, group, workload, tally = _setup(released=False)
    dead = group[0]
    err = RuntimeError("gone")

    async def both() -> list:
        calls = asyncio.gather(
            recovery.replace(group, 0, err, lost=16, dead=dead),
            recovery.replace(group, 0, err, lost=8, unfinished=3, dead=dead),
        )
        assert await asyncio.to_thread(workload.started.wait, 10)
        for _ in range(100):  # a few turns of the loop: the second call books, then waits
            if tally.lost == 24:
                break
            await asyncio.sleep(0)
        assert tally.lost == 24  # both calls booked while the first one's recreate is held
        workload.release.set()
        return await calls

    new = asyncio.run(both())
    assert len(workload.made) == 1 and new == [workload.made[0]] * 2
    assert group[0] is workload.made[0]
    assert [f.name for f in tally.failures] == ["rewarder"]
    assert tally.failures[0].lost == 24 and tally.lost == 24
    assert tally.failures[0].unfinished == 3

    # A later loop reports the same old death once its replacement is in place: the books gain
    # what it lost, and the new actor is left alone.
    asyncio.run(recovery.replace(group, 0, err, lost=4, unfinished=None, dead=dead))
    assert len(workload.made) == 1 and tally.lost == 28
    assert tally.failures[0].unfinished is None  # one part unknown: the whole is unknown

    # A second death (of the replacement) is a second record and a second actor.
    asyncio.run(recovery.replace(group, 0, err))
    assert len(workload.made) == 2 and len(tally.failures) == 2


def test_a_replacement_finishes_when_its_loop_is_cancelled():
    recovery, group, workload, tally = _setup(released=False)
    dead = group[0]

    async def cancelled() -> None:
        task = asyncio.ensure_future(recovery.replace(group, 0, RuntimeError("gone")))
        assert await asyncio.to_thread(workload.started.wait, 10)  # inside the recreate
        task.cancel()
        workload.release.set()  # the recreate ends after its loop was cancelled
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()

    asyncio.run(cancelled())
    assert group[0] is not dead and group[0] is workload.made[0]
    # The next loop (a final evaluation, say) that saw the death finds it handled.
    asyncio.run(recovery.replace(group, 0, RuntimeError("gone"), dead=dead))
    assert len(workload.made) == 1 and len(tally.failures) == 1


def test_failures_render_by_role_as_plain_records_and_survive_a_checkpoint():
    tally = RunTally(steps=1, progress=False)
    tally.on_failure(Failure("generator", "generator_1", 12.5, 3, "RayActorError: gone", 8, 2))
    index = tally.on_failure(Failure("rewarder", "rewarder", 13.0, 4, "killed", lost=5))
    tally.on_failure_seen_again(index, lost=3, unfinished=None)
    assert tally.lost == 16  # 8 + 5 + 3
    summary = json.loads(json.dumps(tally.failure_summary()))
    assert summary == {
        "generator": [
            {
                "role": "generator",
                "name": "generator_1",
                "time": 12.5,
                "step": 3,
                "reason": "RayActorError: gone",
                "lost": 8,
                "unfinished": 2,
            }
        ],
        "rewarder": [
            {
                "role": "rewarder",
                "name": "rewarder",
                "time": 13.0,
                "step": 4,
                "reason": "killed",
                "lost": 8,
                "unfinished": None,
            }
        ],
    }
    keys = ["role", "name", "time", "step", "reason", "lost", "unfinished"]
    assert list(summary["generator"][0]) == keys  # in this order
    state = tally.state_dict()
    assert state["failures"][1] == summary["rewarder"][0]  # plain dicts in the checkpoint
    resumed = RunTally(steps=1, progress=False)
    resumed.load_state_dict(state)
    assert resumed.failures == tally.failures and resumed.lost == 16
