"""Rewarder: exact, math and user-rule scoring of decoded completions, failures contained and
counted."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import text_batch, tiny_config

from relayrl.config import ConfigError
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
        "rewarder.timeout_s=1",  # the tower parses for minutes; the others take ~0.2 s at most
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
        assert rewarder.stats().timeouts + rewarder.stats().errors == 1
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
    assert scored.score_errors == 1 and rewarder.stats().errors == 1


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
        assert scored.score_errors == 1 and rewarder.stats().errors == 1
    finally:
        rewarder.close()


def test_a_user_rule_runs_sandboxed_and_a_forever_loop_is_a_timeout():
    cfg = tiny_config(
        "model.tokenizer=builtin:byte",
        "rewarder.scorer=scoring_rules:exact_or_loop",  # tests/scoring_rules.py
        "rewarder.workers=1",
        "rewarder.timeout_s=0.5",  # the rule answers at once or never
    )
    rewarder = Rewarder(cfg)
    try:
        completions = ["975", "loop", "976", "975"]
        batch = text_batch(load_tokenizer("builtin:byte"), completions, ["975"] * 4, [True] * 4)
        summary, scored = rewarder.score(batch)
        assert scored.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
        assert summary["timeouts"] == 1 and summary["errors"] == 0
        assert rewarder.stats().timeouts == 1 and rewarder.stats().scored == 4
        assert rewarder.pool.counters == {"timeouts": 1, "errors": 0, "scored": 4}
    finally:
        rewarder.close()


def test_a_user_rule_scores_in_a_rewarder_actor(ray_session):
    # As in a run: the actor's pool imports the rule from the actor's own sys.path (here set by
    # PYTHONPATH, in a run by the driver's script directory, PYTHONPATH or an installed package).
    ray = ray_session
    cfg = tiny_config(
        "model.tokenizer=builtin:byte",
        "rewarder.scorer=scoring_rules:exact_or_loop",
        "rewarder.workers=1",
        "rewarder.timeout_s=0.5",
    )
    env = {"env_vars": {"PYTHONPATH": str(Path(__file__).parents[1])}}
    actor = ray.remote(Rewarder).options(num_cpus=0, runtime_env=env).remote(cfg)
    try:
        batch = text_batch(
            load_tokenizer("builtin:byte"), ["975", "loop", "975"], ["975"] * 3, [True] * 3
        )
        summary, scored = ray.get(actor.score.remote(batch))
        assert scored.rewards.tolist() == [1.0, 0.0, 1.0]
        assert summary["timeouts"] == 1 and summary["errors"] == 0
        ray.get(actor.close.remote())
    finally:
        ray.kill(actor)


@pytest.mark.parametrize(
    ("scorer", "reason"),
    [
        ("nope.mod:fn", "No module named 'nope'"),
        ("maths", "expected 'module:function'"),
    ],
)
def test_a_rule_that_cannot_be_found_is_refused_by_the_config_naming_it(scorer, reason):
    with pytest.raises(ConfigError) as info:
        tiny_config(f"rewarder.scorer={scorer}")
    assert f"rewarder.scorer = '{scorer}': {reason}" in str(info.value)
    assert "exact_answer, math" in str(info.value)


def test_a_rule_that_is_not_a_function_is_refused_when_the_rewarder_starts():
    cfg = tiny_config("rewarder.scorer=scoring_rules:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="scorer 'scoring_rules:NOT_A_FUNCTION': .* not callable"):
        Rewarder(cfg)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_closed_math_rewarder_leaves_no_process_and_no_temp_dir(tmp_path):
    # In a fresh interpreter whose temp dir is tmp_path (others' jobs share /tmp), from a script
    # with no main guard: once the rewarder closes, before the interpreter exits (a Ray actor is
    # killed, so exit handlers never run), its scoring processes are gone and no temp dir is left.
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "from pathlib import Path\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        "from conftest import tiny_config\n"
        "from relayrl.executors.rewarder import Rewarder\n"
        "rewarder = Rewarder(tiny_config('rewarder.scorer=math', 'rewarder.workers=2'))\n"
        "assert rewarder.pool.score_batch([('\\\\boxed{2}', '2')]) == [1.0]\n"
        "pids = [rewarder.pool._server.pid] + [w.pid for w in rewarder.pool._workers]\n"
        "rewarder.close()\n"
        "assert not [pid for pid in pids if Path(f'/proc/{pid}').exists()], pids\n"
        "assert not os.listdir(os.environ['TMPDIR'])\n"
        "os._exit(0)\n"
    )
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert list(temp.iterdir()) == []
