"""Prompt/answer datasets: MATH-500, GSM8K, and users' own JSONL or Parquet files.

Every loader returns ``Example`` records: the prompt rendered from a template, the reference
answer the rewarder scores against, and metadata (subject, level, ids) for per-group reports.
The benchmark files are read from ``$RELAYRL_DATA_DIR``, else from ``../shared/data`` relative to
the working directory; nothing is downloaded.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MATH_TEMPLATE = "{problem}\nPut the final answer in \\boxed{{}}."
GSM8K_TEMPLATE = "{question}\nEnd with a line '#### ' followed by the final number."


@dataclass(frozen=True)
class Example:
    """One prompt, its reference answer, and metadata."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


def data_dir() -> Path:
    """Where the benchmark files are looked for."""
    return Path(os.environ.get("RELAYRL_DATA_DIR", "../shared/data"))


class RowError(ValueError):
    """A row that cannot be used: where it is, what is wrong, and which argument of
    ``load_examples`` it fails (``prompt_field``, ``answer_field``, ``template``, ...) if any."""

    def __init__(self, where: str, problem: str, argument: str | None = None):
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem
        self.argument = argument


JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number"}


def read_rows(path: str | Path) -> list[tuple[str, dict]]:
    """Rows of a ``.jsonl`` or ``.parquet`` file as dicts, each with where it is (``FILE line N``
    for JSONL, counting blank lines; ``FILE row N`` for Parquet)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {_named(path)} not found")
    if path.suffix == ".jsonl":
        rows = []
        # Split on newlines only: JSON strings may hold U+2028 and other characters that
        # str.splitlines would also break at.
        lines = path.read_bytes().removeprefix(codecs.BOM_UTF8).split(b"\n")
        for number, line in enumerate(lines, start=1):
            where = f"{path} line {number}"
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                raise RowError(
                    where, f"not UTF-8 text ({err.reason} at byte {err.start})"
                ) from None
            except json.JSONDecodeError as err:
                raise RowError(where, f"not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise RowError(
                    where, f"{JSON_KINDS.get(type(row)) or json.dumps(row)}, not a JSON object"
                )
            rows.append((where, row))
        return rows
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading '{path}' needs pyarrow: pip install pyarrow") from None
        table = pq.read_table(path).to_pylist()
        return [(f"{path} row {number}", row) for number, row in enumerate(table, start=1)]
    raise ValueError(
        f"dataset file '{path}': unknown format '{path.suffix}'; allowed: .jsonl, .parquet"
    )


def load_examples(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    template: str = "{prompt}",
    meta_fields: tuple[str, ...] = (),
    answer_fn: Callable[[str], str] = str.strip,
) -> list[Example]:
    """Examples from a user file: ``template`` is formatted with each row's fields."""
    examples = []
    for where, row in read_rows(path):
        for argument, name in (("prompt_field", prompt_field), ("answer_field", answer_field)):
            if name not in row:
                raise RowError(where, f"no field '{name}'; {_fields(row)}", argument)
        for name in meta_fields:
            if name not in row:
                raise RowError(where, f"no field '{name}'; {_fields(row)}", "meta_fields")
        try:
            prompt = template.format(**row)
        except KeyError as err:
            raise RowError(
                where, f"the template names field {err}; {_fields(row)}", "template"
            ) from None
        except (ValueError, IndexError, AttributeError, TypeError) as err:
            raise RowError(where, f"cannot fill the template ({err})", "template") from None
        try:
            answer = answer_fn(str(row[answer_field]))
        except ValueError as err:
            raise RowError(where, str(err), "answer_field") from None
        examples.append(Example(prompt, answer, {k: row[k] for k in meta_fields}))
    return examples


def _named(path: Path) -> str:
    """A path quoted for a message, with the directory a relative one is resolved from."""
    return f"'{path}'" + ("" if path.is_absolute() else f" (relative to {Path.cwd()})")


def _fields(row: dict) -> str:
    """The fields a row has, for error messages."""
    return f"the row has: {', '.join(sorted(row)) or 'no fields'}"


def benchmark_file(name: str) -> Path:
    """A benchmark file in ``data_dir()``; says where files are looked for if it is not there."""
    path = data_dir() / name
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark file {_named(path)} not found; benchmark files are read from "
            "$RELAYRL_DATA_DIR, default ../shared/data"
        )
    return path


def load_math500(path: str | Path | None = None, template: str = MATH_TEMPLATE) -> list[Example]:
    """MATH-500 (Lightman et al., 2023): reference = the boxed answer's LaTeX."""
    return load_examples(
        path or benchmark_file("math500_test.jsonl"),
        prompt_field="problem",
        template=template,
        meta_fields=("subject", "level", "unique_id"),
    )


def gsm8k_final_answer(solution: str) -> str:
    """The number after GSM8K's ``#### `` marker."""
    if "####" not in solution:
        raise ValueError("GSM8K answer without a '####' line")
    return solution.rsplit("####", 1)[1].strip()


def load_gsm8k(path: str | Path | None = None, template: str = GSM8K_TEMPLATE) -> list[Example]:
    """GSM8K (Cobbe et al., 2021): reference = the number after ``####``."""
    return load_examples(
        path or benchmark_file("gsm8k_test.jsonl"),
        prompt_field="question",
        template=template,
        answer_fn=gsm8k_final_answer,
    )


DATASETS: dict[str, Callable[..., list[Example]]] = {
    "math500": load_math500,
    "gsm8k": load_gsm8k,
}
