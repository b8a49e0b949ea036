"""Synthetic addition with a verifiable answer and a fixed held-out split.

A prompt reads ``"123+456="``; the answer is the sum, by default written least-significant digit
first (``"975"``), which a small transformer learns far more easily than the usual order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

HELDOUT_SEED = 20_240_601  # the held-out split does not depend on the run seed


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer."""

    prompt: str
    answer: str


class AdditionTask:
    """Addition of two operands drawn uniformly from ``0 .. 10**digits - 1``."""

    def __init__(self, digits: int = 3, reverse_answer: bool = True, heldout_size: int = 1000):
        self.digits = digits
        self.reverse_answer = reverse_answer
        top = 10**digits
        if heldout_size > top * top // 2:
            raise ValueError(
                f"task.heldout_size={heldout_size} exceeds half of all {top * top} pairs"
            )
        rng = random.Random(HELDOUT_SEED)
        pairs: dict[tuple[int, int], None] = {}
        while len(pairs) < heldout_size:
            pairs[(rng.randrange(top), rng.randrange(top))] = None
        self._heldout = list(pairs)
        self._heldout_set = set(pairs)

    def problem(self, a: int, b: int) -> Problem:
        """The problem for operands ``a`` and ``b``."""
        total = str(a + b)
        return Problem(f"{a}+{b}=", total[::-1] if self.reverse_answer else total)

    def heldout(self) -> list[Problem]:
        """The fixed held-out evaluation split."""
        return [self.problem(a, b) for a, b in self._heldout]

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        """``n`` training problems, never from the held-out split."""
        top = 10**self.digits
        out: list[Problem] = []
        while len(out) < n:
            pair = (rng.randrange(top), rng.randrange(top))
            if pair not in self._heldout_set:
                out.append(self.problem(*pair))
        return out
