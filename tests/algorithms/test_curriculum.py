"""Curriculum: stages open in order when solved or over budget; weights mask unopened stages."""

import pytest

from relayrl.algorithms.curriculum import Curriculum

STAGES = ["easy", "medium", "hard"]


def test_starts_with_only_the_first_stage_open() -> None:
    c = Curriculum(STAGES, window=4)
    assert c.current == "easy"
    assert c.mask() == {"easy": 1.0, "medium": 0.0, "hard": 0.0}
    assert c.apply({"easy": 0.2, "medium": 0.3, "hard": 0.5}) == [1.0, 0.0, 0.0]


def test_opens_the_next_stage_only_on_a_full_window_at_the_threshold() -> None:
    c = Curriculum(STAGES, promote_at=0.75, window=4, review=1.0)
    for success in (True, True, True):
        c.record("easy", success)
    assert c.advance(step=1) is None  # 3 of 4 episodes: the window is not full yet
    c.record("easy", False)
    assert c.success_rate() == 0.75
    assert c.advance(step=2) == "medium"
    assert c.opened_at == [0, 2]
    # Earlier stages stay open; weights renormalise over the open ones.
    assert c.apply({"easy": 0.25, "medium": 0.25, "hard": 0.5}) == [0.5, 0.5, 0.0]
    # The new stage starts with an empty window; episodes of other stages do not count.
    assert c.success_rate() is None
    for _ in range(4):
        c.record("easy", True)
    assert c.advance(step=3) is None


def test_below_the_threshold_stays_and_only_the_newest_stage_counts() -> None:
    c = Curriculum(STAGES, promote_at=0.75, window=4)
    for success in (True, True, False, False, True, False):
        c.record("easy", success)
    assert c.success_rate() == 0.25  # the window keeps the last 4: F, F, T, F
    assert c.advance(step=10) is None
    c.record("medium", True)  # not open yet: ignored for promotion
    assert c.success_rate() == 0.25


def test_step_budget_opens_the_next_stage_for_a_run_that_cannot_solve_it() -> None:
    c = Curriculum(STAGES, window=4, max_steps_per_stage=5)
    assert c.advance(step=4) is None
    assert c.advance(step=5) == "medium"
    assert c.advance(step=9) is None
    assert c.advance(step=10) == "hard"
    assert c.advance(step=100) is None  # the last stage stays
    assert c.mask() == {"easy": 0.1, "medium": 0.1, "hard": 1.0}  # review=0.1 by default
    assert c.apply({"easy": 1.0, "medium": 1.0, "hard": 2.0}) == pytest.approx(
        [0.2 / 4.4, 0.2 / 4.4, 4 / 4.4]
    )


def test_state_round_trip() -> None:
    c = Curriculum(STAGES, window=2, max_steps_per_stage=3)
    c.advance(step=3)
    c.record("medium", True)
    d = Curriculum(STAGES, window=2, max_steps_per_stage=3)
    d.load_state_dict(c.state_dict())
    assert d.current == "medium" and d.opened_at == [0, 3] and d.success_rate() == 1.0
    with pytest.raises(ValueError, match="stages"):
        Curriculum(["a"]).load_state_dict(c.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": []}, "at least one"),
        ({"stages": ["a", "a"]}, "unique"),
        ({"stages": ["a"], "promote_at": 0.0}, "promote_at"),
        ({"stages": ["a"], "window": 0}, "window"),
        ({"stages": ["a"], "max_steps_per_stage": -1}, "max_steps_per_stage"),
        ({"stages": ["a"], "review": 1.5}, "review"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Curriculum(**kwargs)


def test_unknown_task_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown task 'other'"):
        Curriculum(STAGES).record("other", True)
