"""Group-relative advantages: each sample is scored against the other samples of its prompt.

Rewards arrive flat, as consecutive groups of ``group_size`` samples of the same prompt:
``rewards[g * group_size : (g + 1) * group_size]`` is group g. Every advantage function in
``ADVANTAGES`` takes ``(rewards, group_size)`` and returns one advantage per sample, [N]; the
trainer broadcasts it over that sample's tokens.
"""

from collections.abc import Callable

import torch
from torch import Tensor

AdvantageFn = Callable[[Tensor, int], Tensor]


def grpo_advantages(
    rewards: Tensor, group_size: int, *, eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """GRPO outcome advantages: rewards standardised within their group.

    A_i = (r_i - mean_g) / (std_g + eps)     normalize_std=True  (DeepSeekMath, arXiv:2402.03300)
    A_i =  r_i - mean_g                      normalize_std=False (Dr. GRPO, arXiv:2503.20783)

    std_g is the population standard deviation (unbiased=False, divide by group_size). DeepSeekMath
    does not say which one, and TRL and verl use the unbiased std; we differ because the population
    std maps a two-sample group [1, 0] to exactly [+1, -1] up to eps, and it is zero rather than nan
    for group_size=1. Groups whose rewards are
    all equal carry no learning signal and get advantage exactly 0, not a rounding residue of the
    mean divided by eps.

    Args:
        rewards: [N] float, N a multiple of group_size, groups laid out consecutively.
        group_size: samples per prompt, >= 1.
        eps: added to the std to keep near-constant groups finite.
        normalize_std: divide by the group std (GRPO) or only centre (Dr. GRPO).

    Returns:
        [N] advantages, same dtype and device as rewards.
    """
    groups = _grouped(rewards, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        advantages = advantages / (groups.std(dim=1, correction=0, keepdim=True) + eps)
    zero_signal = _zero_signal(groups).unsqueeze(1)
    return advantages.masked_fill(zero_signal, 0.0).reshape(-1)


def dr_grpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Dr. GRPO advantages (Liu et al., arXiv:2503.20783): A_i = r_i - mean_g, no std division.

    Dividing by the group std up-weights prompts that are nearly always solved or nearly always
    failed; Dr. GRPO drops that division. Dr. GRPO also replaces GRPO's per-sequence length mean
    with a constant normaliser; our losses use a batch token-mean instead (see ``losses.py``).
    Shapes and layout as in ``grpo_advantages``.
    """
    return grpo_advantages(rewards, group_size, normalize_std=False)


def frac_zero_signal_groups(rewards: Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal, so every advantage in them is zero.

    A learning-signal health metric: near 1.0 the prompts are all too easy or all too hard.
    ``rewards`` is [N] laid out as in ``grpo_advantages``.
    """
    return _zero_signal(_grouped(rewards, group_size)).float().mean().item()


def zero_signal_samples(rewards: Tensor, group_size: int) -> Tensor:
    """[N] bool, true for every sample of a group whose rewards are all equal (zero advantage).

    Such samples contribute exactly zero policy gradient, so a trainer may skip their
    forward/backward pass; ``rewards`` is [N] laid out as in ``grpo_advantages``.
    """
    return _zero_signal(_grouped(rewards, group_size)).repeat_interleave(group_size)


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
}


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """[N] -> [N / group_size, group_size], checking the layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got group_size={group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has N={rewards.numel()} entries, not a multiple of group_size={group_size}"
        )
    return rewards.reshape(-1, group_size)


def _zero_signal(groups: Tensor) -> Tensor:
    """[G, group_size] -> [G] bool, true where every reward in the group is equal."""
    return (groups == groups[:, :1]).all(dim=1)


def gae(
    rewards: Tensor,
    values: Tensor,
    terminated: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over a batch of padded segments, bootstrapping on cuts.

    delta_t = r_t + gamma * V_{t+1} * (1 - d_t) - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}          (A past the last valid step is 0)
    G_t     = A_t + V_t                                 (the value target)

    From Schulman et al. 2016 (arXiv:1506.02438). Row i holds one segment of L_i valid steps (see
    ``relayrl.types.Segment``): segments never span two episodes, so d_t is 1 only on the last valid
    step of a row whose ``terminated`` is true. Every other row was cut after L steps or truncated
    by a time limit, and its last step bootstraps from ``values[i, L_i]``, the value of the
    observation after it, as in AcceRL (arXiv:2603.18464). Treating truncation as termination
    would teach the critic that the episode ends there. Not part of ``ADVANTAGES``: it needs values
    and step structure, not groups of outcome rewards.

    Args:
        rewards: [B, T] float, reward of each step; anything on padding.
        values: [B, T + 1] float, V of the observation before each step plus, at column L_i, the
            bootstrap value of row i; anything after it (the critic's values are constants here).
        terminated: [B] bool, true where the row's last valid step ended the episode in the task's
            terms, so nothing follows it.
        mask: [B, T] bool or 0/1, true on valid steps; each row's valid steps form a prefix.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1]; 0 gives one-step TD errors, 1 discounted returns minus V_t.

    Returns:
        (advantages, returns), each [B, T] in the dtype of rewards, 0 on padding.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got gamma={gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got lam={lam}")
    if rewards.dim() != 2 or mask.shape != rewards.shape:
        raise ValueError(
            f"rewards and mask must share one shape [B, T], got {tuple(rewards.shape)} and "
            f"{tuple(mask.shape)}"
        )
    batch, steps = rewards.shape
    if values.shape != (batch, steps + 1):
        raise ValueError(
            f"values must be [B, T + 1] = [{batch}, {steps + 1}], got {tuple(values.shape)}"
        )
    if terminated.shape != (batch,):
        raise ValueError(f"terminated must be [B] = [{batch}], got {tuple(terminated.shape)}")
    mask = mask.bool()
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError("mask must be a prefix of true steps in every row, got a gap")

    rewards = rewards.detach()
    values = values.detach().to(rewards.dtype)
    lengths = mask.sum(dim=1)
    step = torch.arange(steps, device=rewards.device)
    last = step == (lengths - 1).unsqueeze(1)
    done = last & terminated.bool().unsqueeze(1)
    next_values = torch.where(done, 0.0, values[:, 1:])
    # Padding may hold anything (even nan); select it away so it cannot reach a valid step.
    deltas = torch.where(mask, rewards + gamma * next_values - values[:, :-1], 0.0)

    advantages = torch.zeros_like(rewards)
    running = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(steps)):
        # A terminal step is always a row's last, where running is already 0 from the padding.
        running = deltas[:, t] + gamma * lam * running
        advantages[:, t] = running
    returns = torch.where(mask, advantages + values[:, :-1], 0.0)
    return advantages, returns
