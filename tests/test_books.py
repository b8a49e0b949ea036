"""The books: ``Books.check`` with hand-derived numbers, the typed stats they are summed from, the
embodied summary's books from stats, and guards that no ``stats()`` result, nor a loop's result, is
read by string."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

import relayrl
import relayrl.types
from relayrl.controller import LOOPS
from relayrl.executors.replay_buffer import ReplayBuffer
from relayrl.observability.books import Books, BooksUnbalanced
from relayrl.observability.metrics import Failure, RunTally
from relayrl.types import (
    BufferStats,
    ImaginedCounts,
    LoopEnd,
    TaskCounts,
    TrainerStats,
    WorkerStats,
)
from relayrl.workloads import EmbodiedWorkload, LLMWorkload, Workload
from relayrl.workloads.embodied_summary import EmbodiedStats, books, imagined_waste

SOURCE = Path(relayrl.__file__).parent


def balanced() -> Books:
    # 70 + (10 + 5) + 3 + (8 + 4) = 100
    return Books(
        unit="env_steps",
        generated=100,
        trained=70,
        dropped={"stale": 10, "overflow": 5},
        lost=3,
        in_flight={"resident": 8, "open": 4},
        beside={"lost_unfinished": 2},
    )


def test_balanced_books_check_and_render_todays_keys():
    books = balanced()
    books.check()
    assert books.gap == 0 and books.imbalance() is None
    assert books.section() == {
        "unit": "env_steps",
        "generated": 100,
        "trained": 70,
        "dropped_stale": 10,
        "dropped_overflow": 5,
        "lost": 3,
        "in_flight": 12,
        "in_flight_resident": 8,
        "in_flight_open": 4,
        "accounted": True,
        "lost_unfinished": 2,
    }


def test_unbalanced_books_name_the_gap_and_every_term():
    more = Books("env_steps", 102, 70, {"stale": 10, "overflow": 5}, 3, {"resident": 8, "open": 4})
    assert more.gap == 2 and more.section()["accounted"] is False
    with pytest.raises(BooksUnbalanced) as err:
        more.check()
    assert str(err.value) == (
        "2 more env_steps generated (102) than accounted for: trained 70 + dropped_stale 10 + "
        "dropped_overflow 5 + lost 3 + in_flight_resident 8 + in_flight_open 4"
    )
    fewer = Books("samples", 10, 9, {"stale": 2})
    assert fewer.gap == -1
    with pytest.raises(BooksUnbalanced, match=r"^1 fewer samples generated \(10\)"):
        fewer.check()


def test_books_with_in_flight_unknown_cannot_be_checked_and_claim_nothing():
    books = Books("samples", 10, 6, {"stale": 1, "resume": 0}, lost=2, in_flight=None)
    assert books.gap is None
    with pytest.raises(BooksUnbalanced, match="in flight are unknown"):
        books.check()
    section = books.section()
    assert "accounted" not in section and "in_flight" not in section
    assert section["dropped_resume"] == 0 and section["lost"] == 2


def test_the_controllers_tally_renders_an_llm_runs_books():
    tally = RunTally(steps=1, progress=False)
    tally.generated, tally.trained, tally.dropped_stale, tally.dropped_resume = 64, 40, 8, 4
    tally.on_failure(Failure("generator", "generator_0", 0.0, 0, "died", lost=4, unfinished=3))
    # 40 + 8 + 4 + 4 + 8 in flight = 64
    section = tally.books(in_flight={"pipeline": 8}, lost_unfinished=3).section()
    assert section["accounted"] and section["in_flight"] == 8 and section["lost"] == 4
    assert section["lost_unfinished"] == 3
    partial = tally.books().section()  # a failed run: what was in flight is unknown
    assert set(partial) == {
        "unit",
        "generated",
        "trained",
        "dropped_stale",
        "dropped_resume",
        "lost",
    }


def ranks() -> list[TrainerStats]:
    return [
        TrainerStats(3, 1.0, 0, trained=10, dropped_stale=2, imagined_trained=5),
        TrainerStats(3, 1.0, 0, trained=7, imagined_trained=4, imagined_dropped_stale=1),
    ]


def buffer_stats(**counts: int) -> BufferStats:
    zero = {f: 0 for f in BufferStats.__dataclass_fields__ if f not in ("occupancy", "workers")}
    return BufferStats(
        **(zero | {"reader_wait_s": 0.0, "writer_wait_s": 0.0} | counts), occupancy=0
    )


def test_trainer_ranks_received_and_a_buffers_unreceived_steps_add_up_by_source():
    assert TrainerStats.received(ranks()) == 10 + 2 + 7
    assert TrainerStats.received(ranks(), imagined=True) == 5 + 4 + 1
    assert buffer_stats(taken_steps=25).unreceived(ranks()) == 25 - 19
    # 4 of them were taken before a checkpoint a resume continued from, and booked dropped then
    assert buffer_stats(taken_steps=25).unreceived(ranks(), booked=4) == 25 - 19 - 4
    assert buffer_stats(taken_steps=12).unreceived(ranks(), imagined=True) == 12 - 10


def worker(
    env_steps: int, error: int, open_steps: int, tasks: dict, imagined: ImaginedCounts | None = None
) -> WorkerStats:
    return WorkerStats(
        env_steps=env_steps,
        segments=0,
        segment_steps=env_steps - error - open_steps,
        episodes=sum(t.episodes for t in tasks.values()),
        env_errors=int(error > 0),
        dropped_error_steps=error,
        open_steps=open_steps,
        tasks=tasks,
        last_errors=[],
        busy_s=0.0,
        wait_s=0.0,
        sink_wait_s=0.0,
        imagined=imagined or ImaginedCounts(),
    )


def test_workers_task_counts_add_up_per_task():
    workers = [
        worker(10, 0, 0, {"a": TaskCounts(2, 1), "b": TaskCounts(1, 1)}),
        worker(10, 0, 0, {"a": TaskCounts(3, 3)}),
    ]
    tasks = WorkerStats.tasks_of(workers)
    assert tasks == {"a": TaskCounts(5, 4), "b": TaskCounts(1, 1)}
    assert tasks["a"].success_rate == 0.8 and TaskCounts().success_rate == 0.0


def test_embodied_books_from_stats_balance_with_a_dead_worker_and_a_fetch_ahead():
    tally = RunTally(steps=1, progress=False)
    tally.dropped_resume, tally.imagined_dropped_resume = 1, 2
    tally.on_failure(Failure("rollout_worker", "rollout_worker_0", 0.0, 0, "died", 1, 5))
    found = EmbodiedStats(
        workers=[
            worker(40, 3, 2, {}, ImaginedCounts(steps=30, episodes=4, successes=1)),
            worker(30, 0, 5, {}, ImaginedCounts(steps=20, episodes=6, successes=2)),
        ],
        trainers=[
            TrainerStats(3, 1.0, 0, trained=30, dropped_stale=2, imagined_trained=5),
            TrainerStats(3, 1.0, 0, trained=24, imagined_trained=4, imagined_dropped_stale=1),
        ],
        services=[],
        buffer=buffer_stats(
            taken_steps=61, dropped_stale_steps=2, dropped_overflow_steps=3, resident_steps=9
        ),
        imagined_buffer=buffer_stats(
            put_steps=40, taken_steps=16, dropped_overflow_steps=6, resident_steps=18
        ),
    )
    # Taken, less received by the ranks, less booked as dropped_resume (1 real, 2 imagined).
    assert found.unreceived(tally) == (61 - 56 - 1, 16 - 10 - 2)
    # A dead worker (id 7) closed its last segment at 20 env steps, 4 of them env-error drops.
    by_section = books(tally, found, {7: (20, 4)}, found.unreceived(tally))
    real = by_section["samples"]
    # generated 40 + 30 + 20 = 90 = 54 trained + (2 + 2) stale + 3 overflow + (3 + 4) error
    #   + 1 resume + 1 lost + 9 resident + 4 prefetched + (2 + 5) open
    assert real.generated == 90 and real.trained == 54
    assert real.dropped == {"stale": 4, "overflow": 3, "error": 7, "resume": 1}
    assert real.in_flight == {"resident": 9, "prefetched": 4, "open": 7}
    real.check()
    section = real.section()
    assert section["lost_unfinished"] == 5 and section["accounted"] is True
    assert set(section) == {
        "unit",
        "generated",
        "trained",
        "dropped_stale",
        "dropped_overflow",
        "dropped_error",
        "dropped_resume",
        "lost",
        "lost_unfinished",
        "in_flight",
        "in_flight_resident",
        "in_flight_prefetched",
        "in_flight_open",
        "accounted",
    }
    imagined = by_section["imagined_samples"]
    # put 40 = 9 trained + 1 stale + 6 overflow + 2 resume + 18 resident + 4 prefetched
    imagined.check()
    section = imagined.section()
    assert (section["trained"], section["dropped_stale"], section["in_flight"]) == (9, 1, 22)
    assert section["episodes"] == 10 and section["success_rate"] == 0.3
    assert section["by_live_workers"] == 50
    # One env step more that no executor counts is a gap the books name.
    more = books(tally, found, {7: (21, 4)}, found.unreceived(tally))["samples"]
    with pytest.raises(BooksUnbalanced, match="^1 more env_steps generated"):
        more.check()


def test_embodied_books_balance_when_the_ranks_trained_what_was_taken():
    tally = RunTally(steps=1, progress=False)
    found = EmbodiedStats(
        workers=[worker(12, 2, 1, {})],
        trainers=[TrainerStats(1, 0.0, 0, trained=5, dropped_stale=1)],
        services=[],
        buffer=buffer_stats(taken_steps=8, resident_steps=1),
    )
    # 12 = 5 trained + 1 stale + 2 error + 1 resident + (8 - 6) prefetched + 1 open
    by_section = books(tally, found, {}, found.unreceived(tally))
    assert set(by_section) == {"samples"}
    by_section["samples"].check()


def test_a_replay_buffers_stats_are_frozen_and_typed():
    buffer = ReplayBuffer(10, max_staleness=None)
    stats = buffer.stats()
    assert isinstance(stats, BufferStats) and stats.put_steps == 0
    with pytest.raises(AttributeError):
        stats.put_steps = 1  # type: ignore[misc]


def test_a_run_that_drops_most_imagined_steps_untrained_says_which_knobs_balance_them():
    def imagined(overflow: int, stale: int, generated: int = 100) -> Books:
        return Books("imagined_env_steps", generated, 0, {"stale": stale, "overflow": overflow})

    warning = imagined_waste(imagined(20, 10))
    assert warning is not None and warning.startswith("30% of the 100 imagined env steps")
    assert "20 overflowed imagination.buffer_steps, 10 aged past max_staleness" in warning
    assert "imagination.episodes_per_real" in warning
    assert imagined_waste(imagined(20, 5)) is None  # 25%: fine
    assert imagined_waste(imagined(0, 0, generated=0)) is None


def _stats_call(node: ast.AST) -> bool:
    """``x.stats()`` or ``x.stats.remote()``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    func = node.func
    return func.attr == "stats" or (
        func.attr == "remote"
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "stats"
    )


