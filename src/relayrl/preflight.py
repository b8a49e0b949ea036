"""Check a run's data against its config and tokenizer before any executor starts.

The executors load the task and encode prompts and warm-start targets themselves, so a bad row or
a character the tokenizer cannot encode used to surface only after Ray's start-up, as an actor's
death. ``check`` runs the same loaders and tokenizer in the launching process, in about a second,
and says what is wrong in one line that names the config field.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from relayrl.config import Config, TaskConfig
from relayrl.data.datasets import DATASETS, Example, RowError
from relayrl.envs import build_task
from relayrl.envs.arithmetic import Problem
from relayrl.envs.dataset import DatasetTask, load_dataset_examples
from relayrl.models.lm import load_codec, load_tokenizer

BUILTIN_TOKENIZERS = {
    "builtin:char": "digits and arithmetic signs",
    "builtin:byte": "any UTF-8 text",
}
ADDITION_SAMPLE = 256  # held-out and training problems each: every digit and sign appears
SHOWN = 10  # unencodable characters the message names
USER_SETTINGS = ("prompt_field", "answer_field", "template")  # task.* keys a user file reads


class PreflightError(ValueError):
    """A data or tokenizer problem, in one line that names the config field."""

    def __init__(self, message: str):
        # Library messages (transformers, pyarrow) may span lines; the CLI prints one.
        super().__init__(re.sub(r"\s*\n\s*", " ", message))


def check(cfg: Config) -> None:
    """Raise ``PreflightError`` if the LLM task's data cannot be read, or its prompts or
    warm-start targets hold characters the tokenizer cannot encode."""
    if cfg.workload != "llm":
        return
    tc = cfg.task
    problems = _problems(tc)
    try:
        tokenizer = load_codec(cfg)[0]
    except (OSError, ValueError) as err:
        raise PreflightError(f"model.tokenizer = {cfg.model.tokenizer_source!r}: {err}") from None
    texts = {"prompts": [p.prompt for p in problems]}
    if cfg.warm_start.max_steps > 0:  # the targets are only built for a warm start
        texts["warm-start targets"] = _targets(tc.answer_template, problems)
    if tc.name == "dataset":
        source = f"task.data = {tc.data!r}"
    else:
        source = f"task.name = {tc.name!r} (a sample of {len(problems)})"
    _check_encodable(tokenizer, cfg.model.tokenizer_source, texts, source)


def _problems(tc: TaskConfig) -> list[Problem]:
    """Every problem of a dataset task, or a sample of a synthetic task's (addition,
    chain_sum)."""
    try:
        if tc.name != "dataset":
            task = build_task(tc)
            return task.heldout()[:ADDITION_SAMPLE] + task.sample(ADDITION_SAMPLE, random.Random(0))
        examples = _examples(tc)
        DatasetTask(examples, tc.heldout_size)  # refuses a held-out split that leaves nothing
    except ValueError as err:  # the tasks' own errors name task.heldout_size
        raise PreflightError(str(err)) from None
    return [Problem(e.prompt, e.answer) for e in examples]


def _examples(tc: TaskConfig) -> list[Example]:
    """The dataset's examples, with loader errors mapped to the config field they concern."""
    try:
        return load_dataset_examples(tc.data, tc.prompt_field, tc.answer_field, tc.template)
    except RowError as err:
        # A benchmark's fields and template are its loader's, not the user's task.* settings.
        user_setting = tc.data not in DATASETS and err.argument in USER_SETTINGS
        key = err.argument if user_setting else "data"
        raise PreflightError(f"task.{key} = {getattr(tc, key)!r}: {err}") from None
    except (OSError, ValueError, ImportError) as err:
        raise PreflightError(f"task.data = {tc.data!r}: {err}") from None


def _targets(template: str, problems: list[Problem]) -> list[str]:
    """The warm-start targets, built the way the trainer builds them."""
    try:
        return [template.format(answer=p.answer) for p in problems]
    except KeyError as err:
        problem = f"names field {err}; the warm-start target is built from {{answer}} only"
    except (ValueError, IndexError, AttributeError) as err:
        problem = f"not a valid template ({err})"
    raise PreflightError(f"task.answer_template = {template!r}: {problem}")


def unencodable(tokenizer: PreTrainedTokenizerBase, chars: Iterable[str]) -> set[str]:
    """The characters that the tokenizer refuses, maps to its unknown token, or drops.

    Each character is encoded on its own, as the trainer encodes text: a WordLevel vocabulary
    without an unknown token (``builtin:char``) raises on a character outside it, one with an
    unknown token returns that token's id, and a byte-level BPE (``builtin:byte``) encodes every
    character. Whitespace that encodes to nothing is a separator the pre-tokenizer removes, not a
    lost character. Exact for character- and byte-level vocabularies and for BPE and Unigram ones,
    whose tokens are built from their characters; a word-level vocabulary can still map a whole
    unknown word to its unknown token, which this does not see.
    """
    unknown = {tokenizer.unk_token_id}
    model_unk = getattr(tokenizer.backend_tokenizer.model, "unk_token", None)
    if model_unk is not None:
        unknown.add(tokenizer.backend_tokenizer.token_to_id(model_unk))
    unknown.discard(None)
    missing = set()
    for char in chars:
        try:
            ids = tokenizer(char, add_special_tokens=False)["input_ids"]
        except Exception:  # the tokenizers library raises a bare Exception ("Missing [UNK]")
            missing.add(char)
            continue
        if unknown.intersection(ids) or not (ids or char.isspace()):
            missing.add(char)
    return missing


def _check_encodable(
    tokenizer: PreTrainedTokenizerBase, spec: str, texts: dict[str, list[str]], source: str
) -> None:
    """Raise ``PreflightError`` naming the characters the tokenizer cannot encode, if any."""
    missing = unencodable(tokenizer, set().union(*("".join(group) for group in texts.values())))
    if not missing:
        return
    rows: Counter[str] = Counter()
    found = []
    for name, group in texts.items():
        hits = [missing.intersection(text) for text in group]
        rows.update(char for hit in hits for char in hit)
        found.append(f"{sum(map(bool, hits))} of {len(group)} {name}")
    chars = sorted(missing, key=lambda char: (-rows[char], char))
    named = ", ".join(repr(char) for char in chars[:SHOWN])
    plural = "" if len(chars) == 1 else "s"
    more = f" and {len(chars) - SHOWN} more" if len(chars) > SHOWN else ""
    takers = [
        name
        for name in BUILTIN_TOKENIZERS
        if name != spec and not unencodable(load_tokenizer(name), missing)
    ]
    if takers:
        hint = "use model.tokenizer=" + " or ".join(
            f"{t} ({BUILTIN_TOKENIZERS[t]})" for t in takers
        )
    else:
        hint = "no builtin tokenizer takes them"
    raise PreflightError(
        f"model.tokenizer = {spec!r}: cannot encode {len(chars)} character{plural} of {source} "
        f"({named}{more}), found in {' and '.join(found)}; {hint}"
    )
