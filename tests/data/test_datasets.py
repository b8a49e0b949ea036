"""Dataset loaders: the benchmark files, users' JSONL/Parquet files, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.data.datasets import (
    DATASETS,
    Example,
    gsm8k_final_answer,
    load_examples,
    load_gsm8k,
    load_math500,
)
from relayrl.rewards.math import score

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_data = pytest.mark.skipif(
    not (SHARED / "math500_test.jsonl").is_file(),
    reason=f"{SHARED} not found: the evaluation data lives in ../shared/data",
)


@needs_data
def test_math500_loads_all_rows_with_template_and_metadata():
    examples = load_math500(SHARED / "math500_test.jsonl")
    assert len(examples) == 500
    first = examples[0]
    assert first.prompt.startswith("Convert the point $(0,3)$")
    assert first.prompt.endswith("Put the final answer in \\boxed{}.")
    assert set(first.meta) == {"subject", "level", "unique_id"}
    assert score("so \\boxed{" + first.answer + "}", first.answer) == 1.0


@needs_data
def test_gsm8k_reference_is_the_number_after_the_marker():
    examples = load_gsm8k(SHARED / "gsm8k_test.jsonl")
    assert len(examples) == 1319
    assert examples[0].answer == "18"  # Janet's ducks: (16 - 3 - 4) * 2
    assert set(DATASETS) == {"math500", "gsm8k"}


def test_user_jsonl_with_own_fields_and_template(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"q": "1+1?", "a": " 2 ", "topic": "sums"}, {"q": "2+2?", "a": "4", "topic": "sums"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    examples = load_examples(
        path, prompt_field="q", answer_field="a", template="Q: {q}\nA:", meta_fields=("topic",)
    )
    assert examples == [
        Example("Q: 1+1?\nA:", "2", {"topic": "sums"}),
        Example("Q: 2+2?\nA:", "4", {"topic": "sums"}),
    ]


def test_user_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"prompt": ["3+4="], "answer": ["7"]}), path)
    assert load_examples(path) == [Example("3+4=", "7", {})]


def test_errors_name_the_file_the_row_and_the_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="row 1 has no field 'answer'; fields: prompt"):
        load_examples(path)
    with pytest.raises(ValueError, match="template field 'nope'"):
        load_examples(path, answer_field="prompt", template="{nope}")
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        load_examples(path)
    (tmp_path / "x.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unknown format '.csv'; allowed: .jsonl, .parquet"):
        load_examples(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="RELAYRL_DATA_DIR"):
        load_examples(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="without a '####' line"):
        gsm8k_final_answer("no marker")
