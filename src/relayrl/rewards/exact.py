"""Exact-answer scoring for tasks whose answer is a short canonical string."""

from __future__ import annotations


def exact_answer(completion: str, reference: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the reference."""
    return 1.0 if completion.strip() == reference.strip() else 0.0
