"""ScoringPool: hostile model outputs score 0 within the time limit and the pool keeps working."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relayrl.rewards.sandbox import ScoringPool

TIMEOUT_S = 2.0
HANG_GUARD_S = TIMEOUT_S * 3 + 5  # not a performance bound: only proves nothing hangs
NORMAL = ("So $x = \\boxed{\\frac{1}{2}}$.", "0.5")


@pytest.fixture(scope="module")
def pool():
    with ScoringPool(workers=2, timeout_s=TIMEOUT_S, memory_mb=1024) as pool:
        yield pool


def timed(pool: ScoringPool, pairs: list[tuple[str, str]]) -> tuple[list[float], float]:
    start = time.monotonic()
    scores = pool.score_batch(pairs)
    return scores, time.monotonic() - start


def code_execution_payloads(marker_dir) -> list[str]:
    """Responses that would create a marker file if any parser eval'ed or sympified them."""
    touch = [f"touch {marker_dir / f'PWNED_{i}'}" for i in range(6)]
    return [
        f"\\boxed{{__import__('os').system('{touch[0]}')}}",
        f"The answer is __import__('os').system('{touch[1]}')",
        f"#### eval(\"__import__('os').system('{touch[2]}')\")",
        f"\\boxed{{\\text{{exec(\"import os; os.system('{touch[3]}')\")}}}}",
        # sympify-style: a Python expression that reaches os.system through attribute access
        f"\\boxed{{().__class__.__base__.__subclasses__()[0].__init__.__globals__"
        f"['sys'].modules['os'].system('{touch[4]}')}}",
        f"$\\boxed{{1}}$ and $x = __import__('subprocess').call(['sh', '-c', '{touch[5]}'])$",
    ]


def test_a_normal_batch_scores_in_order(pool):
    pairs = [("\\boxed{3}", "3"), ("\\boxed{4}", "3"), ("#### 1,600", "1600"), NORMAL] * 3
    assert pool.score_batch(pairs) == [1.0, 0.0, 1.0, 1.0] * 3
    assert pool.score_batch([]) == []


def test_code_execution_through_the_parser_has_no_side_effect(pool, tmp_path):
    payloads = code_execution_payloads(tmp_path)
    scores, elapsed = timed(pool, [(p, "0") for p in payloads] + [(p, p) for p in payloads])
    assert elapsed < HANG_GUARD_S * len(payloads)
    assert list(tmp_path.iterdir()) == [], "a payload was executed"
    assert scores[: len(payloads)] == [0.0] * len(payloads)


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{9^{9^{9^{9^{9}}}}}",
        "\\boxed{10^{10^{10}}}",
        "\\boxed{(10^{10})!}",
        "\\boxed{" + "1+" * 50_000 + "1}",  # 100,000 characters
        "\\boxed{" + "\\frac{1}{" * 5000 + "2" + "}" * 5000 + "}",
        "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    ],
    ids=["tower-5", "tower-3", "factorial", "100k-chars", "nested-frac", "nested-braces"],
)
def test_hostile_output_scores_zero_in_time_and_is_counted(pool, response):
    before = pool.counters
    scores, elapsed = timed(pool, [(response, "1")])
    after = pool.counters
    assert scores == [0.0]
    assert elapsed < HANG_GUARD_S
    assert after["scored"] == before["scored"] + 1
    assert after["timeouts"] + after["errors"] == before["timeouts"] + before["errors"] + 1
    assert pool.score_batch([NORMAL]) == [1.0], "the pool must keep working after a timeout"


def test_a_hung_item_does_not_hold_up_the_rest_of_the_batch(pool):
    tower = ("\\boxed{9^{9^{9^{9^{9}}}}}", "1")
    pairs = [NORMAL, tower, NORMAL, NORMAL, tower, NORMAL]
    before = pool.counters["timeouts"]
    scores, elapsed = timed(pool, pairs)
    assert scores == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert pool.counters["timeouts"] == before + 2
    assert elapsed < HANG_GUARD_S  # the two towers run side by side on the two workers


