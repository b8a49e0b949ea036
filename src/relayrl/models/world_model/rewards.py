"""The imagined episode's reward and end, from M_reward's success probabilities: pure functions
over a batch of imagined episodes stepped together.

Reward (potential-based shaping, Ng et al., 1999, with the success probability as the potential,
as AcceRL credits for part of its gain)::

    r_t = p(o_{t+1}) - p(o_t) + terminal_reward * [the episode ends on the threshold at t + 1]

so over an episode o_0 .. o_T the rewards sum to ``p(o_T) - p(o_0)``, plus ``terminal_reward`` if
it ended in success. The episode ends in success the step the success probability reaches
``threshold``; it ends in failure (terminated, no terminal reward, nothing bootstrapped) the step
the failure head's probability reaches ``fail_threshold`` without success; and it is cut
(``truncated``: the value of o_T is bootstrapped, there is no terminal reward) when it reaches
``max_steps`` without either. The start frame is never judged: an episode that starts above a
threshold still takes one step.
"""

from __future__ import annotations

import torch
from torch import Tensor


def imagined_termination(
    next_prob: Tensor,
    steps: Tensor,
    *,
    threshold: float,
    max_steps: int,
    next_fail: Tensor | None = None,
    fail_threshold: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(succeeded, failed, truncated), bool [B] each, after a step that reached success
    probability ``next_prob`` [B] (and failure probability ``next_fail`` [B], if given) and
    brought each episode to ``steps`` [B] steps; success wins a tie with failure, both with the
    cap."""
    succeeded = next_prob >= threshold
    failed = torch.zeros_like(succeeded)
    if next_fail is not None:
        failed = ~succeeded & (next_fail >= fail_threshold)
    truncated = ~succeeded & ~failed & (steps >= max_steps)
    return succeeded, failed, truncated


def imagined_reward(
    prob: Tensor, next_prob: Tensor, succeeded: Tensor, *, terminal_reward: float
) -> Tensor:
    """The reward [B] of transitions from frames of success probability ``prob`` [B] to
    ``next_prob`` [B]: the change of potential, plus ``terminal_reward`` where ``succeeded``
    (bool [B]) says the episode ended in success."""
    return next_prob - prob + terminal_reward * succeeded.to(next_prob.dtype)
