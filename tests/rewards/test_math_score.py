"""Math scoring: a table of (response, reference, expected) rows, and answer extraction.

Each row also records where raw math-verify, ``verify(parse(reference), parse(response))``,
disagrees with relayrl, and which of the two is right. The test checks those notes too: a row
without a note must agree with raw math-verify, a row with one must not, so the notes stay true
when either side changes.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import pytest
from math_verify import parse, verify

from relayrl.rewards.math import _score_unbounded, extract_answer, last_boxed, normalize, score
from relayrl.rewards.sandbox import DEFAULT_TIMEOUT_S


def boxed(answer: str) -> str:
    """A response that ends with the answer boxed the MATH way."""
    return "Putting it together, the result is $\\boxed{" + answer + "}$."


# Why raw math-verify and relayrl disagree; in every row below relayrl's answer is the right one.
BARE_REF = (
    "relayrl right: raw parse() extracts nothing from a bare LaTeX reference (it looks for $...$,"
    " boxes or plain numbers); MATH-500 answers are bare LaTeX, relayrl parses them as the answer"
)
LAST_BOX = (
    "relayrl right: the MATH convention grades the last box; raw merges both boxes into {3, 5}"
)
THIN_SPACE = "relayrl right: 1\\,234 is 1234 with a thin-space thousands separator"
DEGREE_SIGN = "relayrl right: a Unicode degree sign is the same as ^\\circ"
UNIT_WORD = "relayrl right: a plain word after a number is its unit"
NO_MARKER = (
    "relayrl right by design: no box, #### or 'the answer is', so no final answer; raw grades"
    " the last number in the text, which in reasoning is often an intermediate result"
)
UNCLOSED_BOX = "relayrl right by design: an unclosed box is a cut-off answer"

# (response, reference, expected score, why raw math-verify disagrees or None)
ROWS = [
    # integers
    (boxed("42"), "42", 1.0, None),
    (boxed("042"), "42", 1.0, None),
    (boxed("-7"), "-7", 1.0, None),
    (boxed("7"), "-7", 0.0, None),
    (boxed("43"), "42", 0.0, None),
    # decimals: equal to 6 decimal places
    (boxed("0.5"), "\\frac{1}{2}", 1.0, None),
    (boxed("1.50"), "1.5", 1.0, None),
    (boxed(".25"), "0.25", 1.0, None),
    (boxed("0.333333"), "\\frac{1}{3}", 1.0, None),
    (boxed("0.33"), "\\frac13", 0.0, None),
    (boxed("1.5001"), "1.5", 0.0, None),
    # thousands separators
    (boxed("1,234"), "1234", 1.0, None),
    (boxed("1{,}234"), "1234", 1.0, None),
    (boxed("1\\,234"), "1234", 1.0, THIN_SPACE),
    (boxed("1,234,567"), "1234567", 1.0, None),
    (boxed("\\$1,234.50"), "1234.5", 1.0, None),
    (boxed("1,234"), "1243", 0.0, None),
    # fractions
    (boxed("\\frac{2}{4}"), "\\frac{1}{2}", 1.0, None),
    (boxed("\\dfrac{3}{56}"), "\\frac{3}{56}", 1.0, None),
    (boxed("\\frac12"), "0.5", 1.0, None),
    (boxed("3/4"), "\\frac{3}{4}", 1.0, None),
    (boxed("-\\frac{1}{2}"), "\\frac{-1}{2}", 1.0, None),
    (boxed("15\\frac{39}{40}"), "\\frac{639}{40}", 1.0, None),  # a mixed number
    (boxed("\\frac{4}{3}"), "\\frac{3}{4}", 0.0, None),
    # radicals
    (boxed("2\\sqrt{2}"), "\\sqrt{8}", 1.0, BARE_REF),
    (boxed("\\frac{\\sqrt{3}}{3}"), "\\frac{1}{\\sqrt{3}}", 1.0, BARE_REF),
    (boxed("\\sqrt2/2"), "\\frac{\\sqrt{2}}{2}", 1.0, BARE_REF),
    (boxed("11\\sqrt2"), "11\\sqrt{2}", 1.0, BARE_REF),
    (boxed("3\\sqrt{13}"), "3\\sqrt{12}", 0.0, None),
    # percentages: "50%" matches both 50 and 0.5 (math-verify's convention)
    (boxed("50\\%"), "50", 1.0, None),
    (boxed("50\\%"), "0.5", 1.0, None),
    ("So the answer is 40%.", "40", 1.0, None),
    (boxed("25\\%"), "50\\%", 0.0, None),
    # degrees and units
    (boxed("90^\\circ"), "90", 1.0, None),
    (boxed("90°"), "90^\\circ", 1.0, DEGREE_SIGN),
    (boxed("5 \\text{ cm}"), "5", 1.0, None),
    (boxed("5\\text{ cm}^2"), "5", 1.0, None),
    (boxed("\\frac{270}7\\text{ degrees}"), "\\frac{270}{7}", 1.0, None),
    (boxed("18 dollars"), "18", 1.0, UNIT_WORD),
    (boxed("\\frac{\\pi}{2}"), "90^\\circ", 0.0, None),  # radians are not converted to degrees
    (boxed("6 \\text{ cm}"), "5 \\text{ cm}", 0.0, None),
    (boxed("5 \\text{ inches}"), "5 \\text{ cm}", 1.0, None),  # units are dropped, not checked
    # text answers: case-insensitive
    (boxed("\\text{Evelyn}"), "\\text{Evelyn}", 1.0, BARE_REF),
    (boxed("Evelyn"), "\\text{Evelyn}", 1.0, BARE_REF),
    (boxed("\\text{Yes}"), "\\text{yes}", 1.0, BARE_REF),
    (boxed("\\text{(C)}"), "C", 1.0, BARE_REF),
    (boxed("\\text{east}"), "\\text{west}", 0.0, None),
    (boxed("\\textbf{(C)}"), "\\text{(B)}", 0.0, None),
    # tuples: order matters
    (boxed("\\left( 3, \\frac{\\pi}{2} \\right)"), "(3,\\frac{\\pi}{2})", 1.0, BARE_REF),
    (boxed("(6, 31, -1)"), "(6,31,-1)", 1.0, BARE_REF),
    (boxed("(-2, 1)"), "(-2,1)", 1.0, BARE_REF),
    (boxed("(2,1)"), "(1,2)", 0.0, None),
    # intervals: brackets matter
    (boxed("(3,4]"), "(3, 4]", 1.0, BARE_REF),
    (boxed("(-\\infty, 2) \\cup (3, \\infty)"), "(-\\infty,2)\\cup(3,\\infty)", 1.0, BARE_REF),
    (boxed("x \\in [2,5)"), "[2,5)", 1.0, BARE_REF),
    (boxed("[3,4)"), "(3,4]", 0.0, None),
    (boxed("(2,\\infty)"), "[2,\\infty)", 0.0, None),
    # sets and lists of answers: order does not matter
    (boxed("\\{1, 2\\}"), "\\{2, 1\\}", 1.0, BARE_REF),
    (boxed("3, 5, 7"), "7, 5, 3", 1.0, BARE_REF),
    (boxed("1,-2"), "-2, 1", 1.0, BARE_REF),
    (boxed("\\pm 2"), "2, -2", 1.0, BARE_REF),
    (boxed("1, 2"), "1, 2, 3", 0.0, None),
    # matrices
    (
        boxed("\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}"),
        "\\begin{pmatrix} -\\frac13 \\\\ \\frac23 \\\\ \\frac53 \\end{pmatrix}",
        1.0,
        BARE_REF,
    ),
    (
        boxed("\\begin{bmatrix} 1 & 0 \\\\ 0 & 1 \\end{bmatrix}"),
        "\\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix}",
        1.0,
        BARE_REF,
    ),
    (
        boxed("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"),
        "\\begin{pmatrix} 1 & 2 \\\\ 4 & 3 \\end{pmatrix}",
        0.0,
        None,
    ),
    # symbolic expressions and equations
    (boxed("x^2+2x+1"), "(x+1)^2", 1.0, BARE_REF),
    (boxed("p - q"), "-q + p", 1.0, BARE_REF),
    (boxed("(a+5)(b+2)"), "ab+2a+5b+10", 1.0, BARE_REF),
    (boxed("\\cot x"), "\\frac{\\cos x}{\\sin x}", 1.0, BARE_REF),
    (boxed("2k+2"), "2(k+1)", 1.0, BARE_REF),
    (boxed("6-5i"), "6 - 5i", 1.0, BARE_REF),
    (boxed("1 \\pm \\sqrt{19}"), "1+\\sqrt{19}, 1-\\sqrt{19}", 1.0, BARE_REF),
    (boxed("y = 2x + 3"), "2x+3", 1.0, BARE_REF),
    (boxed("x=5"), "5", 1.0, None),
    (boxed("x^3+3x-6"), "x^3+3x+6", 0.0, None),
    (boxed("\\pi"), "3.14", 0.0, None),
    # Both wrong, a known gap of math-verify: it keeps e^{i\pi} unevaluated, so it is not -1.
    (boxed("e^{i\\pi}"), "-1", 0.0, None),
    # Known gaps, both sides: a base subscript is dropped, and a tuple is not a column vector.
    (boxed("52"), "52_8", 1.0, None),
    (boxed("(1,2)"), "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 0.0, None),
    # where the answer is found
    ("First guess $\\boxed{3}$, but checking again, it is $\\boxed{5}$.", "5", 1.0, None),
    ("First guess $\\boxed{3}$, but checking again, it is $\\boxed{5}$.", "3", 0.0, None),
    ("First guess \\boxed{3}, then after checking \\boxed{5}.", "5", 1.0, LAST_BOX),
    ("We get $\\fbox{12}$.", "12", 1.0, None),
    ("She pays 5 * 3 = <<5*3=15>>15 dollars.\n#### 15", "15", 1.0, None),
    ("She pays 5 * 3 = <<5*3=15>>15 dollars.\n#### 15", "5", 0.0, None),
    ("Total: 1600 dollars.\n#### 1,600", "1600", 1.0, None),
    ("Adding up, the answer is 18 dollars.", "18", 1.0, None),
    ("**Answer:** 42", "42", 1.0, None),
    ("Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.", "0.5", 1.0, None),
    ("The sum is 2 + 3 = 5.", "5", 0.0, NO_MARKER),
    ("So we get $\\boxed{\\frac{1}{2}", "0.5", 0.0, UNCLOSED_BOX),
]


def raw_math_verify(response: str, reference: str) -> float:
    """math-verify used directly on the whole response, timeouts off as in the workers."""
    gold = parse(reference, parsing_timeout=None)
    pred = parse(response, parsing_timeout=None)
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def test_the_table_covers_every_answer_kind_both_ways():
    assert len(ROWS) >= 60
    assert {expected for *_, expected, _ in ROWS} == {0.0, 1.0}
    assert sum(expected == 0.0 for *_, expected, _ in ROWS) >= 20


@pytest.mark.parametrize(("response", "reference", "expected", "raw_note"), ROWS)
def test_score(response, reference, expected, raw_note):
    assert score(response, reference) == expected  # the public, sandboxed entry


SCRIPT = 'from relayrl.rewards.math import score\nprint(score("\\\\boxed{1/2}", "0.5"))\n'


@pytest.mark.parametrize(
    "how", [["t.py"], ["-"], ["-i"]], ids=["script-file", "stdin", "interactive"]
)
def test_score_works_from_a_script_without_the_main_guard(tmp_path, how):
    # The two lines, run as a file, piped to `python -` and typed into an interactive session:
    # the scoring worker must not re-run the caller's main module.
    script = tmp_path / "t.py"
    script.write_text(SCRIPT)
    temp = tmp_path / "tmp"
    temp.mkdir()
    with script.open() as stdin:
        result = subprocess.run(
            [sys.executable, *how],
            stdin=stdin,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "TMPDIR": str(temp)},
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1.0"]
    assert list(temp.iterdir()) == [], "no temp dir is left behind"


@pytest.mark.parametrize(("response", "reference", "expected", "raw_note"), ROWS[:10])
def test_the_unbounded_scorer_is_the_same_function(response, reference, expected, raw_note):
    assert _score_unbounded(response, reference) == expected


@pytest.mark.parametrize(("response", "reference", "expected", "raw_note"), ROWS)
def test_disagreements_with_raw_math_verify_are_noted(response, reference, expected, raw_note):
    raw = raw_math_verify(response, reference)
    if raw_note is None:
        assert raw == expected, "raw math-verify disagrees: say which is right and why"
    else:
        assert raw != expected, f"raw math-verify now agrees; drop the note {raw_note!r}"


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("First $\\boxed{3}$, then $\\boxed{5}$.", "5"),
        ("$\\boxed{\\frac{1}{\\sqrt{2}}}$", "\\frac{1}{\\sqrt{2}}"),
        ("$\\boxed{\\{1, 2\\}}$", "\\{1, 2\\}"),  # escaped braces do not close the box
        ("\\boxed{a} and finally \\fbox{b}", "b"),
        ("\\fbox{a} and finally \\boxed{b}", "b"),
        ("so $\\boxed 5$.", "5"),
        ("\\boxed{ 7 }", "7"),
        ("Janet has 3 + 4 = <<3+4=7>>7.\n#### 7", "7"),
        ("#### 1\n#### 2", "2"),
        ("The answer is 18.", "18"),
        ("the answer is 1.5.", "1.5"),
        ("The answer is $x = 2$, since ...", "x = 2"),
        ("So the final answer is **42**.", "42"),
        ("The answer is 18, since 3 * 6 = 18.", "18"),  # in prose a comma ends the answer
        ("Answer: $3, 4$", "3, 4"),
        ("Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.", "\\frac{1}{2}"),
        ("The answer is 1,234 apples", "1,234 apples"),
        ("\\boxed{4} beats #### 3", "4"),
    ],
)
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize(
    "response",
    ["No answer here: 2 + 2 = 4.", "$\\boxed{\\frac{1}{2}$", "\\boxed{}", "#### ", "\\boxed"],
)
def test_extract_answer_finds_none(response):
    assert not extract_answer(response)


def test_last_boxed_matches_nested_braces():
    text = "\\boxed{\\frac{a^{2}}{\\sqrt{b_{1}}}} tail"
    assert last_boxed(text) == "\\frac{a^{2}}{\\sqrt{b_{1}}}"


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("$18$.", "18"),
        ("1\\,000", "1000"),
        ("1{,}000{,}000", "1000000"),
        ("90°", "90^\\circ"),
        ("18 dollars", "18"),
        ("\\$1,600 per month", "\\$1,600"),
        ("2 pi", "2 pi"),  # a two-letter word may be a variable: keep it
        ("3 and 4", "3 and 4"),  # two answers, not a unit
        ("1, 234", "1, 234"),  # a list, not a thousands separator
    ],
)
def test_normalize(raw, clean):
    assert normalize(raw) == clean


HOSTILE = {
    "power-tower": "\\boxed{9^{9^{9^{9}}}}",
    "50k-term-sum": "\\boxed{" + "+".join(["1"] * 50_000) + "}",
    "nested-frac": "\\boxed{" + "\\frac{1}{" * 5000 + "2" + "}" * 5000 + "}",
    "10M-digits": "\\boxed{" + "9" * 10_000_000 + "}",
}
MARGIN_S = 5.0  # a replacement worker and a loaded 2-core machine; not a performance bound
SHORT_S = 0.5  # each of these runs for minutes: any limit cuts it


def test_hostile_answers_score_zero_by_default_within_the_time_limit():
    # In process (_score_unbounded) each of these ran for 45 s to over a minute when measured
    # (docs/math_rewards.md); through the public entry each costs one timeout.
    assert score(boxed("42"), "42") == 1.0  # the first call starts the worker: not timed
    start, peak_kb = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert score(HOSTILE["power-tower"], "1") == 0.0
    assert time.monotonic() - start < DEFAULT_TIMEOUT_S + MARGIN_S
    assert score(boxed("\\frac{1}{2}"), "0.5") == 1.0, "a correct answer still scores 1"
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kb) / 1024
    assert grown_mb < 100, "the parse must happen in the worker, not here"


@pytest.mark.parametrize("name", [n for n in HOSTILE if n != "power-tower"])
def test_hostile_answers_score_zero_within_a_shorter_limit(name):
    assert score(boxed("42"), "42") == 1.0
    start, peak_kb = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert score(HOSTILE[name], "1", timeout_s=SHORT_S) == 0.0
    assert time.monotonic() - start < SHORT_S + MARGIN_S
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kb) / 1024
    assert grown_mb < 100 + len(HOSTILE[name]) * 4 / 2**20  # the text itself, its JSON copies
    assert score(boxed("42"), "42") == 1.0, "a correct answer still scores 1"
