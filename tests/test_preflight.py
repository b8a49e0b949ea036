"""The pre-flight check: bad data and unencodable text are one line naming the field, before Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import GOOD, write_jsonl, write_tokenizer

from relayrl.config import Config, load_config
from relayrl.models.lm import load_tokenizer
from relayrl.preflight import PreflightError, check, unencodable

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


def dataset(path: Path) -> Config:
    """A config of a dataset task over ``path`` with one held-out problem."""
    return load_config(None, ["task.name=dataset", f"task.data={path}", "task.heldout_size=1"])


def problem(cfg: Config) -> str:
    """The one-line message ``check`` raises for ``cfg``."""
    with pytest.raises(PreflightError) as info:
        check(cfg)
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_configs_pass_on_a_fresh_clone(path, tmp_path, monkeypatch):
    # Data comes with the package: no $RELAYRL_DATA_DIR, no ../shared/data beside the cwd.
    monkeypatch.delenv("RELAYRL_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path)

    assert check(cfg) is None  # no PreflightError


def test_a_readable_file_the_tokenizer_encodes_passes(tmp_path):
    assert check(dataset(write_jsonl(tmp_path / "ok.jsonl", GOOD))) is None


def test_missing_file_names_the_field_and_the_path(tmp_path):
    path = tmp_path / "none.jsonl"

    assert problem(dataset(path)) == f"task.data = '{path}': dataset file '{path}' not found"


def test_missing_benchmark_file_says_where_benchmarks_are_read_from(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_DATA_DIR", str(tmp_path))
    cfg = load_config(
        None, ["task.name=dataset", "task.data=gsm8k", "model.tokenizer=builtin:byte"]
    )

    message = problem(cfg)
    assert message.startswith(f"task.data = 'gsm8k': benchmark file '{tmp_path}/gsm8k_test.jsonl'")
    assert "$RELAYRL_DATA_DIR" in message


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "line 3: not valid JSON (Expecting property name enclosed in double quotes)"),
        ("[1, 2]", "line 3: an array, not a JSON object"),
        ('"text"', "line 3: a string, not a JSON object"),
        ("null", "line 3: null, not a JSON object"),
    ],
)
def test_unreadable_row_names_the_file_and_its_line_counting_blank_lines(tmp_path, line, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD[0], "", line, GOOD[1]])

    assert problem(dataset(path)) == f"task.data = '{path}': {path} {expected}"


def test_row_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')

    assert f"{path} line 2: not UTF-8 text" in problem(dataset(path))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "task.prompt_field=question",
            "task.prompt_field = 'question': {path} line 2: no field 'question'; "
            "the row has: answer, prompt",
        ),
        (
            "task.answer_field=solution",
            "task.answer_field = 'solution': {path} line 2: no field 'solution'; "
            "the row has: answer, prompt",
        ),
        (
            "task.template='{prompt} {hint}'",
            "task.template = '{prompt} {hint}': {path} line 2: the template names field 'hint'; "
            "the row has: answer, prompt",
        ),
    ],
)
def test_missing_field_names_the_setting_the_line_and_the_fields_the_row_has(
    tmp_path, override, expected
):
    first = {"prompt": "1+1=", "answer": "2", "question": "1+1=", "solution": "2", "hint": "+"}
    path = write_jsonl(tmp_path / "rows.jsonl", [first, *GOOD])
    cfg = load_config(
        None, ["task.name=dataset", f"task.data={path}", "task.heldout_size=1", override]
    )

    assert problem(cfg) == expected.replace("{path}", str(path))


def test_answer_template_may_only_name_the_answer(tmp_path):
    cfg = load_config(None, ["task.answer_template='\\boxed{{{ans}}}'"])

    assert problem(cfg) == (
        "task.answer_template = '\\\\boxed{{{ans}}}': names field 'ans'; "
        "the warm-start target is built from {answer} only"
    )


def test_held_out_split_that_takes_every_row_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "two.jsonl", GOOD)
    cfg = load_config(None, ["task.name=dataset", f"task.data={path}", "task.heldout_size=2"])

    assert problem(cfg).startswith("task.heldout_size=2 leaves no training prompts")


def test_letters_under_the_char_tokenizer_name_the_characters_rows_and_the_byte_tokenizer(
    tmp_path,
):
    rows = [{"prompt": "hello 1+1=", "answer": "2"}, {"prompt": "eh 2+2=", "answer": "4"}, GOOD[0]]
    path = write_jsonl(tmp_path / "words.jsonl", rows)

    assert problem(dataset(path)) == (
        f"model.tokenizer = 'builtin:char': cannot encode 4 characters of task.data = '{path}' "
        "('e', 'h', 'l', 'o'), found in 2 of 3 prompts and 0 of 3 warm-start targets; "
        "use model.tokenizer=builtin:byte (any UTF-8 text)"
    )


def test_more_than_ten_characters_are_counted_not_listed(tmp_path):
    path = write_jsonl(
        tmp_path / "abc.jsonl", [{"prompt": "abcdefghijklm", "answer": "1"}, GOOD[0]]
    )

    assert "('a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', 'i', 'j' and 3 more)" in problem(dataset(path))


def test_warm_start_targets_are_checked_after_the_answer_template(tmp_path):
    path = write_jsonl(tmp_path / "ok.jsonl", GOOD)
    cfg = load_config(
        None,
        ["task.name=dataset", f"task.data={path}", "task.heldout_size=1"]
        + ["task.answer_template='#### {answer}'"],
    )

    message = problem(cfg)
    assert (
        f"1 character of task.data = '{path}' ('#'), found in 0 of 2 prompts and 2 of 2 " in message
    )
    assert message.endswith("warm-start targets; use model.tokenizer=builtin:byte (any UTF-8 text)")
    check(cfg.model_copy(update={"warm_start": cfg.warm_start.model_copy(update={"max_steps": 0})}))


def test_addition_under_a_tokenizer_without_digits_suggests_the_builtins(tmp_path):
    folder = write_tokenizer(tmp_path / "letters", "abcdefghijklmnopqrstuvwxyz+=")
    cfg = load_config(None, [f"model.tokenizer={folder}"])

    message = problem(cfg)
    assert message.startswith(
        f"model.tokenizer = '{folder}': cannot encode 10 characters of task.name = 'addition' "
        "(a sample of 512) ("
    )
    assert "found in 512 of 512 prompts and 512 of 512 warm-start targets" in message
    assert message.endswith(
        "use model.tokenizer=builtin:char (digits and arithmetic signs) "
        "or builtin:byte (any UTF-8 text)"
    )


def test_unencodable_finds_errors_unknown_tokens_and_dropped_characters(tmp_path):
    char = load_tokenizer("builtin:char")
    byte = load_tokenizer("builtin:byte")
    folder = write_tokenizer(tmp_path / "tok", "0123456789+= ", drop="~")
    own = load_tokenizer(str(folder))
    text = "12 + 3=\na~é😀"

    assert unencodable(char, set(text)) == {"\n", "a", "~", "é", "😀"}  # raises: no [UNK]
    assert unencodable(own, set(text)) == {"\n", "a", "~", "é", "😀"}  # <unk>, and ~ dropped
    assert unencodable(byte, set(text)) == set()
    assert own(" ", add_special_tokens=False)["input_ids"]  # the vocabulary's space is kept


def test_an_unloadable_tokenizer_directory_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = load_config(None, [f"model.tokenizer={tmp_path / 'empty'}"])

    assert problem(cfg).startswith(f"model.tokenizer = '{tmp_path / 'empty'}': ")


def test_embodied_runs_are_not_checked():
    assert check(load_config(None, ["workload=embodied"])) is None  # it has no task to read
