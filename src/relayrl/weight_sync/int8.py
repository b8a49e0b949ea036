"""Int8 compute for a weight-sync receiver: linear and embedding layers that run on int8 weights.

``to_int8(model)`` replaces every ``nn.Linear`` (the output layer included) and ``nn.Embedding``
of a model with a module that holds the weight as int8 with one float32 scale per row (the
``sync.precision=int8`` storage format: weight ~= int8 * scale, scale = row absmax / 127), and
computes with it directly:

- ``Int8Linear``: a weight-only int8 matmul, ``torch._weight_int8pack_mm`` (int8 weights,
  activations and output in the activations' dtype; the kernel scales each output column).
- ``Int8Embedding``: gathers the int8 rows of the looked-up tokens and scales only those.

The weight keeps its state-dict name (``...q_proj.weight``, now int8) and the scale is a
non-persistent buffer, so the model's state dict still names exactly the trainer's tensors and
a receiver (``buckets.ReceiverState``) binds both to its slots, swapping them at once. The
quantised copy of the trainer's weights is the receiver's; this module only computes with it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from relayrl.weight_sync.buckets import quantize


class Int8Linear(nn.Module):
    """``y = x @ (weight * scale[:, None]).T + bias`` with an int8 ``weight`` [out, in], run as a
    weight-only int8 matmul."""

    def __init__(self, weight: Tensor, scale: Tensor, bias: nn.Parameter | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = bias

    @classmethod
    def of(cls, linear: nn.Linear) -> Int8Linear:
        """An int8 copy of ``linear`` (its bias, if any, is kept as it is)."""
        return cls(*quantize(linear.weight, "int8"), linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., in] -> [..., out], in x's dtype."""
        flat = x.reshape(-1, self.in_features)
        out = torch._weight_int8pack_mm(flat, self.weight, self.scale.to(x.dtype))
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        """Shown by ``print(model)``."""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


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
