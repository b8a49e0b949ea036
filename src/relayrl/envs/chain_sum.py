"""Chain sums: a long-tailed task whose completion length follows a heavy-tailed term count.

A prompt reads ``"3+1+4+1+5="``; the answer is a scratchpad of running sums, one after each term,
separated by spaces: ``"3 4 8 9 41"`` (by default each sum is written least-significant digit
first, as the addition task writes its answer, so the last one reads 14 reversed). The number of
terms is drawn from a truncated power law, ``P(k) ∝ k**-tail`` for ``k`` in ``2 .. terms_max``,
so most completions are short and a few are many times longer, as reasoning outputs are. With the
defaults (1-digit terms, ``terms_max=32``, ``tail=1.3``) the completion length's 99th percentile
is about 8 times its median (``length_quantiles`` measures it). The scratchpad is the reference:
a completion is right when it matches it whole (``rewarder.scorer=exact_answer``).
"""

from __future__ import annotations

import random
import zlib

from relayrl.envs.arithmetic import HELDOUT_SEED, Problem

HELD_OUT_EVERY = 16  # one problem in 16, by a hash of its terms, is never trained on


def _held_out(terms: tuple[int, ...]) -> bool:
    """Whether a problem belongs to the held-out class: a fixed 1/HELD_OUT_EVERY of every term
    count's problems, so that short problems (only 100 have two 1-digit terms) stay trainable."""
    return zlib.crc32(",".join(map(str, terms)).encode()) % HELD_OUT_EVERY == 0


class ChainSumTask:
    """Sums of a heavy-tailed number of ``digits``-digit terms, answered with running sums."""

    def __init__(
        self,
        digits: int = 1,
        terms_max: int = 32,
        tail: float = 1.3,
        reverse_answer: bool = True,
        heldout_size: int = 1000,
    ):
        if terms_max < 2:
            raise ValueError(f"task.terms_max={terms_max}: a chain sum has at least 2 terms")
        self.digits = digits
        self.reverse_answer = reverse_answer
        self._counts = list(range(2, terms_max + 1))
        self._weights = [k**-tail for k in self._counts]
        rng = random.Random(HELDOUT_SEED)
        self._heldout: list[tuple[int, ...]] = []
        while len(self._heldout) < heldout_size:
            terms = self._terms(rng)
            if _held_out(terms):
                self._heldout.append(terms)

    def _terms(self, rng: random.Random) -> tuple[int, ...]:
        """One problem's terms: a count from the power law, then uniform terms."""
        count = rng.choices(self._counts, self._weights)[0]
        return tuple(rng.randrange(10**self.digits) for _ in range(count))

    def problem(self, terms: tuple[int, ...]) -> Problem:
        """The problem for ``terms``: the prompt and the scratchpad of running sums."""
        sums, total = [], 0
        for term in terms:
            total += term
            sums.append(str(total)[::-1] if self.reverse_answer else str(total))
        return Problem("+".join(map(str, terms)) + "=", " ".join(sums))

    def heldout(self) -> list[Problem]:
        """The fixed held-out evaluation split: ``heldout_size`` draws from the task's
        distribution restricted to the held-out class (a short problem may recur, as it would
        in training)."""
        return [self.problem(terms) for terms in self._heldout]

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        """``n`` training problems, never from the held-out split."""
        out: list[Problem] = []
        while len(out) < n:
            terms = self._terms(rng)
            if not _held_out(terms):
                out.append(self.problem(terms))
        return out


def length_quantiles(task: ChainSumTask, n: int = 10_000, seed: int = 0) -> dict[str, float]:
    """Reference completion lengths in characters (one token each with the character tokenizer,
    EOS not counted) over ``n`` training problems: median, p90, p99, max and p99 / median."""
    lengths = sorted(len(p.answer) for p in task.sample(n, random.Random(seed)))
    at = {q: lengths[min(n - 1, int(q * n))] for q in (0.5, 0.9, 0.99)}
    return {
        "median": at[0.5],
        "p90": at[0.9],
        "p99": at[0.99],
        "max": lengths[-1],
        "p99_over_median": at[0.99] / at[0.5],
    }
