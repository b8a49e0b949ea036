"""Rewarder: exact and math scoring of decoded completions, failures contained and counted."""

from __future__ import annotations

import numpy as np
from conftest import tiny_config

from relayrl.executors.rewarder import Rewarder
from relayrl.models.lm import load_tokenizer
from relayrl.types import RolloutBatch


def _batch(tokenizer, completions: list[str], answers: list[str], finished: list[bool]):
    """One group: prompt "1+2=" then each completion followed by EOS."""
    prompt = tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    rows = [
        tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for c in completions
    ]
    width = len(prompt) + max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), dtype=np.int64)
    versions = np.full((len(rows), width), -1)
    for i, row in enumerate(rows):
        tokens[i, : len(prompt) + len(row)] = prompt + row
        versions[i, len(prompt) : len(prompt) + len(row)] = 0
    return RolloutBatch(
        tokens=tokens,
        prompt_len=np.full(len(rows), len(prompt)),
        completion_len=np.array([len(r) for r in rows]),
        logprobs=np.zeros((len(rows), width), dtype=np.float32),
        versions=versions,
        finished=np.array(finished),
        group_size=len(rows),
        answers=answers,
    )


def test_exact_answer_scores_decoded_completions_and_zero_without_eos():
    cfg = tiny_config()
    rewarder = Rewarder(cfg)
    batch = _batch(
        load_tokenizer(cfg.model.tokenizer), ["975", "976", "975"], ["975"] * 3, [True, True, False]
    )
    summary, scored = rewarder.score(batch)
    assert scored.completions == ["975", "976", "975"]
    assert scored.rewards.tolist() == [1.0, 0.0, 0.0]  # the third was cut before EOS
    assert summary["errors"] == 0 and summary["timeouts"] == 0


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
        batch = _batch(load_tokenizer("builtin:byte"), completions, ["\\frac12"] * 4, [True] * 4)
        summary, scored = rewarder.score(batch)
        assert scored.completions[0] == completions[0]  # bytes round-trip through the tokenizer
        assert scored.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
        assert summary["timeouts"] + summary["errors"] == 1
        assert rewarder.stats()["timeouts"] + rewarder.stats()["errors"] == 1
    finally:
        rewarder.close()
