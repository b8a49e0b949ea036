"""Reward-model executor: a learned reward from a sequence-classification model.

One stage per reward model of the config: ``reward_model`` (the stage of that name) and each
entry of ``reward_models`` (a stage named by its entry's ``name``). It decodes each prompt and
completion with the policy's tokenizer, encodes them as a text pair with the reward model's own
tokenizer (right-padded, cut at its ``max_length``), and takes the model's single logit as the
score. The batch's rewards become ``rule_weight * reward + weight * score``, the reward being what
the stages before put there (the rewarder's rule reward, plus the terms of the reward models
before this one); with ``rule_weight`` 1 each reward model adds ``weight * score``. Completions
cut at the length limit are scored like the others: the rule reward already gives them 0, and a
reward model is free to judge a truncated answer.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from relayrl.config import Config, RewardModelConfig
from relayrl.executors.stage_executor import StageExecutor
from relayrl.models.lm import DTYPES, load_tokenizer
from relayrl.types import RolloutBatch


def reward_model_section(cfg: Config, name: str) -> tuple[str, RewardModelConfig]:
    """Where the config of the reward-model stage called ``name`` is (``reward_model``, or
    ``reward_models.I`` for the entry of that name), and that config."""
    if name == "reward_model":
        if cfg.reward_model is None or cfg.reward_model.path is None:
            raise ValueError("reward_model.path is null: there is no reward model to load")
        return "reward_model", cfg.reward_model
    for i, entry in enumerate(cfg.reward_models):
        if entry.name == name:
            return f"reward_models.{i}", entry
    declared = ", ".join(rm.name for rm in cfg.reward_models) or "none"
    raise ValueError(f"no reward_models entry has name={name!r} (declared: {declared})")


class RewardModel(StageExecutor):
    """Scores completions with a classifier; a Ray actor in a run, a plain object in tests.
    ``name``: the stage, ``reward_model`` or a ``reward_models`` entry's name."""

    name = "reward_model"

    def __init__(self, cfg: Config, name: str = "reward_model"):
        torch.set_num_threads(cfg.ray.threads_per_executor)
        where, rc = reward_model_section(cfg, name)
        self.name = name  # before the base's tracer takes it
        super().__init__(cfg)
        self.section = rc
        self.policy_tokenizer = load_tokenizer(cfg.model.tokenizer_source)
        self.tokenizer = AutoTokenizer.from_pretrained(rc.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            rc.path, dtype=DTYPES[rc.dtype]
        ).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"{where}.path={rc.path!r}: the classifier has "
                f"{self.model.config.num_labels} labels; a reward model has 1 (its score)"
            )
        if self.tokenizer.pad_token_id is None:  # the attention mask carries the padding
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # where each row's last real token is
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"

    def score(self, batch: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        """A small summary, and ``batch`` with its rewards combined with the model's scores."""
        scores = self.scores(*self._texts(batch))
        before = batch.rewards if batch.rewards is not None else np.zeros(len(batch), np.float32)
        rc = self.section
        rewards = (rc.rule_weight * before + rc.weight * scores).astype(np.float32)
        summary = self.summary(batch) | {"score_mean": float(scores.mean()) if len(batch) else 0.0}
        logged = batch.stage_metrics | {f"{self.name}/score_mean": summary["score_mean"]}
        return summary, replace(batch, rewards=rewards, stage_metrics=logged)

    @torch.no_grad()
    def scores(self, prompts: list[str], completions: list[str]) -> np.ndarray:
        """[N] float32: the model's score of each (prompt, completion) pair."""
        out = np.zeros(len(prompts), dtype=np.float32)
        size = self.section.batch_size
        for offset in range(0, len(prompts), size):
            encoded = self.tokenizer(
                prompts[offset : offset + size],
                completions[offset : offset + size],
                padding=True,
                truncation=True,
                max_length=self.section.max_length,
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