def test_a_worker_that_dies_mid_item_is_counted_and_replaced():
    # Stands in for a segfault or the kernel's OOM killer: the worker vanishes mid-item.
    with ScoringPool(workers=1, timeout_s=30.0) as pool:
        pid = pool._workers[0].process.pid
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        scores, elapsed = timed(pool, [("\\boxed{9^{9^{9^{9^{9}}}}}", "1")])
        assert scores == [0.0]
        assert elapsed < 10, "a dead worker must be noticed at once, not at the timeout"
        assert pool.counters == {"timeouts": 0, "errors": 1, "scored": 1}
        assert pool._workers[0].process.pid != pid
        assert pool.score_batch([NORMAL]) == [1.0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/limits")
def test_an_item_beyond_the_memory_limit_kills_only_its_worker():
    # 200 MB of text cannot even be received by a worker limited to 256 MB of address space.
    with ScoringPool(workers=1, timeout_s=TIMEOUT_S, memory_mb=256) as pool:
        pid = pool._workers[0].process.pid
        limits = Path(f"/proc/{pid}/limits").read_text()
        assert f"Max address space         {256 * 2**20}" in limits
        scores, elapsed = timed(pool, [("x" * 200_000_000, "1"), NORMAL])
        assert scores == [0.0, 1.0]
        assert elapsed < HANG_GUARD_S
        assert pool.counters["errors"] == 1


def test_a_closed_pool_refuses_work():
    pool = ScoringPool(workers=1)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.score_batch([NORMAL])


def test_the_calling_process_never_loads_the_parser():
    # Model output is parsed only in the workers: the parent does not even import sympy.
    code = (
        "import sys\n"
        "from relayrl.rewards.sandbox import ScoringPool\n"
        "if __name__ == '__main__':\n"
        "    with ScoringPool(workers=1) as pool:\n"
        "        assert pool.score_batch([('\\\\boxed{2}', '2')]) == [1.0]\n"
        "    loaded = [m for m in ('sympy', 'math_verify', 'latex2sympy2_extended')"
        " if m in sys.modules]\n"
        "    assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_closed_pools_leave_no_multiprocessing_temp_dirs(tmp_path):
    # In a fresh interpreter whose temp dir is tmp_path (others' jobs share /tmp). The forkserver
    # listens on a socket in a temp dir; multiprocessing would make it a pymp-* directory removed
    # only at a normal exit, which a killed Ray actor never reaches. After the last pool closes
    # (and, for score(), at exit) nothing is left, and a later pool starts a fresh forkserver.
    code = (
        "import os, sys\n"
        "from relayrl.rewards.sandbox import ScoringPool\n"
        "def left(): return sorted(os.listdir(os.environ['TMPDIR']))\n"
        "if __name__ == '__main__':\n"
        "    for _ in range(2):\n"
        "        with ScoringPool(workers=2) as a, ScoringPool(workers=1) as b:\n"
        "            assert a.score_batch([('\\\\boxed{2}', '2')]) == [1.0]\n"
        "            assert len(left()) == 1 and left()[0].startswith('relayrl-scoring-'), left()\n"
        "            a.close()\n"
        "            assert b.score_batch([('\\\\boxed{2}', '2')]) == [1.0]\n"
        "            assert len(left()) == 1, 'still in use by the second pool'\n"
        "        assert left() == [], left()\n"
        "    from relayrl.rewards.math import score\n"
        "    assert score('\\\\boxed{2}', '2') == 1.0\n"
        "    assert len(left()) == 1\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == [], "score()'s shared pool is closed at exit"


def test_score_in_forked_children_uses_their_own_pool(tmp_path):
    # A child forked after the parent used score() must not talk to the parent's worker or
    # forkserver: it starts its own, bounded as well, and removes it when it exits.
    code = (
        "import multiprocessing, os\n"
        "from relayrl.rewards.math import score\n"
        "def job(queue):\n"
        "    queue.put([score('\\\\boxed{3}', '3'), score(TOWER, '1', timeout_s=1)])\n"
        "TOWER = '\\\\boxed{9^{9^{9^{9}}}}'\n"
        "if __name__ == '__main__':\n"
        "    assert score('\\\\boxed{2}', '2') == 1.0\n"
        "    context = multiprocessing.get_context('fork')\n"
        "    queue = context.Queue()\n"
        "    children = [context.Process(target=job, args=(queue,)) for _ in range(2)]\n"
        "    for child in children:\n"
        "        child.start()\n"
        "    assert [queue.get(timeout=120) for _ in children] == [[1.0, 0.0]] * 2\n"
        "    for child in children:\n"
        "        child.join()\n"
        "        assert child.exitcode == 0\n"
        "    assert len(os.listdir(os.environ['TMPDIR'])) == 1, 'only the parent pool is left'\n"
        "    assert score('\\\\boxed{2}', '2') == 1.0\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == []
