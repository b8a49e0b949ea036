"""The imagined episode's reward and end, from M_reward's success probabilities: pure functions
over a batch of imagined episodes stepped together.

Reward (potential-based shaping, Ng et al., 1999, with the success probability as the potential,
as AcceRL credits for part of its gain)::

    r_t = p(o_{t+1}) - p(o_t) + terminal_reward * [the episode ends on the threshold at t + 1]

so over an episode o_0 .. o_T the rewards sum to ``p(o_T) - p(o_0)``, plus ``terminal_reward`` if
it ended in success. The episode ends in success (``terminated``) the step the probability
reaches ``threshold``, and is cut (``truncated``: the value of o_T is bootstrapped, there is no
terminal reward) when it reaches ``max_steps`` without that. The start frame is never judged: an
episode that starts above the threshold still takes one step.
"""

from __future__ import annotations

from torch import Tensor


def imagined_termination(
    next_prob: Tensor, steps: Tensor, *, threshold: float, max_steps: int
) -> tuple[Tensor, Tensor]:
    """(terminated, truncated), bool [B] each, after a step that reached success probability
    ``next_prob`` [B] and brought each episode to ``steps`` [B] steps; success wins a tie with
    the cap."""
    terminated = next_prob >= threshold
    truncated = ~terminated & (steps >= max_steps)
    return terminated, truncated


def imagined_reward(
    prob: Tensor, next_prob: Tensor, terminated: Tensor, *, terminal_reward: float
) -> Tensor:
    """The reward [B] of transitions from frames of success probability ``prob`` [B] to
    ``next_prob`` [B]: the change of potential, plus ``terminal_reward`` where ``terminated``
    (bool [B]) says the episode ended in success."""
    return next_prob - prob + terminal_reward * terminated.to(next_prob.dtype)
