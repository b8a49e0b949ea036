"""docs/benchmarks.md's rendered tables equal what benchmarks/render_tables.py makes of the result
JSON, the renderer reads the numbers it is given, and result files keep what tables quote."""

from __future__ import annotations

import json
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


def test_result_files_keep_records_exact_and_curves_as_they_show_to_four_decimals():
    from common import dumps

    half_way, curve = 0.49500000000000005, [0.123456789, 454.8499650042963, 1796145476.0384889]
    result = {"runs": [{"mean": half_way}], "curve": [half_way, *curve, 7.0]}
    text = dumps(result)
    back = json.loads(text)
    assert back["runs"][0]["mean"] == half_way  # a record's number: exact
    assert back["curve"][1] == 0.1235  # 4 significant digits where that shows the same
    for old, new in zip(result["curve"], back["curve"], strict=True):
        assert all(f"{old:.{k}f}" == f"{new:.{k}f}" for k in range(5)), (old, new)
    assert '"runs": [\n    {"mean": 0.49500000000000005}\n  ]' in text  # one line per record


def test_a_coarse_curve_keeps_at_most_the_points_asked_with_its_first_and_last():
    from common import coarse

    curve = [[step, step / 400] for step in range(1, 401)]
    kept = coarse(curve, 50)
    assert len(kept) <= 50 and kept[0] == curve[0] and kept[-1] == curve[-1]
    assert [step for step, _ in kept[:3]] == [1, 10, 19]  # every 9th: ceil(399 / 49)
    assert coarse(curve[:30], 50) == curve[:30]


def test_a_shrunk_png_keeps_the_few_pixels_of_each_saturated_colour(tmp_path):
    import numpy as np
    from common import shrink_png
    from PIL import Image

    pixels = np.full((120, 200, 3), 255, np.uint8)
    for i in range(100):  # a hundred greys, as antialiased lines or a frame's floor give
        pixels[:, 2 * i : 2 * i + 2] = 40 + 2 * i
    marks = {(10, 10): (220, 40, 40), (30, 30): (40, 160, 40), (50, 50): (50, 50, 230)}
    for (row, col), colour in marks.items():  # an agent, a box, a key: 3 x 3 pixels each
        pixels[row : row + 3, col : col + 3] = colour
    path = tmp_path / "plot.png"
    Image.fromarray(pixels).save(path)

    with Image.open(shrink_png(path)) as shrunk:
        assert shrunk.mode == "P" and len(shrunk.getcolors()) <= 32
        rgb = shrunk.convert("RGB")
        for (row, col), colour in marks.items():
            kept = rgb.getpixel((col + 1, row + 1))
            assert all(abs(a - b) <= 16 for a, b in zip(kept, colour, strict=True)), (colour, kept)
