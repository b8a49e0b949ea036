"""Math answer scoring: extract the final answer from a response, compare it with the reference.

Extraction follows the MATH convention: the answer is the content of the LAST ``\\boxed{...}`` (or
``\\fbox{...}``) in the response; without one, GSM8K's ``#### N`` line; without that, the text
after the last "the answer is" / "answer:". A response with none of these scores 0.

Equivalence is math-verify's: both answers are parsed by its LaTeX parser (latex2sympy2 into
sympy) and compared as strings, numerically (6 decimal places) and symbolically; it handles
integers, decimals and thousands separators, fractions, radicals, percentages, degrees, units in
``\\text{}``, text answers, tuples, intervals, sets, matrices and equations. We hand it the
extracted answer alone, wrapped in ``\\boxed{}``, so that its own extraction cannot merge several
boxes into a set or pick a stray number elsewhere in the response.

Parsing and comparing run sympy on model output, which can hang or exhaust memory
(``\\boxed{9^{9^{9^{9}}}}``, a 50,000-term sum). ``score`` is therefore bounded: it scores in a
worker process with a per-item time limit (``sandbox.DEFAULT_TIMEOUT_S``, 5 s) and an
address-space limit (``sandbox.DEFAULT_MEMORY_MB``, 1 GiB), and returns 0.0 past either. Many
items go faster through ``ScoringPool(SCORER).score_batch`` (``relayrl.rewards.sandbox``), as the
rewarder does.
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache

from math_verify import LatexExtractionConfig, parse, verify

from relayrl.rewards.sandbox import DEFAULT_TIMEOUT_S, score_one

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_GSM8K_ANSWER = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(r"\banswer\s*(?:is\b|:)[ \t:]*", re.IGNORECASE)
_MATH_DELIMITERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))
# A sentence ends at ., ;, ! or ? followed by a space or the end; "1.5" and "1,234" stay whole.
_SENTENCE_END = re.compile(r"[.;!?](?:\s|$)|,\s")
# Thin spaces used as thousands separators: 1\,000, 1\!000, 1{,}000, 1\ 000.
_THIN_SEPARATOR = re.compile(r"(?<=\d)(?:\\,|\\!|\\ |\{,\})(?=\d{3}(?!\d))")
# A number followed by plain words ("18 dollars", "3 apples"): the words are a unit. Words of at
# least three letters, so that "2 x" and "2 pi" stay products; "and"/"or" separate answers.
_NUMBER_THEN_WORDS = re.compile(
    r"^(-?(?:\\?\$)?\d[\d,]*(?:\.\d+)?)\s+(?!(?:and|or)\b)[A-Za-z]{3,}(?:\s+[A-Za-z]+)*$"
)
# Dollar signs and spaces around the answer, and the full stop that ends its sentence.
_WRAPPING = re.compile(r"^[\s$]+|[\s$.]+$")
_LATEX_ONLY = [LatexExtractionConfig()]
# What the sandbox's workers run: ``score`` itself, unbounded.
SCORER = "relayrl.rewards.math:_score_unbounded"

# math-verify warns once per process that its signal timeouts are off: the sandbox bounds time.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}``; None if absent or unclosed."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    while i < len(text) and text[i].isspace():
        i += 1
    if i == len(text):
        return None
    if text[i] != "{":
        # MATH also writes "\boxed 5": the answer runs to the next space or dollar sign.
        return re.split(r"[\s$]", text[i:], maxsplit=1)[0] or None
    depth, j = 0, i
    while j < len(text):
        char = text[j]
        if char == "\\":
            j += 2  # \{ and \} are literal braces, not grouping
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
        j += 1
    return None


def _after_answer_is(text: str) -> str | None:
    """The answer after the last "the answer is" / "answer:", cut at the end of its sentence."""
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].split("\n", 1)[0].strip().strip("*").strip()
    for opening, closing in _MATH_DELIMITERS:
        if rest.startswith(opening):
            end = rest.find(closing, len(opening))
            if end > 0:
                return rest[len(opening) : end].strip()
    end = _SENTENCE_END.search(rest)
    answer = (rest[: end.start()] if end else rest).strip().strip("*").strip()
    return answer or None


def extract_answer(response: str) -> str | None:
    """The final answer in a response: last box, else ``#### N``, else "the answer is ..."."""
    if any(command in response for command in _BOX_COMMANDS):
        return last_boxed(response)
    gsm8k = _GSM8K_ANSWER.findall(response)
    if gsm8k:
        return gsm8k[-1].strip() or None
    return _after_answer_is(response)


def normalize(answer: str) -> str:
    """Light clean-up that math-verify's own normalisation misses, before it parses the answer."""
    answer = _WRAPPING.sub("", answer)
    answer = answer.replace("°", "^\\circ")
    answer = _THIN_SEPARATOR.sub("", answer)
    return _NUMBER_THEN_WORDS.sub(r"\1", answer)


# A group of samples shares its reference and often its answers. The cache holds at most 1,024
# answers, so a flood of long ones cannot take much of a worker's memory.
@lru_cache(maxsize=1024)
def _parse(answer: str) -> tuple:
    """math-verify's parse of one bare answer: (sympy object, normalised string) or fewer."""
    # first_match: if the boxed answer does not parse, do not fall back to a number inside it.
    return tuple(
        parse(
            "\\boxed{" + normalize(answer) + "}",
            extraction_config=_LATEX_ONLY,
            extraction_mode="first_match",
            # signal.alarm fails outside the main thread: ScoringPool enforces the time limit
            parsing_timeout=None,
        )
    )


def _equivalent(answer: str, reference: str) -> bool:
    """Whether two bare answers are equivalent according to math-verify (unbounded)."""
    gold, pred = _parse(reference), _parse(answer)
    return bool(gold and pred and verify(list(gold), list(pred), timeout_seconds=None))


def score(response: str, reference: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if the final answer in ``response`` is equivalent to the bare ``reference``, else 0.0.

    Runs in a worker process shared by this process (the first call starts it: 0.4-3 s):
    0.0 if scoring takes over ``timeout_s`` seconds, needs over 1 GiB of address space or raises.
    """
    return score_one(SCORER, response, reference, timeout_s)


def _score_unbounded(response: str, reference: str) -> float:
    """``score`` in this process, with no time or memory limit: for the sandbox's workers."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if _equivalent(answer, reference) else 0.0
