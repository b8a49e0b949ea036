"""Int8 compute for a weight-sync receiver: linear and embedding layers that run on int8 weights.

``to_int8(model)`` replaces every ``nn.Linear`` (the output layer included) and ``nn.Embedding``
of a model with a module that holds the weight as int8 with one float32 scale per row (the
``sync.precision=int8`` storage format: weight ~= int8 * scale, scale = row absmax / 127), and
computes with it directly:

- ``Int8Linear``: torch's dynamically quantised int8 matmul (``quantized::linear_dynamic``, the
  kernel of ``torch.ao.quantization.quantize_dynamic``): the input is quantised per call, the
  product runs in int8. On CPU it is several times faster than the fp32 matmul, where the
  weight-only kernel (``torch._weight_int8pack_mm``, float activations) is several times slower.
- ``Int8Embedding``: gathers the int8 rows of the looked-up tokens and scales only those.

The weight keeps its state-dict name (``...q_proj.weight``, now int8) and the scale is a
non-persistent buffer, so the model's state dict still names exactly the trainer's tensors. A
receiver (``buckets.ReceiverState``) fills both in its slots and, at a swap, hands the module
the new ones with ``rebind``, so they change together.

Activations are quantised with one scale per input tensor, that is over the whole batch: a
sequence's log-probs depend slightly on what it is batched with. The sampled token's ``mu`` is
still the exact probability it was sampled with.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from relayrl.weight_sync.buckets import quantize


class Int8Linear(nn.Module):
    """``y = x @ (weight * scale[:, None]).T + bias`` with an int8 ``weight`` [out, in], run as a
    dynamically quantised int8 matmul (fbgemm's ``quantized::linear_dynamic``): each call
    quantises its input to 7 bits with one affine scale over the whole input tensor, multiplies
    in int8 and rescales to float32. The weight is packed for the kernel on the first call after
    it is (re)bound."""

    def __init__(self, weight: Tensor, scale: Tensor, bias: nn.Parameter | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = bias
        self._packed: Any = None

    @classmethod
    def of(cls, linear: nn.Linear) -> Int8Linear:
        """An int8 copy of ``linear`` (its bias, if any, is kept as it is)."""
        return cls(*quantize(linear.weight, "int8"), linear.bias)

    def rebind(self, name: str, tensor: Tensor) -> None:
        """Hold ``tensor`` as the ``weight`` or ``scale`` buffer (a receiver's swap)."""
        self._buffers[name] = tensor
        self._packed = None

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in] -> [..., out], in x's dtype."""
        if self._packed is None:
            self._packed = _prepack(self.weight, self.scale)
        # reduce_range: 7-bit activations, as torch's own dynamic Linear on x86 (the int8
        # products' pairwise sums then cannot saturate 16 bits on CPUs without VNNI).
        out = torch.ops.quantized.linear_dynamic(x.float(), self._packed, True).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        """Shown by ``print(model)``."""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def _prepack(weight: Tensor, scale: Tensor) -> Any:
    """The kernel's packed copy of per-row int8 ``weight`` with ``scale`` (zero points 0)."""
    with warnings.catch_warnings():
        # torch deprecates its quantized tensor dtypes in favour of torchao; the dynamic linear
        # kernel still takes them, and nothing else here uses them.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        quantized = torch._make_per_channel_quantized_tensor(
            weight, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
        )
    return torch.ops.quantized.linear_prepack(quantized, None)


class Int8Embedding(nn.Module):
    """An embedding table held as int8 rows with row scales; a lookup dequantises only the rows
    it gathers."""

    def __init__(self, weight: Tensor, scale: Tensor, padding_idx: int | None, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx
        self.dtype = dtype
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale, persistent=False)

    @classmethod
    def of(cls, embedding: nn.Embedding) -> Int8Embedding:
        """An int8 copy of ``embedding``, returning vectors in its dtype."""
        weight = embedding.weight
        return cls(*quantize(weight, "int8"), embedding.padding_idx, weight.dtype)

    def rebind(self, name: str, tensor: Tensor) -> None:
        """Hold ``tensor`` as the ``weight`` or ``scale`` buffer (a receiver's swap)."""
        self._buffers[name] = tensor

    def forward(self, ids: Tensor) -> Tensor:
        """ids [...] -> [..., dim]."""
        rows = self.weight[ids].to(torch.float32) * self.scale[ids][..., None]
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        """Shown by ``print(model)``."""
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


def to_int8(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` and ``nn.Embedding`` of ``model`` in place by its int8 copy;
    returns ``model``. Converting a converted model changes nothing.

    Tied weights (an output layer sharing the embedding table) become two int8 copies of the one
    tensor: a trainer's state dict names both, and the receiver fills both.
    """
    for name, module in list(model.named_modules()):
        if not name:  # the model itself: nothing holds it
            continue
        if isinstance(module, nn.Linear):
            replacement: nn.Module = Int8Linear.of(module)
        elif isinstance(module, nn.Embedding):
            replacement = Int8Embedding.of(module)
        else:
            continue
        path, _, attr = name.rpartition(".")
        parent = model.get_submodule(path) if path else model
        setattr(parent, attr, replacement)
    return model
