"""The sample books of one source (real samples, or imagined env steps): every sample generated
was trained, dropped (by reason), lost with an executor, or is still in flight (by place)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class BooksUnbalanced(ValueError):
    """The identity generated = trained + dropped + lost + in flight does not hold."""


@dataclass(frozen=True)
class Books:
    """One source's books in ``unit`` (samples, env steps, imagined env steps).

    ``dropped`` maps a reason (``stale``, ``overflow``, ``error``, ``resume``) to its samples;
    ``in_flight`` maps a place (``resident``, ``prefetched``, ``open``, ``pipeline``) to the
    samples there when the books were taken, or is None when no one knows (a failed LLM run).
    ``beside`` holds counts reported with the books but outside the identity
    (``lost_unfinished``: work in progress that died uncounted, score errors, episodes).
    """

    unit: str
    generated: int
    trained: int
    dropped: Mapping[str, int] = field(default_factory=dict)
    lost: int = 0  # counted as generated, then died with an executor
    in_flight: Mapping[str, int] | None = field(default_factory=dict)
    beside: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gap(self) -> int | None:
        """generated - (trained + dropped + lost + in flight): 0 when the books balance, None
        when what is in flight is unknown."""
        if self.in_flight is None:
            return None
        out = self.trained + sum(self.dropped.values()) + self.lost + sum(self.in_flight.values())
        return self.generated - out

    def imbalance(self) -> str | None:
        """Why the books do not balance, naming the gap; None when they do."""
        gap = self.gap
        if gap == 0:
            return None
        if gap is None:
            return f"the {self.unit} in flight are unknown, so the books cannot be checked"
        parts = [f"trained {self.trained}"]
        parts += [f"dropped_{reason} {n}" for reason, n in self.dropped.items()]
        parts += [f"lost {self.lost}"]
        parts += [f"in_flight_{place} {n}" for place, n in (self.in_flight or {}).items()]
        side = "more" if gap > 0 else "fewer"
        return (
            f"{abs(gap)} {side} {self.unit} generated ({self.generated}) than accounted for: "
            + " + ".join(parts)
        )

    def check(self) -> None:
        """Raise ``BooksUnbalanced`` naming the gap unless generated = trained + dropped + lost +
        in flight."""
        if problem := self.imbalance():
            raise BooksUnbalanced(problem)

    def section(self) -> dict[str, Any]:
        """This source's section of summary.json: ``unit``, ``generated``, ``trained``,
        ``dropped_<reason>``, ``lost``, ``in_flight`` and ``in_flight_<place>`` (when known),
        ``accounted`` (the identity holds; absent when in flight is unknown), then ``beside``."""
        out: dict[str, Any] = {"unit": self.unit, "generated": self.generated}
        out["trained"] = self.trained
        out |= {f"dropped_{reason}": n for reason, n in self.dropped.items()}
        out["lost"] = self.lost
        if self.in_flight is not None:
            out["in_flight"] = sum(self.in_flight.values())
            out |= {f"in_flight_{place}": n for place, n in self.in_flight.items()}
            out["accounted"] = self.gap == 0
        return out | dict(self.beside)
