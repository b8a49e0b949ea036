"""ScoringPool: hostile model outputs and user rules score 0 within the time limit, the pool keeps
working, and no process or temp dir outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relayrl.rewards import sandbox
from relayrl.rewards.sandbox import ScoringPool

SCORER = "relayrl.rewards.math:_score_unbounded"
RULE = "scoring_rules:exact_or_loop"  # imports nothing: its server starts without sympy's ~0.5 s
TESTS = str(Path(__file__).parents[1])  # holds scoring_rules.py

TIMEOUT_S = 2.0
HUNG_S = 0.5  # the limit for calls whose items all hang or all score at once: no parser warms up
HANG_GUARD_S = TIMEOUT_S * 3 + 5  # not a performance bound: only proves nothing hangs
NORMAL = ("So $x = \\boxed{\\frac{1}{2}}$.", "0.5")


@pytest.fixture(scope="module")
def pool():
    with ScoringPool(SCORER, workers=2, timeout_s=TIMEOUT_S, memory_mb=1024) as pool:
        yield pool


def timed(
    pool: ScoringPool, pairs: list[tuple[str, str]], timeout_s: float | None = None
) -> tuple[list[float], float]:
    start = time.monotonic()
    scores = pool.score_batch(pairs, timeout_s)
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
    scores, elapsed = timed(pool, [(response, "1")], timeout_s=HUNG_S)
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
    with ScoringPool(RULE, workers=1, timeout_s=30.0) as pool:
        pid = pool._workers[0].pid
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        scores, elapsed = timed(pool, [("loop", "a")])
        assert scores == [0.0]
        assert elapsed < 10, "a dead worker must be noticed at once, not at the timeout"
        assert pool.counters == {"timeouts": 0, "errors": 1, "scored": 1}
        assert pool._workers[0].pid != pid
        assert pool.score_batch([("a", "a")]) == [1.0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/limits")
def test_an_item_beyond_the_memory_limit_kills_only_its_worker():
    # 200 MB of text cannot even be received by a worker limited to 256 MB of address space.
    with ScoringPool(SCORER, workers=1, timeout_s=TIMEOUT_S, memory_mb=256) as pool:
        pid = pool._workers[0].pid
        limits = Path(f"/proc/{pid}/limits").read_text()
        assert f"Max address space         {256 * 2**20}" in limits
        scores, elapsed = timed(pool, [("x" * 200_000_000, "1"), NORMAL])
        assert scores == [0.0, 1.0]
        assert elapsed < HANG_GUARD_S
        assert pool.counters["errors"] == 1


def test_a_closed_pool_refuses_work():
    pool = ScoringPool(RULE, workers=1)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.score_batch([NORMAL])


def run_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, from a script file with no main guard, whose temp dir
    is ``tmp_path`` (others' jobs share /tmp) and which can import scoring_rules. Its output goes
    to files, not pipes, so that a process it leaves behind cannot hold this test up."""
    script = tmp_path / "script.py"
    script.write_text(code)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": TESTS}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        returncode = subprocess.run(
            [sys.executable, str(script)], stdout=stdout, stderr=stderr, env=env, cwd=tmp_path
        ).returncode
    return subprocess.CompletedProcess(script, returncode, out.read_text(), err.read_text())