def _yields_stats(node: ast.AST, names: set[str]) -> bool:
    """Whether expression ``node`` is a stats result, or a list of them: a stats call, a name
    bound to one, awaited, passed through ``ray.get``/``asyncio.gather``, or listed."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, (ast.Await, ast.Starred)):
        return _yields_stats(node.value, names)
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_yields_stats(e, names) for e in node.elts)
    if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
        return _yields_stats(node.elt, names)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("get", "gather") and not isinstance(node.func.value, ast.Name):
            return False  # a dict's or an object's get, not ray's
        if node.func.attr in ("get", "gather"):
            return any(_yields_stats(a, names) for a in node.args)
    return _stats_call(node)


def string_reads_of_stats(source: str) -> list[int]:
    """Lines of ``source`` that read a ``stats()`` result by a string key (``s["version"]``,
    ``s.get("x")``), following the names bound to results or lists of them and the loop
    variables over those."""
    tree = ast.parse(source)
    names: set[str] = set()
    for _ in range(3):  # a name bound from another one found later in the walk
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _yields_stats(node.value, names):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif (
                isinstance(node, (ast.For, ast.comprehension))
                and _yields_stats(node.iter, names)
                and isinstance(node.target, ast.Name)
            ):
                names.add(node.target.id)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant | ast.JoinedStr):
            keyed = not isinstance(node.slice, ast.Constant) or isinstance(node.slice.value, str)
            if keyed and _yields_stats(node.value, names):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and _yields_stats(node.func.value, names)
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_guard_finds_string_reads_of_stats_through_names_lists_and_loops():
    source = """
async def f(w, ray):
    version = (await w.trainer[0].stats.remote())["version"]
    buffer = await w.replay_buffer.stats.remote()
    workers = ray.get([x.stats.remote() for x in w.workers])
    for s in workers:
        print(s["tasks"])
    total = sum(t["trained"] for t in workers)
    found = buffer.get("workers")
    fine = buffer.put_steps + w.sync_stats()["stall"] + w.cfg["stats"]
"""
    assert string_reads_of_stats(source) == [3, 7, 8, 9]


def test_no_stats_result_is_read_by_a_string_key_in_the_package():
    found = {
        str(path.relative_to(SOURCE)): lines
        for path in sorted(SOURCE.rglob("*.py"))
        if (lines := string_reads_of_stats(path.read_text()))
    }
    assert found == {}, f"stats() results read by string key (file: lines): {found}"


def test_every_executors_stats_returns_a_frozen_dataclass_of_types():
    annotated = {}
    for path in sorted((SOURCE / "executors").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "stats":
                annotated[f"{path.stem}:{node.lineno}"] = ast.unparse(node.returns)
    assert len(annotated) >= 9  # trainer core, policy core, VLA, world model, buffer, worker, ...
    for where, name in annotated.items():
        cls = getattr(relayrl.types, name, None)
        assert dataclasses.is_dataclass(cls), f"{where}: stats() returns {name}"
        assert cls.__dataclass_params__.frozen, f"{where}: {name} is not frozen"


def test_every_loop_hands_finish_a_frozen_loop_end_that_has_no_string_keys():
    for key, loop in LOOPS.items():
        assert typing.get_type_hints(loop)["return"] is LoopEnd, key
    for workload in (Workload, LLMWorkload, EmbodiedWorkload):
        assert typing.get_type_hints(workload.finish)["loop"] is LoopEnd, workload.__name__
    end = LoopEnd(prefetched=3, occupancy=(0.5, 0.25))
    with pytest.raises(TypeError):
        end["prefetched"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        end.prefetched = 0  # type: ignore[misc]
    assert (end.in_flight, end.prefetched_imagined) == (0, 0)
