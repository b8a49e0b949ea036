"""Critic executor: a value model on tokens, so PPO with GAE runs for LLMs as GRPO does.

With ``trainer.advantage = gae`` the LLM pipeline places one critic as its last scoring stage. It
holds a token-classification model of the policy's architecture with one output (the value),
whose backbone starts from the policy as RL started (the run directory's ``start_policy/``), and
its own AdamW. For each batch it

1. computes V(s_t) for every completion token t: the value head on the hidden state of the token
   before it (the state the policy sampled t from);
2. computes GAE (``algorithms.advantages.gae``) with the sequence's reward on its last token, 0 on
   the others, discount ``critic.gamma`` and ``critic.lam``: every completion ends its episode (a
   completion cut at the length limit already scores 0);
3. normalises the advantages over the batch's completion tokens and puts them in
   ``token_advantages`` (aligned with ``tokens``), which the trainer uses instead of group
   advantages;
4. then takes ``critic.epochs`` passes of value regression (MSE to the GAE returns) on the batch,
   each one ``trainer_core.GradientStep`` (gradient norm clipped to 1; a nan or inf loss or norm
   takes no step and is counted in ``skipped_nonfinite``).

So the advantages of a batch come from the values before the critic learned from it. A replaced
critic starts again from ``start_policy/`` with a fresh head; a resumed run restores its weights
and optimizer from the run checkpoint.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import torch
from transformers import AutoModelForTokenClassification

from relayrl.algorithms.advantages import gae
from relayrl.config import Config
from relayrl.executors.stage_executor import StageExecutor
from relayrl.executors.trainer_core import GradientStep
from relayrl.types import RolloutBatch, StageStats


class Critic(StageExecutor):
    """Token-level value model; a Ray actor in a run, a plain object in tests."""

    name = "critic"

    def __init__(self, cfg: Config):
        torch.set_num_threads(cfg.ray.threads_per_executor)
        super().__init__(cfg)
        self.section = cfg.critic
        self.seed = cfg.run.seed
        self.model: torch.nn.Module | None = None
        self.gradient_step: GradientStep | None = None
        self.path: str | None = None
        self.updates = 0

    def load(self, path: str) -> None:
        """Start from the causal LM checkpoint at ``path``: its backbone, a fresh value head."""
        torch.manual_seed(self.seed + 17)
        self.model = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32
        )
        # AdamW's default weight decay; the value head's gradient norm clipped to 1.
        self.gradient_step = GradientStep(
            self.model, lr=self.section.lr, weight_decay=0.01, grad_clip=1.0
        )
        self.path = path

    def score(self, batch: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        """A small summary (value loss, explained variance), and ``batch`` with
        ``token_advantages``; then learns from the batch's returns."""
        if self.model is None:
            raise RuntimeError("call load() before score()")
        tokens = torch.from_numpy(batch.tokens)
        lengths = torch.from_numpy(batch.prompt_len + batch.completion_len)
        place, mask = self._positions(batch)
        with torch.no_grad():
            values = self._values(tokens, lengths, place)  # [B, T + 1]
        rewards = torch.zeros(mask.shape)
        last = (torch.from_numpy(batch.completion_len) - 1).clamp(min=0)
        rewards[torch.arange(len(batch)), last] = torch.from_numpy(batch.rewards).float()
        rewards = torch.where(mask, rewards, 0.0)
        advantages, returns = gae(
            rewards,
            values,
            torch.ones(len(batch), dtype=torch.bool),
            mask,
            gamma=self.section.gamma,
            lam=self.section.lam,
        )
        valid = advantages[mask]
        normalised = (
            (advantages - valid.mean()) / (valid.std() + 1e-8) if valid.numel() > 1 else advantages
        )
        aligned = np.zeros(batch.tokens.shape, dtype=np.float32)
        rows, cols = mask.nonzero(as_tuple=True)
        aligned[rows.numpy(), place[rows, cols].numpy() + 1] = normalised[rows, cols].numpy()
        explained = 1 - (returns[mask] - values[:, :-1][mask]).var() / (returns[mask].var() + 1e-8)
        skipped = self.gradient_step.skipped_nonfinite
        epochs = self.section.epochs
        losses = [self._fit(tokens, lengths, place, mask, returns) for _ in range(epochs)]
        summary = self.summary(batch) | {
            "value_loss": losses[-1] if losses else 0.0,
            "explained_variance": float(explained),
        }
        logged = {f"critic/{k}": summary[k] for k in ("value_loss", "explained_variance")}
        logged["critic/skipped_nonfinite"] = float(self.gradient_step.skipped_nonfinite - skipped)
        return summary, replace(
            batch, token_advantages=aligned, stage_metrics=batch.stage_metrics | logged
        )

    def _positions(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T + 1] the position whose hidden state gives V before completion token k (the
        token before it; k = T: after the last), clamped into the row; and [B, T] the mask of
        real completion tokens, T the longest completion."""
        steps = int(batch.completion_len.max()) if len(batch) else 0
        k = torch.arange(steps + 1)[None, :]
        prompt = torch.from_numpy(batch.prompt_len)[:, None]
        length = torch.from_numpy(batch.prompt_len + batch.completion_len)[:, None]
        place = torch.minimum(prompt + k - 1, length - 1)
        mask = k[:, :steps] < torch.from_numpy(batch.completion_len)[:, None]
        return place, mask

    def _values(
        self, tokens: torch.Tensor, lengths: torch.Tensor, place: torch.Tensor
    ) -> torch.Tensor:
        """V at ``place`` ([B, K] positions) from one forward pass of the value model."""
        attention = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).long()
        out = self.model(input_ids=tokens, attention_mask=attention).logits[..., 0]  # [B, L]
        return out.gather(1, place)

    def _fit(self, tokens, lengths, place, mask, returns) -> float:
        """One value-regression step on the batch (none if its loss or gradient is not
        finite); its loss."""
        values = self._values(tokens, lengths, place)[:, :-1]
        loss = (values - returns)[mask].square().mean()
        _, stepped = self.gradient_step.step(loss)
        self.updates += stepped
        return float(loss.detach())

    def stats(self) -> StageStats:
        """The stage's counters, its optimizer steps and those skipped as not finite."""
        skipped = self.gradient_step.skipped_nonfinite if self.gradient_step else 0
        return replace(super().stats(), updates=self.updates, skipped_nonfinite=skipped)

    def state_dict(self) -> dict:
        """Weights, optimizer state and skip counter, where it started, counters."""
        return copy.deepcopy(
            super().state_dict()
            | {
                "path": self.path,
                "model": None if self.model is None else self.model.state_dict(),
                "gradient_step": None
                if self.gradient_step is None
                else self.gradient_step.state_dict(),
                "updates": self.updates,
            }
        )

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""
        if state["path"] is not None:
            self.load(state["path"])
            self.model.load_state_dict(state["model"])
            self.gradient_step.load_state_dict(state["gradient_step"])
        super().load_state_dict(state)
        self.updates = state["updates"]
