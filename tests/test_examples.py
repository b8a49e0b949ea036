"""The examples run, in a few steps each, and their own parts act on the run."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
from conftest import SMALL_LLM as SMALL
from conftest import TINY, text_batch, tiny_config

from relayrl.executors.rewarder import Rewarder
from relayrl.models.lm import load_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FAST = [*SMALL, *TINY, "steps=3", "mode=async"]


def _run(name: str, run_dir: Path, *options: str) -> list[dict]:
    """Run ``examples/NAME.py`` as a script, in this process (and its Ray); its metrics."""
    argv = [str(EXAMPLES / f"{name}.py"), "--run-dir", str(run_dir), *options, *FAST]
    old = sys.argv
    sys.argv = argv
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        sys.argv = old
    assert done.value.code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["samples"]["accounted"]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if "rollout/trained_reward_mean" in r]


def test_partial_credit_counts_the_right_digits_in_place():
    rule = runpy.run_path(str(EXAMPLES / "custom_rule.py"))["partial_credit"]
    assert rule("579", "579") == 1.0
    assert rule(" 570\n", "579") == pytest.approx(2 / 3)
    assert rule("57", "579") == pytest.approx(1 / 3)  # 2 of 3 right, but short: halved


def test_a_rule_of_your_own_scores_in_the_rewarder_and_a_raising_one_is_counted():
    rule = runpy.run_path(str(EXAMPLES / "custom_rule.py"))["partial_credit"]
    cfg = tiny_config()
    tokenizer = load_tokenizer(cfg.model.tokenizer_source)
    batch = text_batch(tokenizer, ["579", "570", "1"], ["579"] * 3, [True, True, False])
    _, scored = Rewarder(cfg, rule).score(batch)
    assert scored.rewards.tolist() == pytest.approx([1.0, 2 / 3, 0.0])  # unfinished scores 0
    summary, _ = Rewarder(cfg, _raising).score(batch)
    assert summary["errors"] == 2


def _raising(completion: str, reference: str) -> float:
    raise RuntimeError("a bug in a user's rule")


def test_the_custom_rule_example_runs(ray_session, tmp_path):
    steps = _steps(_run("custom_rule", tmp_path / "run"))
    assert [r["step"] for r in steps] == [1, 2, 3]


def test_the_extra_executor_example_places_its_auditor_and_penalises(ray_session, tmp_path):
    records = _run("extra_executor", tmp_path / "run", "--penalty", "100")
    roles = json.loads((tmp_path / "run" / "summary.json").read_text())["topology"]["roles"]
    assert [m["name"] for m in roles["format_auditor"]] == ["format_auditor"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    audited, books = summary["stages"]["format_auditor"], summary["samples"]
    # async: a batch still in flight at the end may or may not have passed the auditor
    assert books["trained"] + books["dropped_stale"] <= audited["scored"] <= books["generated"]
    assert 0 < audited["malformed"] <= audited["scored"]
    # a completion that is not a number lost 100: the trained reward fell far below the rule's
    assert any(
        r["rollout/trained_reward_mean"] < r["rollout/reward_mean"] - 1 for r in _steps(records)
    )


def test_the_custom_reward_model_example_adds_its_score(ray_session, tmp_path):
    steps = _steps(_run("custom_reward_model", tmp_path / "run", "--weight", "0.5"))
    assert steps and all(r["rollout/trained_reward_mean"] > r["rollout/reward_mean"] for r in steps)
