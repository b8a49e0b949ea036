"""Reference executor: the frozen policy of the KL term, scoring completions' log-probs.

It holds the policy as it was when RL started (after the warm start): the workload saves the
trainer's version-0 weights to the run directory (``start_policy/``), every replica ``load``s
them, and a resumed run reloads them from there. ``score`` fills each completion token's
log-probability under that policy (``ref_logprobs``, aligned with ``logprobs``), computed as the
trainer computes log pi: the logits divided by the sampling temperature. The trainer turns them
into the KL term (in the loss or in the reward, ``trainer.kl_in``); the summary's ``kl_mu_ref`` is
the mean over completions of the summed estimate of KL(mu || ref), mu being the behaviour
log-probs the generator recorded.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from relayrl.algorithms.kl import sequence_kl
from relayrl.config import Config
from relayrl.executors.stage_executor import StageExecutor
from relayrl.models.lm import DTYPES, token_logprobs
from relayrl.types import RolloutBatch

ROWS_PER_FORWARD = 64  # bounds the logits' memory: [rows, L, vocab] float32


class Reference(StageExecutor):
    """Frozen reference policy; a Ray actor in a run, a plain object in tests."""

    name = "reference"

    def __init__(self, cfg: Config):
        torch.set_num_threads(cfg.ray.threads_per_executor)
        super().__init__(cfg)
        self.model: torch.nn.Module | None = None
        self.path: str | None = None

    def load(self, path: str) -> None:
        """Load the reference weights from a Hugging Face checkpoint directory."""
        dtype = DTYPES[self.cfg.reference.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.path = path

    def score(self, batch: RolloutBatch) -> tuple[dict[str, float], RolloutBatch]:
        """A small summary, and ``batch`` with ``ref_logprobs`` filled in."""
        if self.model is None:
            raise RuntimeError("call load() before score()")
        ref = np.zeros_like(batch.logprobs)
        for offset in range(0, len(batch), ROWS_PER_FORWARD):
            rows = slice(offset, offset + ROWS_PER_FORWARD)
            with torch.no_grad():
                ref[rows, 1:] = token_logprobs(
                    self.model,
                    torch.from_numpy(batch.tokens[rows]),
                    torch.from_numpy(batch.prompt_len[rows] + batch.completion_len[rows]),
                    self.cfg.generator.temperature,
                ).numpy()
        mask = torch.from_numpy(batch.completion_mask)
        ref = np.where(batch.completion_mask, ref, 0.0).astype(np.float32)
        kl = sequence_kl(
            torch.from_numpy(batch.logprobs),
            torch.from_numpy(ref),
            mask,
            self.cfg.trainer.kl_estimator,
        )
        summary = self.summary(batch) | {"kl_mu_ref": float(kl.mean()) if len(batch) else 0.0}
        logged = batch.stage_metrics | {"reference/kl_mu_ref": summary["kl_mu_ref"]}
        return summary, replace(batch, ref_logprobs=ref, stage_metrics=logged)

    def state_dict(self) -> dict:
        """Where its weights are (the run directory's copy) and its counters."""
        return super().state_dict() | {"path": self.path}

    def load_state_dict(self, state: dict) -> None:
        """Reload the weights ``state_dict`` names and restore the counters."""
        if state["path"] is not None:
            self.load(state["path"])
        super().load_state_dict(state)
