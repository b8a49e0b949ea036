"""Critic heads that read a policy backbone's hidden states.

Two heads, chosen by ``VLAConfig.value_head``, with one call signature
``head(hidden, padding, action_logits, steps) -> values``: ``ActionAwareValueHead`` (ours, the
default) and ``AcceValueHead`` (AcceRL's, Appendix D.2).

The default VLA critic is an attention-pooling head: one query attends over the backbone's token
states and a small MLP maps the pooled vector to a scalar value. Two things condition the query:

- the policy's own action distribution at this state (action-aware). We condition on the
  probabilities of the action logits, not on a sampled or chosen action: a query built from the
  chosen action would turn the head into Q(s, a), and GAE needs the state value V(s). The expected
  action embedding sum_a pi(a|s) E[a] tells the critic what the actor intends to do here (a near
  greedy actor about to reach its goal is worth more than a dithering one) while staying a function
  of the state alone;
- the episode step (clipped to ``max_steps``), so that the critic can see how much of the time
  limit is left, which matters for truncated episodes.

The action logits are always detached: the critic reads the actor's intent but its loss must never
move the policy's head. With ``detach=True`` the hidden states are detached too, so the value loss
trains only this head and never pulls the shared backbone away from what the actor needs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class ActionAwareValueHead(nn.Module):
    """V(s) by attention pooling of backbone states, conditioned on pi(.|s) and the episode step."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        action_dims: int,
        action_vocab: int,
        max_steps: int,
        *,
        detach: bool = True,
    ) -> None:
        super().__init__()
        self.detach = detach
        self.max_steps = max_steps
        self.query = nn.Parameter(torch.zeros(d_model))
        self.step_embedding = nn.Embedding(max_steps + 1, d_model)
        # One embedding per (dimension, token): the expected embedding is summed over dimensions.
        self.action_embedding = nn.Parameter(torch.empty(action_dims, action_vocab, d_model))
        self.attention = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_model), nn.Tanh(), nn.Linear(d_model, 1))
        nn.init.normal_(self.step_embedding.weight, std=0.02)
        nn.init.normal_(self.action_embedding, std=0.02)
        nn.init.orthogonal_(self.mlp[0].weight, gain=math.sqrt(2))
        nn.init.zeros_(self.mlp[0].bias)
        nn.init.orthogonal_(self.mlp[2].weight, gain=1.0)
        nn.init.zeros_(self.mlp[2].bias)

    def forward(
        self, hidden: Tensor, padding: Tensor, action_logits: Tensor, steps: Tensor
    ) -> Tensor:
        """Values [B] from hidden [B, N, d], padding [B, N] (true = ignore), logits [B, D, vocab]
        and steps [B] (int, clipped to ``max_steps``)."""
        if self.detach:
            hidden = hidden.detach()
        probs = action_logits.detach().softmax(dim=-1)
        intent = torch.einsum("bdv,dvm->bm", probs, self.action_embedding)
        step = self.step_embedding(steps.long().clamp(0, self.max_steps))
        query = (self.query + intent + step).unsqueeze(1)
        pooled, _ = self.attention(
            query, hidden, hidden, key_padding_mask=padding, need_weights=False
        )
        return self.mlp(self.norm(pooled.squeeze(1) + step)).squeeze(-1)


class AcceValueHead(nn.Module):
    """V(s) as AcceRL's action-aware value head: softmax-pooled action-token states + step.

        a_i = hidden state of action token i                          i = 1..D (the last D tokens)
        alpha = softmax_i(w . a_i + b)          over the action tokens that are not padding
        v = MLP_GELU(sum_i alpha_i a_i + E[min(step, max_steps)])

    From AcceRL (arXiv:2603.18464), Appendix D.2, as the issue describes it (the appendix text was
    not available to us): score each action token's hidden state with a linear scorer, pool them
    with the softmax of the scores, add a learned embedding of the episode step and map to one
    value with a Linear-GELU-Linear MLP. Unlike ``ActionAwareValueHead`` it reads only the action
    tokens (they have attended to everything else in the backbone) and ignores the action
    logits; ``action_logits`` stays in the signature so either head can be plugged in. With
    ``detach=True`` the hidden states are detached, so the value loss trains only this head.
    At least one action token of every row must be unpadded (VLAPolicy never pads them).
    """

    def __init__(
        self, d_model: int, action_dims: int, max_steps: int, *, detach: bool = True
    ) -> None:
        super().__init__()
        self.detach = detach
        self.action_dims = action_dims
        self.max_steps = max_steps
        self.scorer = nn.Linear(d_model, 1)
        self.step_embedding = nn.Embedding(max_steps + 1, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.Linear(d_model, 1))
        nn.init.normal_(self.step_embedding.weight, std=0.02)
        nn.init.orthogonal_(self.mlp[0].weight, gain=math.sqrt(2))
        nn.init.zeros_(self.mlp[0].bias)
        nn.init.orthogonal_(self.mlp[2].weight, gain=1.0)
        nn.init.zeros_(self.mlp[2].bias)

    def forward(
        self, hidden: Tensor, padding: Tensor, action_logits: Tensor, steps: Tensor
    ) -> Tensor:
        """Values [B] from hidden [B, N, d] whose last ``action_dims`` tokens are the action
        tokens, padding [B, N] (true = ignore), logits [B, D, vocab] (unused) and steps [B]."""
        if self.detach:
            hidden = hidden.detach()
        actions = hidden[:, -self.action_dims :]
        scores = self.scorer(actions).squeeze(-1)
        scores = scores.masked_fill(padding[:, -self.action_dims :], float("-inf"))
        pooled = torch.einsum("bd,bdm->bm", scores.softmax(dim=-1), actions)
        step = self.step_embedding(steps.long().clamp(0, self.max_steps))
        return self.mlp(pooled + step).squeeze(-1)
