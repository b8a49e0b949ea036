"""Named pause points, so that a failure test can kill a run at a known place.

Set ``RELAYRL_PAUSE_AT=point@n`` in a run's environment (Ray actors inherit it) and the ``n``-th
time a process reaches ``point`` it writes its pid to the file ``RELAYRL_PAUSE_MARKER`` names and
sleeps until it is killed. Unset, ``reach`` is one environment lookup. The points:

- ``train_step``: a trainer rank, with a step's batch received, before it trains on it;
- ``publish``: a trainer rank, as it starts publishing a version (weight sync);
- ``checkpoint``: the controller, with a checkpoint's trainer parts written but not committed.
"""

from __future__ import annotations

import os
import time
from collections import Counter

PAUSE_AT = "RELAYRL_PAUSE_AT"
PAUSE_MARKER = "RELAYRL_PAUSE_MARKER"
POINTS = ("train_step", "publish", "checkpoint")

_reached: Counter[str] = Counter()


def reach(point: str) -> None:
    """Pause here for good if ``RELAYRL_PAUSE_AT`` names this point and this is its turn."""
    spec = os.environ.get(PAUSE_AT)
    if not spec:
        return
    name, _, nth = spec.partition("@")
    if name not in POINTS:
        raise ValueError(f"{PAUSE_AT}={spec!r}: the point must be one of {POINTS}")
    if name != point:
        return
    _reached[point] += 1
    if _reached[point] != int(nth or 1):
        return
    marker = os.environ.get(PAUSE_MARKER)
    if marker:
        with open(marker, "w") as f:
            f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(3600)
