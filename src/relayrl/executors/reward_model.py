"""Reward-model executor: a learned reward from a sequence-classification model.

It decodes each prompt and completion with the policy's tokenizer, encodes them as a text pair
with the reward model's own tokenizer (right-padded, cut at ``reward_model.max_length``), and
takes the model's single logit as the score. The batch's rewards become
``rule_weight * rule reward + weight * score``, the rule reward being what the rewarder put there.
Completions cut at the length limit are scored like the others: the rule reward already gives
them 0, and a reward model is free to judge a truncated answer.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from relayrl.config import Config
from relayrl.models.lm import DTYPES, load_tokenizer
from relayrl.observability.tracing import Span, Tracer
from relayrl.types import RolloutBatch


class RewardModel:
    """Scores completions with a classifier; a Ray actor in a run, a plain object in tests."""

    name = "reward_model"

    def __init__(self, cfg: Config):
        torch.set_num_threads(cfg.ray.threads_per_executor)
        rc = cfg.reward_model
        if rc.path is None:
            raise ValueError("reward_model.path is null: there is no reward model to load")
        self.cfg = rc
        self.policy_tokenizer = load_tokenizer(cfg.model.tokenizer_source)
        self.tokenizer = AutoTokenizer.from_pretrained(rc.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            rc.path, dtype=DTYPES[rc.dtype]
        ).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward_model.path={rc.path!r}: the classifier has "
                f"{self.model.config.num_labels} labels; a reward model has 1 (its score)"
            )
        if self.tokenizer.pad_token_id is None:  # the attention mask carries the padding
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # where each row's last real token is
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.tracer = Tracer(self.name)
        self.scored = 0

    def score(self, batch: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        """A small summary, and ``batch`` with its rewards combined with the model's scores."""
        with self.tracer.span("reward_model"):
            return self._score(batch)

    def _score(self, batch: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        start = time.perf_counter()
        scores = self.scores(*self._texts(batch))
        rule = batch.rewards if batch.rewards is not None else np.zeros(len(batch), np.float32)
        rewards = (self.cfg.rule_weight * rule + self.cfg.weight * scores).astype(np.float32)
        self.scored += len(batch)
        summary = {
            "samples": len(batch),
            "errors": 0,
            "timeouts": 0,
            "score_mean": float(scores.mean()) if len(batch) else 0.0,
            "busy_s": time.perf_counter() - start,
        }
        logged = batch.stage_metrics | {"reward_model/score_mean": summary["score_mean"]}
        return summary, replace(batch, rewards=rewards, stage_metrics=logged)

    @torch.no_grad()
    def scores(self, prompts: list[str], completions: list[str]) -> np.ndarray:
        """[N] float32: the model's score of each (prompt, completion) pair."""
        out = np.zeros(len(prompts), dtype=np.float32)
        size = self.cfg.batch_size
        for offset in range(0, len(prompts), size):
            encoded = self.tokenizer(
                prompts[offset : offset + size],
                completions[offset : offset + size],
                padding=True,
                truncation=True,
                max_length=self.cfg.max_length,
                return_tensors="pt",
            )
            logits = self.model(**encoded).logits
            out[offset : offset + size] = logits[:, 0].float().numpy()
        return out

    def _texts(self, batch: RolloutBatch) -> tuple[list[str], list[str]]:
        """Each row's prompt and completion as text (the rewarder's decoding, if it ran)."""
        decode = self.policy_tokenizer.decode
        rows = zip(batch.tokens, batch.prompt_len, batch.completion_len, strict=True)
        prompts, completions = [], []
        for i, (row, p, c) in enumerate(rows):
            prompts.append(decode(row[:p], skip_special_tokens=True))
            done = batch.completions[i] if batch.completions else None
            completions.append(
                done if done is not None else decode(row[p : p + c], skip_special_tokens=True)
            )
        return prompts, completions

    def stats(self) -> dict[str, float]:
        """Counters for the run summary."""
        return {"busy_s": self.tracer.busy_s(), "scored": self.scored}

    def trace(self) -> tuple[list[Span], list[Span]]:
        """Busy spans and waits recorded so far."""
        return self.tracer.spans, self.tracer.waits

    def state_dict(self) -> dict:
        """Its counter (the weights are the checkpoint's at reward_model.path)."""
        return {"scored": self.scored}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counter."""
        self.scored = state["scored"]
