"""The long-tailed chain-sum task: its scratchpad, its held-out split and its length tail."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from relayrl.config import load_config
from relayrl.envs import build_task
from relayrl.envs.chain_sum import ChainSumTask, length_quantiles
from relayrl.preflight import check

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "chain_sum.yaml"


def test_the_answer_is_the_running_sums_each_written_backwards():
    task = ChainSumTask(digits=1, heldout_size=10)
    problem = task.problem((3, 1, 4, 1, 5))
    assert problem.prompt == "3+1+4+1+5="
    assert problem.answer == "3 4 8 9 41"  # 3, 4, 8, 9, 14 with 14 written least digit first
    forwards = ChainSumTask(digits=2, reverse_answer=False, heldout_size=10)
    assert forwards.problem((95, 7)).answer == "95 102"


def test_training_problems_never_come_from_the_held_out_class():
    task = ChainSumTask(digits=1, terms_max=4, heldout_size=300)
    held = {p.prompt for p in task.heldout()}
    drawn = task.sample(3000, random.Random(0))
    assert not held & {p.prompt for p in drawn}
    assert {len(p.prompt.split("+")) for p in drawn} == {2, 3, 4}
    # The short problems stay trainable: of the 100 two-term ones, only about 1 in 16 is held out.
    two_terms = {p.prompt for p in drawn if p.prompt.count("+") == 1}
    assert len(two_terms) >= 85


def test_the_held_out_split_does_not_depend_on_the_run():
    assert ChainSumTask(heldout_size=50).heldout() == ChainSumTask(heldout_size=50).heldout()


def test_the_default_length_tail_has_p99_about_8_times_the_median():
    q = length_quantiles(ChainSumTask(heldout_size=10))
    assert 7 <= q["p99_over_median"] <= 9.5, q
    assert q["max"] <= 32 * 3 + 31  # 32 sums of at most 3 digits, 31 spaces


def test_a_lighter_tail_shortens_the_long_problems():
    heavy = length_quantiles(ChainSumTask(tail=1.0, heldout_size=10), n=4000)
    light = length_quantiles(ChainSumTask(tail=3.0, heldout_size=10), n=4000)
    assert light["p90"] < heavy["p90"]


def test_the_shipped_config_builds_the_task_and_passes_preflight():
    cfg = load_config(CONFIG)
    task = build_task(cfg.task)
    assert isinstance(task, ChainSumTask) and len(task.heldout()) == 500
    longest = max(len(p.prompt) + len(p.answer) + 1 for p in task.heldout())
    assert longest <= cfg.model.max_positions
    assert max(len(p.answer) + 1 for p in task.heldout()) <= cfg.generator.max_new_tokens
    check(cfg)  # every prompt and target is encodable by the character tokenizer


def test_chain_sum_options_are_refused_for_another_task():
    with pytest.raises(ValueError, match=r"task.terms_max = 8: read only with task.name=chain_sum"):
        load_config(None, ["task.terms_max=8"])
