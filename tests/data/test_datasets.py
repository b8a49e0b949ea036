"""Dataset loaders: the benchmark files, users' JSONL/Parquet files, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.data.datasets import (
    DATASETS,
    Example,
    RowError,
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


def test_errors_name_the_file_the_line_and_the_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(RowError, match="bad.jsonl line 2: no field 'answer'; the row has: prompt"):
        load_examples(path)
    with pytest.raises(RowError, match="line 2: the template names field 'nope'") as info:
        load_examples(path, answer_field="prompt", template="{nope}")
    assert info.value.argument == "template"
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl line 1: not valid JSON"):
        load_examples(path)
    path.write_text("[1]\n")
    with pytest.raises(ValueError, match="bad.jsonl line 1: an array, not a JSON object"):
        load_examples(path)
    (tmp_path / "x.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unknown format '.csv'; allowed: .jsonl, .parquet"):
        load_examples(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="dataset file '.*missing.jsonl' not found"):
        load_examples(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="without a '####' line"):
        gsm8k_final_answer("no marker")


def test_gsm8k_answer_without_marker_names_its_line(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(RowError, match="gsm.jsonl line 1: GSM8K answer without a '####' line"):
        load_gsm8k(path)


def test_missing_benchmark_file_says_where_benchmarks_are_read_from(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="math500_test.jsonl' not found.*RELAYRL_DATA_DIR"):
        load_math500()


def test_rows_split_at_newlines_only_and_a_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "bom.jsonl"
    row = {"prompt": "a\u2028b\x85c", "answer": "1"}
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(row, ensure_ascii=False).encode() + b"\r\n")
    assert load_examples(path) == [Example("a\u2028b\x85c", "1", {})]


def test_missing_relative_path_names_the_directory_it_is_resolved_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        load_examples("mine.jsonl")
    assert str(info.value) == f"dataset file 'mine.jsonl' (relative to {tmp_path}) not found"
