"""Where the test suite's time goes: a pytest plugin that records, per test, wall time, machine-wide
busy CPU seconds (from /proc/stat) and the Ray worker processes seen (sampled every 0.25 s).

    PYTHONPATH=experiments pytest -q -p suite_cpu tests/test_controller.py tests/test_embodied.py \
        tests/test_recovery.py tests/test_resume.py
    python experiments/suite_cpu.py          # summarise, and time each actor module's import

Run it on an idle machine: the CPU figures are machine-wide.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

IMPORTS = [
    "relayrl.executors.trainer",
    "relayrl.executors.generator",
    "relayrl.executors.inference_service",
    "relayrl.executors.rewarder",
    "relayrl.executors.rollout_worker",
    "ray",
    "torch",
    "transformers",
]

ROWS = Path("/tmp/relayrl-suite-cpu.jsonl")
RESULT = Path(__file__).parent / "results" / "suite_cpu.json"


def busy_cpu_s() -> float:
    """Machine-wide busy CPU seconds since boot."""
    fields = list(map(int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]))
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class RayProcesses(threading.Thread):
    """The pids of Ray worker processes (``ray::...``) seen while it runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.pids: set[str] = set()
        self.running = True

    def run(self) -> None:
        """Sample /proc every 0.25 s until stopped."""
        while self.running:
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    if (proc / "cmdline").read_bytes().startswith(b"ray::"):
                        self.pids.add(proc.name)
                except OSError:
                    continue
            time.sleep(0.25)


def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Start measuring a test."""
    sampler = RayProcesses()
    sampler.start()
    item.stash[KEY] = (sampler, busy_cpu_s(), time.time())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """After a test's teardown, append its row."""
    yield
    if call.when == "teardown" and KEY in item.stash:
        sampler, cpu0, t0 = item.stash[KEY]
        sampler.running = False
        row = {"test": item.nodeid, "wall": round(time.time() - t0, 1)}
        row |= {"cpu": round(busy_cpu_s() - cpu0, 1), "ray_procs": len(sampler.pids)}
        with ROWS.open("a") as out:
            out.write(json.dumps(row) + "\n")


KEY = pytest.StashKey[tuple]()


def import_cpu_s(module: str) -> float:
    """User CPU seconds of a fresh ``python -c "import MODULE"``, as each actor process pays it."""
    before = os.times().children_user
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return round(os.times().children_user - before, 2)


def summarise() -> dict:
    """Per-module sums of the recorded rows, with the machine and commit."""
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()]
    modules: dict[str, dict] = collections.defaultdict(
        lambda: dict.fromkeys(("tests", "wall", "cpu", "ray_procs"), 0)
    )
    for row in rows:
        m = modules[row["test"].split("::")[0]]
        m["tests"] += 1
        for key in ("wall", "cpu", "ray_procs"):
            m[key] = round(m[key] + row[key], 1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {
        "command": "PYTHONPATH=experiments pytest -q -p suite_cpu " + " ".join(modules),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "git": {"commit": commit.stdout.strip()},
        "modules": dict(modules),
        "import_user_cpu_s": {module: import_cpu_s(module) for module in IMPORTS},
        "tests": rows,
    }


if __name__ == "__main__":
    RESULT.write_text(json.dumps(summarise(), indent=1) + "\n")
    print(RESULT, file=sys.stderr)
