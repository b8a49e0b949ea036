"""Scoring rules of the tests' own, named "scoring_rules:<function>" (tests/ is on sys.path, and
a ScoringPool's workers get the caller's sys.path)."""

from __future__ import annotations

from pathlib import Path

NOT_A_FUNCTION = 3


def exact_or_loop(completion: str, reference: str) -> float:
    """1.0 when the completion equals the reference; loops forever on the completion "loop"."""
    while completion == "loop":
        pass
    return 1.0 if completion == reference else 0.0


def touch_then_loop(completion: str, reference: str) -> float:
    """Create the file named by ``reference``, then loop forever: a hung item, seen from outside."""
    Path(reference).touch()
    while True:
        pass
