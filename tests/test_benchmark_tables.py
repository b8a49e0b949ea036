"""docs/benchmarks.md's rendered tables equal what benchmarks/render_tables.py makes of the result
JSON, and the renderer reads the numbers it is given."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import render_tables  # noqa: E402


@pytest.mark.parametrize("name", sorted(render_tables.TABLES))
def test_each_rendered_table_in_the_doc_equals_its_rendering(name):
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    held = render_tables.in_doc(doc, name)
    assert held is not None, f"docs/benchmarks.md lacks the markers of table {name}"
    assert held == render_tables.render(name), (
        f"table {name} is stale: python benchmarks/render_tables.py --write"
    )


def test_the_held_out_rows_show_percent_and_the_signed_gain():
    result = {
        "runs": {
            "rule": {"start_accuracy": 0.2, "final_accuracy": 0.905},
            "reward_model": {"start_accuracy": 0.2, "final_accuracy": 0.15},
        }
    }
    rows = render_tables.reward_model(result).splitlines()
    assert rows[2] == "| rule | 20.0 | 90.5 | +70.5 |"
    assert rows[3] == "| reward model alone | 20.0 | 15.0 | -5.0 |"


def test_a_pool_without_counters_shows_dashes_and_a_rate_in_whole_pairs():
    result = {
        "runs": [
            {"setting": "in-process", "pairs_per_s": 1952.6, "counters": None},
            {"setting": "1 worker", "pairs_per_s": 10.4, "counters": {"timeouts": 3, "errors": 1}},
        ]
    }
    rows = render_tables.math_scoring(result).splitlines()
    assert rows[2] == "| in the calling process (no sandbox) | 1953 | – | – |"
    assert rows[3] == "| `ScoringPool`, 1 worker | 10 | 3 | 1 |"
