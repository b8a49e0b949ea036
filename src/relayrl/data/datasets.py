"""Prompt/answer datasets: MATH-500, GSM8K, and users' own JSONL or Parquet files.

Every loader returns ``Example`` records: the prompt rendered from a template, the reference
answer the rewarder scores against, and metadata (subject, level, ids) for per-group reports.
The benchmark files are read from ``$RELAYRL_DATA_DIR``, else from ``../shared/data`` relative to
the working directory; nothing is downloaded.
"""

from __future__ import annotations

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


def read_records(path: str | Path) -> list[dict]:
    """Rows of a ``.jsonl`` or ``.parquet`` file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset file '{path}' not found (benchmark files are read from $RELAYRL_DATA_DIR, "
            "default ../shared/data)"
        )
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        return rows
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading '{path}' needs pyarrow: pip install pyarrow") from None
        return pq.read_table(path).to_pylist()
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
    for number, row in enumerate(read_records(path), start=1):
        for name in (prompt_field, answer_field, *meta_fields):
            if name not in row:
                raise ValueError(
                    f"{path}: row {number} has no field '{name}'; fields: {', '.join(sorted(row))}"
                )
        try:
            prompt = template.format(**row)
        except KeyError as err:
            raise ValueError(
                f"template field {err} is not a field of row {number} of {path}"
            ) from None
        examples.append(
            Example(prompt, answer_fn(str(row[answer_field])), {k: row[k] for k in meta_fields})
        )
    return examples


def load_math500(path: str | Path | None = None, template: str = MATH_TEMPLATE) -> list[Example]:
    """MATH-500 (Lightman et al., 2023): reference = the boxed answer's LaTeX."""
    return load_examples(
        path or data_dir() / "math500_test.jsonl",
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
        path or data_dir() / "gsm8k_test.jsonl",
        prompt_field="question",
        template=template,
        answer_fn=gsm8k_final_answer,
    )


DATASETS: dict[str, Callable[..., list[Example]]] = {
    "math500": load_math500,
    "gsm8k": load_gsm8k,
}
