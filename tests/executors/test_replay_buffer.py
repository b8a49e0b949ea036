"""Replay buffer: FIFO super-batches, overflow and staleness drops, the books of every env step
(against a naive reference), blocking reads that never block writers; the prefetcher overlaps.
As a threaded Ray actor: tests/executors/test_rollout_worker.py."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from relayrl.executors.replay_buffer import ReplayBuffer, ReplayBufferClosed
from relayrl.types import BufferStats, Segment


def segment(ident: int, versions: list[int]) -> Segment:
    """A segment of len(versions) steps; ``ident`` goes in the episode field to follow it."""
    t = len(versions)
    return Segment(
        worker=0,
        episode=ident,
        task="t",
        instruction="i",
        images=np.zeros((t + 1, 1, 2, 2, 3), np.uint8),
        steps=np.arange(t + 1, dtype=np.int64),
        actions=np.zeros((t, 1), np.int64),
        logprobs=np.zeros((t, 1), np.float32),
        values=np.zeros(t, np.float32),
        rewards=np.zeros(t, np.float32),
        versions=np.asarray(versions, np.int64),
        terminated=False,
        episode_done=False,
        success=False,
    )


def ids(batch: list[Segment]) -> list[int]:
    return [s.episode for s in batch]


def books(stats: BufferStats, unit: str) -> tuple[int, int]:
    out = sum(getattr(stats, f"{k}_{unit}") for k in ("taken", "dropped_stale", "dropped_overflow"))
    return getattr(stats, f"put_{unit}"), out + getattr(stats, f"resident_{unit}")


def test_super_batch_is_the_oldest_whole_segments_reaching_min_steps():
    buf = ReplayBuffer(100, max_staleness=None)
    for ident, length in enumerate([3, 3, 1, 2]):
        buf.put(segment(ident, [0] * length))
    assert ids(buf.get(min_steps=5, trainer_version=0)) == [0, 1]  # 3 + 3 >= 5
    assert ids(buf.get(min_steps=1, trainer_version=0)) == [2]
    stats = buf.stats()
    assert stats.taken_steps == 7 and stats.taken_segments == 3
    assert stats.resident_steps == 2 and stats.occupancy == pytest.approx(0.02)


def test_overflow_evicts_the_oldest_segments_and_counts_their_steps():
    buf = ReplayBuffer(6, max_staleness=None)
    buf.put(segment(0, [0, 0, 0]))
    buf.put(segment(1, [0, 0, 0]))
    buf.put(segment(2, [0, 0]))  # 8 > 6: segment 0 goes
    buf.put(segment(3, [0] * 7))  # longer than the whole buffer: dropped itself
    stats = buf.stats()
    assert stats.dropped_overflow_steps == 3 + 7 and stats.dropped_overflow_segments == 2
    assert stats.resident_steps == 5
    assert ids(buf.get(min_steps=5, trainer_version=0)) == [1, 2]


def test_stale_segments_are_dropped_by_their_oldest_action_version():
    buf = ReplayBuffer(100, max_staleness=2)
    for ident, versions in enumerate([[5, 6], [3, 4], [4, 4], [6, 6]]):
        buf.put(segment(ident, versions))
    # trainer 6, max lag 2: oldest allowed version is 4, so segment 1 (oldest action 3) goes
    assert ids(buf.get(min_steps=2, trainer_version=6)) == [0]
    with pytest.raises(TimeoutError, match="2 of min_steps=4"):
        buf.get(min_steps=4, trainer_version=7, timeout_s=0.01)  # drops segment 2 (4 < 5)
    stats = buf.stats()
    assert stats.dropped_stale_steps == 4 and stats.dropped_stale_segments == 2
    assert stats.resident_steps == 2
    assert ids(buf.get(min_steps=2, trainer_version=7)) == [3]  # a timeout took nothing


class NaiveBuffer:
    """The reference: a list, scanned in full on every operation."""

    def __init__(self, capacity: int, max_staleness: int):
        self.capacity, self.max_staleness, self.items = capacity, max_staleness, []
        self.put = self.taken = self.stale = self.overflow = 0

    def add(self, seg: Segment) -> None:
        self.put += len(seg)
        self.items.append(seg)
        while sum(len(s) for s in self.items) > self.capacity:
            self.overflow += len(self.items.pop(0))

    def take(self, min_steps: int, version: int) -> list[int] | None:
        fresh = [s for s in self.items if min(s.versions) >= version - self.max_staleness]
        self.stale += sum(len(s) for s in self.items) - sum(len(s) for s in fresh)
        self.items = fresh
        if sum(len(s) for s in fresh) < min_steps:
            return None
        out = []
        while sum(len(s) for s in out) < min_steps:
            out.append(self.items.pop(0))
        self.taken += sum(len(s) for s in out)
        return ids(out)


def test_every_step_is_accounted_under_random_operations():
    rng = random.Random(0)
    buf, ref = ReplayBuffer(20, max_staleness=2), NaiveBuffer(20, max_staleness=2)
    trainer = 0
    for ident in range(400):
        if rng.random() < 0.6:
            length = rng.randint(1, 6)
            seg = segment(ident, sorted(rng.randint(trainer - 3, trainer) for _ in range(length)))
            buf.put(seg)
            ref.add(seg)
        else:
            min_steps = rng.randint(1, 12)
            expected = ref.take(min_steps, trainer)
            try:
                got = ids(buf.get(min_steps, trainer, timeout_s=0))
            except TimeoutError:
                got = None
            assert got == expected
            trainer += got is not None
        stats = buf.stats()
        assert books(stats, "steps")[0] == books(stats, "steps")[1]
        assert books(stats, "segments")[0] == books(stats, "segments")[1]
        assert (stats.put_steps, stats.taken_steps) == (ref.put, ref.taken)
        assert (stats.dropped_stale_steps, stats.dropped_overflow_steps) == (
            ref.stale,
            ref.overflow,
        )
    assert ref.taken and ref.stale and ref.overflow  # every path was exercised


def test_a_waiting_reader_wakes_when_enough_steps_arrive_and_writers_pass():
    buf = ReplayBuffer(10, max_staleness=None)
    out: list = []
    reader = threading.Thread(target=lambda: out.append(buf.get(4, 0, timeout_s=10)))
    reader.start()
    buf.put(segment(0, [0, 0]))
    reader.join(0.05)
    assert reader.is_alive()  # 2 of 4 steps: still waiting, and the writer got through
    buf.put(segment(1, [0, 0]))
    reader.join(10)
    assert ids(out[0]) == [0, 1]


def test_close_wakes_a_waiting_reader():
    buf = ReplayBuffer(10, max_staleness=None)
    errors: list = []

    def read() -> None:
        try:
            buf.get(4, 0)
        except ReplayBufferClosed as err:
            errors.append(err)

    reader = threading.Thread(target=read)
    reader.start()
    buf.close()
    reader.join(10)
    assert len(errors) == 1


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="capacity_steps must be >= 1, got 0"):
        ReplayBuffer(0, max_staleness=None)
    with pytest.raises(ValueError, match=r"min_steps must be in \[1, capacity_steps=5\], got 6"):
        ReplayBuffer(5, max_staleness=None).get(6, 0)
    with pytest.raises(ValueError, match=r"wait_at must be in \[1, capacity_steps=5\], got 6"):
        ReplayBuffer(5, max_staleness=None, wait_at=6)


def test_with_wait_at_a_writer_waits_for_room_until_a_get_takes_or_asks_or_close():
    buffer = ReplayBuffer(16, max_staleness=1, wait_at=6)
    assert buffer.put_many([segment(0, [5, 5]), segment(1, [5, 5])]) is False  # 4 of 6 steps
    assert buffer.wait_for_room(timeout_s=0) is True
    assert buffer.put_many([segment(2, [5, 5])]) is True  # 6 steps: the writer should wait
    assert buffer.wait_for_room(timeout_s=0.05) is False  # still full after the timeout
    assert buffer.put_many([segment(3, [5, 5])]) is True  # puts never block, even when full

    woke = []
    writer = threading.Thread(target=lambda: woke.append(buffer.wait_for_room()))
    writer.start()
    writer.join(0.2)
    assert writer.is_alive()  # 8 steps held: no room yet
    assert ids(buffer.get(4, trainer_version=5)) == [0, 1]  # 4 steps left: room
    writer.join(5)
    assert woke == [True]

    assert buffer.put_many([segment(4, [6, 6])]) is True  # 6 steps again
    waiter = threading.Thread(target=lambda: woke.append(buffer.wait_for_room()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    # A get that asks for more than the buffer holds gives the writers room: they make the
    # batch the trainer waits for, however many steps wait_at allows.
    taken = []
    reader = threading.Thread(target=lambda: taken.append(buffer.get(8, trainer_version=6)))
    reader.start()
    waiter.join(5)
    assert woke == [True, True]
    assert buffer.put_many([segment(5, [6, 6])]) is False  # 8 steps, but the reader asked
    reader.join(5)
    assert [ids(batch) for batch in taken] == [[2, 3, 4, 5]]

    buffer.put_many([segment(6, [7, 7] * 3)])  # 6 steps
    closing = threading.Thread(target=lambda: woke.append(buffer.wait_for_room()))
    closing.start()
    buffer.close()
    closing.join(5)
    assert woke == [True, True, True]
    stats = buffer.stats()
    assert stats.writer_wait_s > 0.05 and stats.resident_max_steps == 8
    assert stats.put_steps == stats.taken_steps + 6


def test_without_wait_at_a_writer_never_waits():
    buffer = ReplayBuffer(4, max_staleness=None)
    assert buffer.put_many([segment(i, [0, 0]) for i in range(3)]) is False  # overflow evicts
    assert buffer.wait_for_room(timeout_s=0) is True
    assert buffer.stats().dropped_overflow_steps == 2
