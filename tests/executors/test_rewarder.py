"""Rewarder: exact and math scoring of decoded completions, failures contained and counted."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import text_batch, tiny_config

from relayrl.executors.rewarder import Rewarder
from relayrl.models.lm import load_tokenizer


def test_exact_answer_scores_decoded_completions_and_zero_without_eos():
    cfg = tiny_config()
    rewarder = Rewarder(cfg)
    batch = text_batch(
        load_tokenizer(cfg.model.tokenizer_source),
        ["975", "976", "975"],
        ["975"] * 3,
        [True, True, False],
    )
    summary, scored = rewarder.score(batch)
    assert scored.completions == ["975", "976", "975"]
    assert scored.rewards.tolist() == [1.0, 0.0, 0.0]  # the third was cut before EOS
    assert summary["errors"] == 0 and summary["timeouts"] == 0


def test_a_batch_without_the_generators_text_is_refused_with_what_to_do():
    cfg = tiny_config()
    batch = text_batch(load_tokenizer(cfg.model.tokenizer_source), ["975"], ["975"], [True])
    with pytest.raises(ValueError, match="completions has 0 texts for 1 samples"):
        Rewarder(cfg).score(replace(batch, completions=[]))


def test_math_scorer_runs_sandboxed_and_counts_timeouts():
    cfg = tiny_config(
        "model.tokenizer=builtin:byte",
        "rewarder.scorer=math",
        "rewarder.workers=1",
        "rewarder.timeout_s=2",
    )
    rewarder = Rewarder(cfg)
    try:
        completions = [
            "so the answer is \\boxed{\\frac{1}{2}}",
            "\\boxed{0.5}",
            "\\boxed{3}",
            "\\boxed{9^{9^{9^{9^{9}}}}}",  # an exponent tower: must time out, not hang the run
        ]
        batch = text_batch(
            load_tokenizer("builtin:byte"), completions, ["\\frac12"] * 4, [True] * 4
        )
        summary, scored = rewarder.score(batch)
        assert scored.completions[0] == completions[0]  # bytes round-trip through the tokenizer
        assert scored.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
        assert summary["timeouts"] + summary["errors"] == 1
        assert rewarder.stats()["timeouts"] + rewarder.stats()["errors"] == 1
    finally:
        rewarder.close()


def test_an_exact_answer_scorer_that_raises_is_counted_and_scores_zero():
    cfg = tiny_config()
    rewarder = Rewarder(cfg)
    # A reference that is not a string (a dataset row with a numeric answer) makes the scorer
    # raise in this process; the other samples are scored as usual.
    batch = text_batch(
        load_tokenizer(cfg.model.tokenizer_source), ["975", "975"], ["975", 975], [True] * 2
    )
    summary, scored = rewarder.score(batch)
    assert scored.rewards.tolist() == [1.0, 0.0]
    assert summary["errors"] == 1 and summary["timeouts"] == 0
    assert scored.score_errors == 1 and rewarder.stats()["errors"] == 1


def test_a_math_scorer_that_raises_in_the_pool_is_counted_and_scores_zero():
    cfg = tiny_config("model.tokenizer=builtin:byte", "rewarder.scorer=math", "rewarder.workers=1")
    rewarder = Rewarder(cfg)
    try:
        # The same non-string reference makes rewards.math raise inside the worker, which reports
        # the error and is replaced; the next sample is scored by the new worker.
        completions = ["\\boxed{975}", "\\boxed{975}", "\\boxed{975}"]
        batch = text_batch(
            load_tokenizer("builtin:byte"), completions, ["975", 975, "975"], [True] * 3
        )
        summary, scored = rewarder.score(batch)
        assert scored.rewards.tolist() == [1.0, 0.0, 1.0]
        assert summary["errors"] == 1 and summary["timeouts"] == 0
        assert scored.score_errors == 1 and rewarder.stats()["errors"] == 1
    finally:
        rewarder.close()


def test_a_closed_math_rewarder_leaves_no_multiprocessing_temp_dirs(tmp_path):
    # In a fresh interpreter whose temp dir is tmp_path (others' jobs share /tmp): the forkserver
    # behind the pool puts its socket in a temp dir, which must be gone once the rewarder closes,
    # before the interpreter exits (a Ray actor is killed, so exit handlers never run).
    code = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        "from conftest import tiny_config\n"
        "from relayrl.executors.rewarder import Rewarder\n"
        "if __name__ == '__main__':\n"
        "    cfg = tiny_config('rewarder.scorer=math', 'rewarder.workers=2')\n"
        "    rewarder = Rewarder(cfg)\n"
        "    assert rewarder.pool.score_batch([('\\\\boxed{2}', '2')]) == [1.0]\n"
        "    assert os.listdir(os.environ['TMPDIR']), 'the pool should own a temp dir'\n"
        "    rewarder.close()\n"
        "    left = os.listdir(os.environ['TMPDIR'])\n"
        "    assert not left, left\n"
        "    os._exit(0)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == []
