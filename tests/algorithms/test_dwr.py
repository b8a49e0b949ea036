import pickle
from collections import Counter

import pytest

from relayrl.algorithms.dwr import DynamicWeightedResampler

TASKS = ["open-drawer", "pick-cube", "push-button"]


def approx(weights: dict[str, float], expected: dict[str, float]) -> None:
    assert weights == pytest.approx(expected, abs=1e-12)


def test_with_no_data_every_task_is_equally_likely():
    approx(DynamicWeightedResampler(TASKS).weights(), dict.fromkeys(TASKS, 1 / 3))


def test_weights_follow_smoothed_failure_rates_by_hand():
    dwr = DynamicWeightedResampler(TASKS, window=4, alpha=1.0)
    for _ in range(4):
        dwr.record("open-drawer", success=False)
        dwr.record("pick-cube", success=True)

    # failure rates (failures + 1) / (episodes + 2): always fails 5/6, always succeeds 1/6,
    # unseen 1/2; they sum to 9/6, so the weights are 5/9, 1/9 and 3/9.
    approx(dwr.weights(), {"open-drawer": 5 / 9, "pick-cube": 1 / 9, "push-button": 1 / 3})


def test_alpha_sets_the_strength_of_the_prior():
    dwr = DynamicWeightedResampler(TASKS[:2], alpha=0.5)
    dwr.record("open-drawer", success=False)
    dwr.record("open-drawer", success=True)
    dwr.record("open-drawer", success=False)
    # open-drawer: (2 + 0.5) / (3 + 1) = 5/8; pick-cube unseen: 0.5 / 1 = 4/8
    approx(dwr.weights(), {"open-drawer": 5 / 9, "pick-cube": 4 / 9})


def test_the_window_forgets_old_results():
    dwr = DynamicWeightedResampler(TASKS[:2], window=2)
    dwr.record("open-drawer", success=False)
    dwr.record("open-drawer", success=False)
    dwr.record("open-drawer", success=True)
    dwr.record("open-drawer", success=True)
    # only the two successes remain: (0 + 1) / (2 + 2) = 1/4 against the unseen task's 1/2;
    # remembering all four episodes would give (2 + 1) / (4 + 2) = 1/2 and equal weights.
    approx(dwr.weights(), {"open-drawer": 1 / 3, "pick-cube": 2 / 3})


def test_acce_weights_by_hand():
    dwr = DynamicWeightedResampler(TASKS, window=4, alpha=0.5, formula="acce")
    # every history starts as four successes: each weight is (4 - 4) + 0.5, so uniform
    approx(dwr.weights(), dict.fromkeys(TASKS, 1 / 3))
    for success in (False, False, True):
        dwr.record("open-drawer", success)
    dwr.record("pick-cube", success=True)
    # open-drawer: 1 recorded + 1 prefilled success, (4 - 2) + 0.5 = 5/2; pick-cube: 4 successes,
    # 1/2; push-button unseen, 1/2 (the smoothed formula would give it 1/2 of a failure rate,
    # more than pick-cube). Total 7/2.
    approx(dwr.weights(), {"open-drawer": 5 / 7, "pick-cube": 1 / 7, "push-button": 1 / 7})
    dwr.record("open-drawer", success=False)
    dwr.record("open-drawer", success=False)
    # the window holds F, S, F, F of open-drawer's five: (4 - 1) + 0.5 = 7/2, total 9/2
    approx(dwr.weights(), {"open-drawer": 7 / 9, "pick-cube": 1 / 9, "push-button": 1 / 9})


def test_acce_and_smoothed_differ_while_windows_fill():
    # One failure of open-drawer and nothing else: acce weighs it (1 + 1) against 1 for each
    # unseen task (2/4, 1/4, 1/4); smoothed weighs (1 + 1) / (1 + 2) = 2/3 against 1/2 (4/10,
    # 3/10, 3/10).
    acce = DynamicWeightedResampler(TASKS, formula="acce")
    smoothed = DynamicWeightedResampler(TASKS)
    for dwr in (acce, smoothed):
        dwr.record("open-drawer", success=False)
    approx(acce.weights(), {"open-drawer": 1 / 2, "pick-cube": 1 / 4, "push-button": 1 / 4})
    approx(smoothed.weights(), {"open-drawer": 2 / 5, "pick-cube": 3 / 10, "push-button": 3 / 10})


def test_sampling_frequencies_match_the_weights():
    dwr = DynamicWeightedResampler(TASKS, window=4, seed=0)
    for _ in range(4):
        dwr.record("open-drawer", success=False)
        dwr.record("pick-cube", success=True)
    draws = 20_000

    counts = Counter(dwr.sample() for _ in range(draws))

    # the std of a frequency near 1/3 over 20k draws is 0.0033; 0.015 is 4.5 of them
    for task, weight in dwr.weights().items():
        assert counts[task] / draws == pytest.approx(weight, abs=0.015)


def test_the_seed_makes_sampling_reproducible():
    first, second = (DynamicWeightedResampler(TASKS, seed=7) for _ in range(2))
    assert [first.sample() for _ in range(50)] == [second.sample() for _ in range(50)]


def test_state_dict_round_trip_restores_outcomes_and_random_state():
    dwr = DynamicWeightedResampler(TASKS, window=3, seed=3)
    for success in (False, False, True, False):
        dwr.record("pick-cube", success=success)
    dwr.sample()
    state = pickle.loads(pickle.dumps(dwr.state_dict()))

    restored = DynamicWeightedResampler(TASKS, window=3, seed=99)
    restored.load_state_dict(state)

    assert restored.weights() == dwr.weights()
    assert [restored.sample() for _ in range(20)] == [dwr.sample() for _ in range(20)]


def test_loading_into_a_smaller_window_keeps_the_newest_outcomes():
    dwr = DynamicWeightedResampler(TASKS[:2], window=4)
    for success in (False, False, True, True):
        dwr.record("open-drawer", success=success)
    smaller = DynamicWeightedResampler(TASKS[:2], window=2)
    smaller.load_state_dict(dwr.state_dict())
    approx(smaller.weights(), {"open-drawer": 1 / 3, "pick-cube": 2 / 3})


def test_unknown_task_names_are_rejected():
    dwr = DynamicWeightedResampler(TASKS)
    with pytest.raises(ValueError, match="unknown task 'stack-blocks'.*open-drawer"):
        dwr.record("stack-blocks", success=True)
    with pytest.raises(ValueError, match="state holds tasks"):
        dwr.load_state_dict(DynamicWeightedResampler(TASKS[:2]).state_dict())


@pytest.mark.parametrize(
    ("tasks", "kwargs", "message"),
    [
        ([], {}, "at least one task"),
        (["a", "a"], {}, "unique"),
        (TASKS, {"window": 0}, "window=0"),
        (TASKS, {"alpha": 0.0}, "alpha=0.0"),
        (TASKS, {"formula": "count"}, "formula must be one of"),
    ],
)
def test_bad_arguments_are_rejected(tasks, kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicWeightedResampler(tasks, **kwargs)
