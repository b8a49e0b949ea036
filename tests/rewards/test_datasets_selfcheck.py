"""Self-check on real data: each worked solution matches its own answer and not another row's.

MATH-500: a row's ``solution`` (which ends in the boxed answer) against its ``answer``, and
against the answer of row (i + 1) % n wherever that answer is a different string. GSM8K: the
full ``answer`` text with its ``#### N`` line against N, and against the next row's N. Scored
through the sandboxed ScoringPool, as in training.
"""

from __future__ import annotations

import pytest

from relayrl.data.datasets import PACKAGED_DATA, read_rows
from relayrl.rewards.math import SCORER
from relayrl.rewards.sandbox import ScoringPool


def load(name: str) -> list[dict]:
    """The rows of a benchmark file shipped with the package."""
    return [row for _, row in read_rows(PACKAGED_DATA / name)]


def gsm8k_number(row: dict) -> str:
    """The final answer after ``####`` on the last line of a GSM8K answer."""
    return row["answer"].rsplit("####", 1)[1].strip()


def own_and_other(rows: list[dict], response, answer, same) -> tuple[list, list]:
    """(response, own answer) pairs, and (response, next row's answer) where they differ."""
    n = len(rows)
    own = [(response(row), answer(row)) for row in rows]
    other = [
        (response(rows[i]), answer(rows[(i + 1) % n]))
        for i in range(n)
        if not same(answer(rows[i]), answer(rows[(i + 1) % n]))
    ]
    return own, other


@pytest.fixture(scope="module")
def pool():
    # A generous timeout: a timed-out row would count as a miss, and the machine may be busy.
    with ScoringPool(SCORER, workers=2, timeout_s=20.0) as pool:
        yield pool


def test_math500(pool):
    rows = load("math500_test.jsonl.gz")
    own, other = own_and_other(
        rows,
        lambda row: row["solution"],
        lambda row: row["answer"],
        lambda a, b: "".join(a.split()) == "".join(b.split()),
    )
    own_scores, other_scores = pool.score_batch(own), pool.score_batch(other)
    ids = [row["unique_id"] for row in rows]
    misses = [(i, pair[1]) for i, pair, s in zip(ids, own, own_scores, strict=True) if s == 0]
    false_hits = [pair[1] for pair, s in zip(other, other_scores, strict=True) if s == 1]
    assert sum(own_scores) / len(own) >= 0.99, misses
    assert sum(other_scores) / len(other) <= 0.01, false_hits
    assert len(other) > 450  # the skip removes only repeated answers


def test_gsm8k(pool):
    rows = load("gsm8k_test.jsonl.gz")
    own, other = own_and_other(
        rows,
        lambda row: row["answer"],
        gsm8k_number,
        lambda a, b: a.replace(",", "") == b.replace(",", ""),
    )
    own_scores, other_scores = pool.score_batch(own), pool.score_batch(other)
    misses = [pair[1] for pair, s in zip(own, own_scores, strict=True) if s == 0]
    false_hits = [pair[1] for pair, s in zip(other, other_scores, strict=True) if s == 1]
    assert sum(own_scores) / len(own) >= 0.995, misses
    assert sum(other_scores) / len(other) <= 0.005, false_hits
    assert len(other) > 1250
