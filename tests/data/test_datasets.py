"""Dataset loaders: the benchmark files, users' JSONL/Parquet files, hub datasets, clear errors."""

from __future__ import annotations

import gzip
import json
import sys
import types
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.config import ConfigError, load_config
from relayrl.data.datasets import (
    DATASETS,
    PACKAGED_DATA,
    Example,
    RowError,
    check_source,
    gsm8k_final_answer,
    load_examples,
    load_gsm8k,
    load_math500,
)
from relayrl.envs.dataset import DatasetTask, load_dataset_examples
from relayrl.rewards.math import score

REPO = Path(__file__).resolve().parents[2]

ALLOWED = (
    "allowed: math500, gsm8k, hf:NAME[:CONFIG][@SPLIT] (a Hugging Face hub dataset), or a file "
    "(.jsonl, .jsonl.gz, .parquet)"
)


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """No $RELAYRL_DATA_DIR, and a working directory with no ../shared/data beside it."""
    monkeypatch.delenv("RELAYRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)


def fake_datasets(monkeypatch, load_dataset) -> None:
    """Stand in for the Hugging Face ``datasets`` module: nothing reaches the hub in tests."""
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_math500_ships_with_the_package_all_rows_with_template_and_metadata(fresh_clone):
    examples = load_math500()
    assert len(examples) == 500
    first = examples[0]
    assert first.prompt.startswith("Convert the point $(0,3)$")
    assert first.prompt.endswith("Put the final answer in \\boxed{}.")
    assert set(first.meta) == {"subject", "level", "unique_id"}
    assert score("so \\boxed{" + first.answer + "}", first.answer) == 1.0


def test_gsm8k_ships_with_the_package_reference_is_the_number_after_the_marker(fresh_clone):
    examples = load_gsm8k()
    assert len(examples) == 1319
    assert examples[0].answer == "18"  # Janet's ducks: (16 - 3 - 4) * 2
    assert set(DATASETS) == {"math500", "gsm8k"}
    assert sorted(p.name for p in PACKAGED_DATA.glob("*.jsonl.gz")) == [
        "gsm8k_test.jsonl.gz",
        "math500_test.jsonl.gz",
    ]


def test_shipped_gsm8k_config_loads_1319_problems_and_holds_out_300(fresh_clone):
    cfg = load_config(REPO / "configs" / "gsm8k.yaml")
    examples = load_dataset_examples(cfg.task.data)
    assert len(examples) == 1319
    assert len(DatasetTask(examples, cfg.task.heldout_size).heldout()) == 300


def test_relayrl_data_dir_points_the_benchmarks_at_another_copy(tmp_path, monkeypatch):
    row = {"question": "Two and two?", "answer": "2 + 2 = 4\n#### 4"}
    (tmp_path / "gsm8k_test.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv("RELAYRL_DATA_DIR", str(tmp_path))
    examples = load_gsm8k()
    assert [e.answer for e in examples] == ["4"]
    assert examples[0].prompt.startswith("Two and two?\n")


def test_unknown_dataset_name_lists_the_allowed_ones_in_one_line():
    for name in ("math", "GSM8K"):
        with pytest.raises(ValueError) as info:
            check_source(name)
        assert str(info.value) == f"unknown dataset '{name}'; {ALLOWED}"
        with pytest.raises(ValueError, match=f"unknown dataset '{name}'"):
            load_examples(name)
    with pytest.raises(ValueError, match="'hf: ' names no hub dataset"):
        check_source("hf: ")
    for known in ("math500", "gsm8k", "hf:openai/gsm8k:main@test", "mine.jsonl", "data/train"):
        assert check_source(known) is None


def test_config_refuses_an_unknown_task_data_naming_the_field():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["task.name=dataset", "task.data=gsm8K"])
    assert str(info.value) == f"task.data = 'gsm8K': unknown dataset 'gsm8K'; {ALLOWED}"


def test_eval_refuses_an_unknown_data_name_before_loading_anything(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--data", "math"]) == 2
    assert capsys.readouterr().err == f"relayrl: --data: unknown dataset 'math'; {ALLOWED}\n"


def test_hub_dataset_without_the_hf_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(ImportError) as info:
        load_examples("hf:openai/gsm8k")
    assert str(info.value) == (
        "reading 'hf:openai/gsm8k' needs the Hugging Face datasets library: "
        "pip install 'relayrl[hf]'"
    )


def test_unreachable_hub_is_one_line_naming_the_dataset(monkeypatch):
    def unreachable(name, config, split):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub\n(LocalEntryNotFoundError)")

    fake_datasets(monkeypatch, unreachable)
    with pytest.raises(ConnectionError) as info:
        load_examples("hf:openai/gsm8k:main")
    assert str(info.value) == (
        "cannot load hub dataset 'hf:openai/gsm8k:main' (Couldn't reach 'openai/gsm8k' on the "
        "Hub (LocalEntryNotFoundError)); check the name and the network, or set "
        "HF_DATASETS_OFFLINE=1 to read the local cache"
    )


def test_hub_rows_take_the_user_fields_and_name_config_and_split(monkeypatch):
    asked = []

    def load_dataset(name, config, split):
        asked.append((name, config, split))
        return [{"q": "1+2?", "a": " 3"}, {"q": "2+2?", "a": "4"}]

    fake_datasets(monkeypatch, load_dataset)
    fields = {"prompt_field": "q", "answer_field": "a", "template": "Q: {q}"}
    examples = load_examples("hf:me/sums:v2@test", **fields)
    assert examples == [Example("Q: 1+2?", "3", {}), Example("Q: 2+2?", "4", {})]
    load_examples("hf:me/sums", **fields)
    assert asked == [("me/sums", "v2", "test"), ("me/sums", None, "train")]
    with pytest.raises(RowError, match="hf:me/sums row 1: no field 'prompt'; the row has: a, q"):
        load_examples("hf:me/sums")


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
    with pytest.raises(
        ValueError, match="unknown format '.csv'; allowed: .jsonl, .jsonl.gz, .parquet"
    ):
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
    with pytest.raises(FileNotFoundError) as info:
        load_math500()
    assert str(info.value) == (
        f"benchmark file '{tmp_path}/math500_test.jsonl' (or .jsonl.gz) not found; "
        "$RELAYRL_DATA_DIR points there: unset it to read the copy shipped with relayrl"
    )


def test_gzipped_jsonl_reads_as_jsonl_and_a_broken_one_is_named(tmp_path):
    path = tmp_path / "mine.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "3+4=", "answer": "7"}\n'))
    assert load_examples(path) == [Example("3+4=", "7", {})]
    path.write_bytes(b'{"prompt": "3+4=", "answer": "7"}\n')
    with pytest.raises(ValueError, match="mine.jsonl.gz': not a whole gzip file"):
        load_examples(path)


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
