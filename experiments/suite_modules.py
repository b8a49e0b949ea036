"""The test suite's wall time by module, from pytest's JUnit XML, as a JSON result.

    CI=true PYTEST_ADDOPTS="--junitxml=/tmp/junit.xml" bash .ci/run < /dev/null
    python experiments/suite_modules.py /tmp/junit.xml --ci-total-s 1312

Writes experiments/results/suite_modules.json: the pytest total, the number of tests, each
module's wall seconds and test count (largest first), the commit and the machine. Run the suite on
an idle machine: it is CPU-bound, so other load stretches every module.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "suite_modules.json"
COMMAND = 'CI=true PYTEST_ADDOPTS="--junitxml=JUNIT" bash .ci/run < /dev/null (fresh clone)'


def summarise(junit: Path) -> dict:
    """Module totals (seconds, tests) and the suite's total from a JUnit XML file."""
    root = ET.parse(junit).getroot()
    seconds: collections.Counter[str] = collections.Counter()
    tests: collections.Counter[str] = collections.Counter()
    failures = 0
    for case in root.iter("testcase"):
        module = case.get("classname", "?").replace(".", "/") + ".py"
        seconds[module] += float(case.get("time", 0))
        tests[module] += 1
        failures += sum(1 for child in case if child.tag in ("failure", "error"))
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {
        "pytest_s": round(float(suite.get("time", 0)), 1),
        "tests": sum(tests.values()),
        "failed": failures,
        "modules": [
            {"module": m, "s": round(s, 1), "tests": tests[m]} for m, s in seconds.most_common()
        ],
    }


def main() -> None:
    """Summarise a JUnit XML file into OUT."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--ci-total-s", type=float, help="the whole .ci/run, set-up included")
    parser.add_argument("--commit", help="the commit the suite ran at (default: HEAD)")
    parser.add_argument("--command", default=COMMAND, help="how the suite was run")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    commit = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    result = {
        "command": args.command,
        "commit": commit,
        "machine": {"cores": os.cpu_count(), "platform": platform.platform()},
        "ci_total_s": args.ci_total_s,
        **summarise(args.junit),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['tests']} tests, pytest {result['pytest_s']} s -> {args.out}")


if __name__ == "__main__":
    main()
