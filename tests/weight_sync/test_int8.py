"""Int8 compute at a receiver: int8 linear and embedding layers match their dequantised fp32
equivalents, a receiver fills them in place of the parametrization, and after every swap the
model computes with the newly published weights."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from relayrl.weight_sync import TRANSPORTS
from relayrl.weight_sync.buckets import Layout, ReceiverState, quantize
from relayrl.weight_sync.int8 import Int8Embedding, Int8Linear, to_int8


def test_int8_linear_on_a_hand_quantised_weight_and_input() -> None:
    # Row absmaxes 127/64 and 127/128: scales 1/64 and 1/128, int8 values exact. The input
    # [127/64, 1] spans [0, 127/64]: at 7 bits its step is 1/64 and it is [127, 64] exactly.
    linear = torch.nn.Linear(2, 2)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[127 / 64, -1.0], [0.5, 127 / 128]]))
        linear.bias.copy_(torch.tensor([1.0, -1.0]))
    int8 = Int8Linear.of(linear)
    assert int8.weight.tolist() == [[127, -64], [64, 127]]
    assert int8.scale.tolist() == [1 / 64, 1 / 128]
    # x @ W.T + b = [(127/64)^2 - 1 + 1, 127/128 + 127/128 - 1] = [3.937744140625, 0.984375]
    out = int8(torch.tensor([[127 / 64, 1.0]]))
    assert out.tolist() == [[3.937744140625, 0.984375]]


def _fake_quantized_input(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies: x on the 7-bit affine grid over [min(x, 0), max(x, 0)]."""
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    step = (high - low) / 127
    zero = round(-low / step)
    return torch.fake_quantize_per_tensor_affine(x, step, zero, 0, 127)


def test_int8_linear_equals_the_dequantised_matmul_of_its_quantised_input() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    int8 = Int8Linear.of(linear)
    values, scale = quantize(linear.weight, "int8")
    assert torch.equal(int8.weight, values) and torch.equal(int8.scale, scale)
    x = torch.randn(3, 5, 64)  # leading dims are flattened and restored
    weight = values.float() * scale[:, None]
    expected = torch.nn.functional.linear(_fake_quantized_input(x), weight, linear.bias)
    out = int8(x)
    assert out.shape == (3, 5, 48) and out.dtype == torch.float32
    assert torch.allclose(out, expected, atol=1e-4, rtol=1e-4)
    # Against the fp32 layer: near, but not equal (it did run on quantised numbers).
    error = (out - linear(x)).abs().max()
    assert 0 < error < 0.05 * linear(x).abs().max()


def test_int8_embedding_gathers_dequantised_rows() -> None:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(11, 6, padding_idx=0)
    int8 = Int8Embedding.of(embedding)
    values, scale = quantize(embedding.weight, "int8")
    ids = torch.tensor([[3, 0, 10], [3, 7, 7]])
    assert torch.equal(int8(ids), values[ids].float() * scale[ids][..., None])


def _tiny_lm() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=20,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def test_to_int8_keeps_the_state_dict_names_and_converts_once() -> None:
    model = _tiny_lm()
    names = list(model.state_dict())
    to_int8(model)
    state = model.state_dict()
    assert list(state) == names  # scales are not persistent: a receiver sees the trainer's names
    assert isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.model.embed_tokens, Int8Embedding)
    assert state["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    assert state["model.norm.weight"].dtype == torch.float32
    before = model.model.layers[0].mlp.up_proj
    to_int8(model)
    assert model.model.layers[0].mlp.up_proj is before


def test_an_int8_model_computes_log_probs_close_to_fp32() -> None:
    model = _tiny_lm()
    int8 = to_int8(copy.deepcopy(model))
    ids = torch.randint(0, 20, (4, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = torch.log_softmax(model(ids).logits, -1)
        approx = torch.log_softmax(int8(ids).logits, -1)
    error = (exact - approx).abs()
    assert 0 < error.max() < 0.02 and error.mean() < 0.005


def _publish_and_receive(model: torch.nn.Module, states: list[dict[str, torch.Tensor]]) -> None:
    """Publish every state in turn over shm to a receiver of ``model``, in int8."""
    pub = TRANSPORTS["shm"].Publisher(states[0], ["gen"])
    rcv = TRANSPORTS["shm"].Receiver(model, [pub.address], "gen", precision="int8")
    assert not rcv.zero_copy
    for version, state in enumerate(states):
        rcv.receive([pub.publish(version, state)])
        yield rcv
    pub.close()


def test_after_every_swap_an_int8_receiver_computes_with_the_new_weights() -> None:
    trained = []
    for seed in (0, 1, 2):  # a trainer's tied weights: one tensor under two names
        model = _tiny_lm()
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * seed * torch.randn_like(p))
        trained.append({n: t.clone() for n, t in model.state_dict().items()})
    model = to_int8(_tiny_lm())
    ids = torch.randint(0, 20, (3, 9), generator=torch.Generator().manual_seed(3))
    for version, rcv in enumerate(_publish_and_receive(model, trained)):
        reference = _tiny_lm()
        reference.load_state_dict(trained[version])
        with torch.no_grad(), rcv.serving() as served:
            out = model(ids).logits
            expected = to_int8(reference)(ids).logits
        assert served == version
        assert isinstance(model.model.layers[0].self_attn.q_proj, Int8Linear)
        assert torch.allclose(out, expected, atol=1e-6), f"version {version}"
        slot = rcv.state.slots[rcv.state.active][0]
        weight = model.model.layers[0].mlp.down_proj.weight
        assert slot.data_ptr() <= weight.data_ptr() < slot.data_ptr() + slot.numel()


def test_an_int8_receiver_never_serves_half_a_swap() -> None:
    """Every floating tensor holds the version number v: each int8 value is 127 and each scale
    v / 127, so a forward on ones(7) is relu(7v + v) summed over 33 rows times v, plus v:
    264 v^2 + v. Mixing one version's values or scales with another's gives another number."""
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    state = model.state_dict()

    def tensors(v: int) -> dict[str, torch.Tensor]:
        return {n: torch.full_like(t, float(v)) for n, t in state.items()}

    to_int8(model)
    pub = TRANSPORTS["shm"].Publisher(tensors(1), ["r0"])
    rcv = TRANSPORTS["shm"].Receiver(model, [pub.address], "r0", precision="int8")
    assert sorted(model.state_dict()) == sorted(state)
    stop, torn, seen = threading.Event(), [], set()

    def reader() -> None:
        x = torch.ones(1, 7)
        while not stop.is_set():
            with torch.no_grad(), rcv.serving() as v:
                out = model(x)
            if v >= 1 and not torch.allclose(out, torch.full_like(out, 264.0 * v * v + v)):
                torn.append((v, out.flatten()[:2].tolist()))
            seen.add(v)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    for version in range(1, 20):
        rcv.receive([pub.publish(version, tensors(version))])
        deadline = time.monotonic() + 5
        while version not in seen and time.monotonic() < deadline:  # let readers run on it
            time.sleep(0.001)
    stop.set()
    for t in readers:
        t.join(timeout=10)
    pub.close()
    assert not torn, torn[:3]
    assert seen >= set(range(1, 20))


def test_a_model_held_in_int8_must_be_received_in_int8() -> None:
    model = to_int8(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    layout = Layout.of({"0.weight": torch.zeros(3, 4), "0.bias": torch.zeros(3)})
    for precision in (None, "bf16", "fp8"):
        with pytest.raises(ValueError, match=r"\['0.weight'\] quantised .* precision='int8'"):
            ReceiverState(model, [layout], precision=precision)
