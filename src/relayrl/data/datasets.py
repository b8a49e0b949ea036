"""Prompt/answer datasets: MATH-500, GSM8K, and users' own JSONL or Parquet files.

Every loader returns ``Example`` records: the prompt rendered from a template, the reference
answer the rewarder scores against, and metadata (subject, level, ids) for per-group reports.
The benchmark files ship with the package (``relayrl/assets/data``, gzipped JSONL);
``$RELAYRL_DATA_DIR`` points the loaders at another copy. Nothing is downloaded unless a run asks
for a Hugging Face hub dataset by name (``hf:NAME``, with the ``hf`` extra installed).
"""

from __future__ import annotations

import codecs
import gzip
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


PACKAGED_DATA = Path(__file__).resolve().parent.parent / "assets" / "data"
FILE_FORMATS = (".jsonl", ".jsonl.gz", ".parquet")
HUB_PREFIX = "hf:"


def data_dir() -> Path:
    """Where the benchmark files are looked for: ``$RELAYRL_DATA_DIR``, else the packaged copy."""
    return Path(os.environ.get("RELAYRL_DATA_DIR") or PACKAGED_DATA)


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
    """Rows of a ``.jsonl``, ``.jsonl.gz`` or ``.parquet`` file as dicts, each with where it is
    (``FILE line N`` for JSONL, counting blank lines; ``FILE row N`` for Parquet)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {_named(path)} not found")
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        data = path.read_bytes()
        if path.suffix == ".gz":
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError) as err:
                raise ValueError(f"dataset file '{path}': not a whole gzip file ({err})") from None
        rows = []
        # Split on newlines only: JSON strings may hold U+2028 and other characters that
        # str.splitlines would also break at.
        lines = data.removeprefix(codecs.BOM_UTF8).split(b"\n")
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
        f"dataset file '{path}': unknown format '{path.suffix}'; allowed: {', '.join(FILE_FORMATS)}"
    )


def check_source(source: str) -> None:
    """Raise ``ValueError`` if ``source`` is neither a benchmark name, ``hf:NAME`` nor a file path
    (one with a suffix or a folder); the message lists what is allowed, in one line."""
    if source.startswith(HUB_PREFIX):
        if not source.removeprefix(HUB_PREFIX).strip():
            raise ValueError(f"'{source}' names no hub dataset; e.g. hf:openai/gsm8k:main@train")
        return
    looks_like_a_file = Path(source).suffix or "/" in source or os.sep in source
    if source not in DATASETS and not looks_like_a_file:
        raise ValueError(
            f"unknown dataset '{source}'; allowed: {', '.join(DATASETS)}, hf:NAME[:CONFIG][@SPLIT] "
            f"(a Hugging Face hub dataset), or a file ({', '.join(FILE_FORMATS)})"
        )


def read_hub_rows(source: str) -> list[tuple[str, dict]]:
    """Rows of a Hugging Face hub dataset, ``hf:NAME[:CONFIG][@SPLIT]`` (split ``train`` unless
    named), through the ``datasets`` library; each with where it is (``hf:... row N``)."""
    spec, _, split = source.removeprefix(HUB_PREFIX).partition("@")
    name, _, config = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"reading '{source}' needs the Hugging Face datasets library: pip install 'relayrl[hf]'"
        ) from None
    try:
        table = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as err:  # the hub client raises many kinds: connection, HTTP, not found
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConnectionError(
            f"cannot load hub dataset '{source}' ({reason}); check the name and the network, "
            "or set HF_DATASETS_OFFLINE=1 to read the local cache"
        ) from None
    return [(f"{source} row {number}", dict(row)) for number, row in enumerate(table, start=1)]


def load_examples(
    source: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    template: str = "{prompt}",
    meta_fields: tuple[str, ...] = (),
    answer_fn: Callable[[str], str] = str.strip,
) -> list[Example]:
    """Examples from a user file or a hub dataset (``hf:NAME``): ``template`` is formatted with
    each row's fields."""
    if isinstance(source, str):
        check_source(source)
    hub = isinstance(source, str) and source.startswith(HUB_PREFIX)
    examples = []
    for where, row in read_hub_rows(source) if hub else read_rows(source):
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


def benchmark_file(stem: str) -> Path:
    """A benchmark's ``STEM.jsonl`` or ``STEM.jsonl.gz`` in ``data_dir()``; says where files are
    looked for if neither is there."""
    folder = data_dir()
    for name in (f"{stem}.jsonl", f"{stem}.jsonl.gz"):
        if (folder / name).is_file():
            return folder / name
    if folder == PACKAGED_DATA:
        where = "this relayrl install lacks its packaged data: reinstall relayrl"
    else:
        where = "$RELAYRL_DATA_DIR points there: unset it to read the copy shipped with relayrl"
    raise FileNotFoundError(
        f"benchmark file {_named(folder / f'{stem}.jsonl')} (or .jsonl.gz) not found; {where}"
    )


def load_math500(path: str | Path | None = None, template: str = MATH_TEMPLATE) -> list[Example]:
    """MATH-500 (Lightman et al., 2023): reference = the boxed answer's LaTeX."""
    return load_examples(
        path or benchmark_file("math500_test"),
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
        path or benchmark_file("gsm8k_test"),
        prompt_field="question",
        template=template,
        answer_fn=gsm8k_final_answer,
    )


DATASETS: dict[str, Callable[..., list[Example]]] = {
    "math500": load_math500,
    "gsm8k": load_gsm8k,
}
