"""AcceValueHead: a hand-derived value, action-token pooling, padding and permutation."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.models.value_heads import AcceValueHead

LN3 = math.log(3.0)


def hand_set_head() -> AcceValueHead:
    """d=2, two action tokens, steps 0..3; the scorer reads the first coordinate, the first MLP
    layer is the identity and the second sums its inputs and adds 0.5."""
    head = AcceValueHead(2, action_dims=2, max_steps=3)
    with torch.no_grad():
        head.scorer.weight.copy_(torch.tensor([[1.0, 0.0]]))
        head.scorer.bias.zero_()
        head.step_embedding.weight.zero_()
        head.step_embedding.weight[2] = torch.tensor([-0.75 * LN3, 1.0])
        head.mlp[0].weight.copy_(torch.eye(2))
        head.mlp[0].bias.zero_()
        head.mlp[2].weight.copy_(torch.tensor([[1.0, 1.0]]))
        head.mlp[2].bias.fill_(0.5)
    return head


def run(head: AcceValueHead, hidden, padding=None, steps=(2,)) -> torch.Tensor:
    hidden = torch.tensor(hidden, dtype=torch.float32)
    if padding is None:
        padding = torch.zeros(hidden.shape[:2], dtype=torch.bool)
    logits = torch.zeros(hidden.shape[0], 2, 3)
    with torch.no_grad():
        return head(hidden, padding, logits, torch.tensor(steps))


def test_value_by_hand() -> None:
    # A non-action token (huge, first) and the two action tokens a1 = [0, 4], a2 = [ln 3, 0].
    # Scores 0 and ln 3, so the softmax weights are 1/4 and 3/4 and the pooled state is
    # [3/4 ln 3, 1]; the step-2 embedding [-3/4 ln 3, 1] makes it [0, 2]; GELU gives
    # [0, 2 Phi(2)], and the last layer 0.5 + 2 Phi(2) = 2.4545.
    value = run(hand_set_head(), [[[100.0, -100.0], [0.0, 4.0], [LN3, 0.0]]])
    phi2 = 0.5 * (1 + math.erf(2 / math.sqrt(2)))
    assert value.item() == pytest.approx(0.5 + 2 * phi2, abs=1e-6)


def test_only_action_tokens_are_read_and_their_order_does_not_matter() -> None:
    head = hand_set_head()
    a1, a2 = [0.0, 4.0], [LN3, 0.0]
    base = run(head, [[[100.0, -100.0], a1, a2]])
    assert run(head, [[[-7.0, 3.0], a1, a2]]) == base
    assert run(head, [[[100.0, -100.0], a2, a1]]).item() == pytest.approx(base.item(), abs=1e-6)
    # the control: changing an action token does change the value
    assert run(head, [[[100.0, -100.0], a1, [LN3, 1.0]]]) != base


def test_padded_action_tokens_get_no_weight() -> None:
    # Padding a2 leaves all the weight on a1 = [0, 4]: pooled [0, 4] + [-3/4 ln 3, 1] =
    # [-3/4 ln 3, 5], so the value is 0.5 + GELU(-3/4 ln 3) + GELU(5).
    head = hand_set_head()
    padding = torch.tensor([[False, False, True]])
    value = run(head, [[[100.0, -100.0], [0.0, 4.0], [LN3, 0.0]]], padding)
    gelu = torch.nn.functional.gelu
    expected = 0.5 + gelu(torch.tensor(-0.75 * LN3)) + gelu(torch.tensor(5.0))
    assert value.item() == pytest.approx(expected.item(), abs=1e-6)


def test_steps_past_the_last_share_its_embedding() -> None:
    head = hand_set_head()
    hidden = [[[0.0, 0.0], [0.0, 4.0], [LN3, 0.0]]] * 3
    values = run(head, hidden, steps=(2, 3, 9))
    assert values[1] == values[2]
    assert values[0] != values[1]


def test_detach_keeps_the_value_loss_out_of_the_hidden_states() -> None:
    for detach in (True, False):
        head = AcceValueHead(4, action_dims=2, max_steps=5, detach=detach)
        hidden = torch.randn(3, 5, 4, requires_grad=True)
        padding = torch.zeros(3, 5, dtype=torch.bool)
        head(hidden, padding, torch.zeros(3, 2, 7), torch.tensor([0, 1, 2])).sum().backward()
        assert (hidden.grad is None) == detach
        assert head.scorer.weight.grad.abs().sum() > 0