def alive(pid: int) -> bool:
    """Whether a process with this pid exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_calling_process_never_loads_the_parser(tmp_path):
    # Model output is parsed only in the workers: the parent does not even import sympy.
    code = (
        "import sys\n"
        "from relayrl.rewards.sandbox import ScoringPool\n"
        f"with ScoringPool({SCORER!r}, workers=1) as pool:\n"
        "    assert pool.score_batch([('\\\\boxed{2}', '2')]) == [1.0]\n"
        "parsers = ('sympy', 'math_verify', 'latex2sympy2_extended')\n"
        "loaded = [m for m in parsers if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_closed_pools_leave_no_process_and_no_temp_dir(tmp_path):
    # A script with no main guard opens pools (nested, twice) and the shared pool of score(). Once
    # a pool has closed, its server and workers are gone, reaped; nothing is ever written to the
    # temp dir (multiprocessing would leave a pymp-* directory when a Ray actor is killed).
    code = (
        "import json, os\n"
        "from pathlib import Path\n"
        "from relayrl.rewards.sandbox import ScoringPool\n"
        "def pids(pool): return [pool._server.pid] + [w.pid for w in pool._workers]\n"
        "def left(): return os.listdir(os.environ['TMPDIR'])\n"
        "def gone(pids): return not any(Path(f'/proc/{pid}').exists() for pid in pids)\n"
        "for _ in range(2):\n"
        f"    with ScoringPool({SCORER!r}, workers=2) as a, ScoringPool({SCORER!r}, 1) as b:\n"
        "        assert a.score_batch([('\\\\boxed{2}', '2')]) == [1.0]\n"
        "        first, second = pids(a), pids(b)\n"
        "        assert len(first) == 3 and not gone(first) and left() == [], left()\n"
        "        a.close()\n"
        "        assert gone(first) and not gone(second)\n"
        "        assert b.score_batch([('\\\\boxed{2}', '2')]) == [1.0]\n"
        "    assert gone(second) and left() == [], left()\n"
        "from relayrl.rewards.math import score\n"
        "assert score('\\\\boxed{2}', '2') == 1.0\n"
        "assert left() == []\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_caller_leaves_no_worker_behind(tmp_path):
    # A Ray actor is killed with SIGKILL, mid-batch: no exit handler runs. The server reads
    # end-of-file on its socket and kills its workers, the hung one included.
    marker = tmp_path / "hung"
    code = (
        "import json, os, signal, sys, threading\n"
        "from relayrl.rewards.sandbox import ScoringPool\n"
        "pool = ScoringPool('scoring_rules:touch_then_loop', workers=2, timeout_s=600)\n"
        "print(json.dumps([pool._server.pid] + [w.pid for w in pool._workers]), flush=True)\n"
        f"threading.Thread(target=pool.score_batch, args=([('x', {str(marker)!r})],)).start()\n"
        f"while not os.path.exists({str(marker)!r}):\n"
        "    pass\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert marker.exists(), "an item was in flight when the caller died"
    pids = json.loads(result.stdout)
    deadline = time.monotonic() + 60  # not a performance bound: only proves they go
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), [pid for pid in pids if alive(pid)]


def test_a_rule_that_loops_forever_scores_zero_and_is_counted():
    # Any scorer runs under the same limits and counters as the math one.
    with ScoringPool(RULE, workers=1, timeout_s=HUNG_S) as pool:
        scores, elapsed = timed(pool, [("a", "a"), ("loop", "a"), ("b", "a"), ("a", "a")])
        assert scores == [1.0, 0.0, 0.0, 1.0]
        assert elapsed < HANG_GUARD_S
        assert pool.counters == {"timeouts": 1, "errors": 0, "scored": 4}


@pytest.mark.parametrize(
    ("scorer", "message"),
    [
        ("nope.mod:fn", "scorer 'nope.mod:fn': no module named 'nope'"),
        ("scoring_rules:missing", "scorer 'scoring_rules:missing': module 'scoring_rules' has no"),
        ("scoring_rules:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not callable"),
        ("scoring_rules.exact_or_loop", "expected 'module:function'"),
        ("__main__:score", "workers cannot import the main script; use a module"),
    ],
)
def test_a_scorer_that_does_not_import_or_call_is_refused_naming_it(scorer, message):
    with pytest.raises(ValueError) as info:
        ScoringPool(scorer, workers=1)
    assert message.lower() in str(info.value).lower()
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_scorer_whose_import_hangs_is_refused_naming_it_and_stopped(tmp_path, monkeypatch):
    (tmp_path / "hangs_on_import.py").write_text("while True:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the server gets this process's sys.path
    monkeypatch.setattr(sandbox, "_START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(sandbox, "_STOP_TIMEOUT_S", 0.2)  # it never reads: close() kills it
    with pytest.raises(RuntimeError) as info:
        ScoringPool("hangs_on_import:score", workers=1)
    assert str(info.value) == (
        "scorer 'hangs_on_import:score': its server did not answer starting within 1 s"
    )
    servers = [  # the server's command line holds sys.path, so tmp_path
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit() and alive(int(pid)) and str(tmp_path) in cmdline(int(pid))
    ]
    assert servers == []


def cmdline(pid: int) -> str:
    """A process's command line, or "" if it has gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_score_in_forked_children_uses_their_own_pool(tmp_path):
    # A child forked after the parent used score() must not talk to the parent's worker or
    # server: it starts its own, bounded as well, and stops it when it exits. The parent's pool
    # keeps working.
    code = (
        "import multiprocessing, os\n"
        "from relayrl.rewards.math import score\n"
        "from relayrl.rewards.sandbox import _shared\n"
        "def job(queue):\n"
        "    scores = [score('\\\\boxed{3}', '3'), score(TOWER, '1', timeout_s=1)]\n"
        "    queue.put((scores, [pool._server.pid for pool in _shared.values()]))\n"
        "TOWER = '\\\\boxed{9^{9^{9^{9}}}}'\n"
        "assert score('\\\\boxed{2}', '2') == 1.0\n"
        "parent = [pool._server.pid for pool in _shared.values()]\n"
        "context = multiprocessing.get_context('fork')\n"
        "queue = context.Queue()\n"
        "children = [context.Process(target=job, args=(queue,)) for _ in range(2)]\n"
        "for child in children:\n"
        "    child.start()\n"
        "for child in children:\n"
        "    scores, servers = queue.get(timeout=120)  # one message per child\n"
        "    assert scores == [1.0, 0.0]\n"
        "    assert len(servers) == 1 and servers != parent, (servers, parent)\n"
        "for child in children:\n"
        "    child.join()\n"
        "    assert child.exitcode == 0\n"
        "assert [pool._server.pid for pool in _shared.values()] == parent\n"
        "assert score('\\\\boxed{2}', '2') == 1.0\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "tmp").iterdir()) == []
