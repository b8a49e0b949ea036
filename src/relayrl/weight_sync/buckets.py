"""Flat, bucketed layouts of named tensors and the receiver's double-buffered copy of them.

Every transport moves the same thing: the bytes of a ``Layout``, a fixed arrangement of named
tensors in one flat byte buffer, split into buckets. The trainer packs its tensors into that
buffer (or straight into shared memory) once per version; a receiver fills one of its two slots
and swaps it in between forward passes, so no forward ever sees a mix of two versions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

ALIGN = 64  # bytes; every tensor starts on a cache line, so dtype views of the buffer are legal
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def precision_dtype(precision: str | None) -> torch.dtype | None:
    """The dtype a receiver holds its floating tensors in; None keeps the trainer's."""
    if precision is None:
        return None
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {sorted(PRECISIONS)} or null")
    return PRECISIONS[precision]


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lives in a flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Named tensors laid out in one flat byte buffer, cut into buckets of whole tensors."""

    specs: tuple[TensorSpec, ...]
    nbytes: int
    buckets: tuple[tuple[int, int], ...]  # [start, end) byte ranges covering the buffer

    @classmethod
    def of(
        cls,
        tensors: Mapping[str, Tensor],
        *,
        bucket_bytes: int = 256 << 20,
        dtype: torch.dtype | None = None,
    ) -> Layout:
        """The layout of ``tensors``, with floating tensors cast to ``dtype`` when one is given."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        specs, offset = [], 0
        for name, tensor in tensors.items():
            tdtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * torch.empty((), dtype=tdtype).element_size()
            specs.append(TensorSpec(name, tuple(tensor.shape), dtype_name(tdtype), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        buckets, start = [], 0
        for spec in specs:
            if spec.offset > start and spec.offset + spec.nbytes - start > bucket_bytes:
                buckets.append((start, spec.offset))
                start = spec.offset
        if offset > start:
            buckets.append((start, offset))
        return cls(tuple(specs), offset, tuple(buckets))

    def astype(self, dtype: torch.dtype | None) -> Layout:
        """The same tensors with floating ones held in ``dtype`` (None: unchanged)."""
        if dtype is None:
            return self
        fake = {
            s.name: torch.empty(s.shape, dtype=parse_dtype(s.dtype), device="meta")
            for s in self.specs
        }
        bucket_bytes = max((end - start for start, end in self.buckets), default=1)
        return Layout.of(fake, bucket_bytes=bucket_bytes, dtype=dtype)

    @property
    def names(self) -> list[str]:
        """Tensor names in buffer order."""
        return [s.name for s in self.specs]

    def allocate(self) -> Tensor:
        """A zeroed uint8 buffer of this layout's size (zeroing faults every page in now)."""
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    def views(self, buffer: Tensor) -> dict[str, Tensor]:
        """Typed, shaped views of ``buffer`` (uint8 [nbytes]), one per tensor; no copy."""
        if buffer.dtype != torch.uint8 or buffer.numel() < self.nbytes:
            raise ValueError(
                f"buffer must be uint8 with at least {self.nbytes} bytes, "
                f"got {buffer.dtype} with {buffer.numel()}"
            )
        return {
            s.name: buffer[s.offset : s.offset + s.nbytes].view(parse_dtype(s.dtype)).view(s.shape)
            for s in self.specs
        }

    def check(self, tensors: Mapping[str, Tensor]) -> None:
        """Raise unless ``tensors`` has exactly this layout's names and shapes."""
        if list(tensors) != self.names:
            missing = sorted(set(self.names) - set(tensors))
            extra = sorted(set(tensors) - set(self.names))
            raise ValueError(
                f"tensor names differ from the layout: missing {missing}, extra {extra}"
            )
        for spec in self.specs:
            if tuple(tensors[spec.name].shape) != spec.shape:
                raise ValueError(
                    f"tensor {spec.name!r} has shape {tuple(tensors[spec.name].shape)}, "
                    f"the layout has {spec.shape}"
                )


def copy_into(dst: Mapping[str, Tensor], src: Mapping[str, Tensor]) -> None:
    """Copy (and cast) every tensor of ``src`` into the same-named view of ``dst``."""
    with torch.no_grad():
        for name, tensor in src.items():
            dst[name].copy_(tensor)


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


class ReceiverState:
    """A receiver's weights: two slots, a serving lock, and an atomic swap between them.

    The model's tensors are bound to views of the active slot. A transport fills the other slot
    (or, for zero-copy shared memory, points at a slot the trainer filled) and calls ``swap``,
    which waits for forward passes in flight (``serving`` blocks) to finish, rebinds the model's
    tensors and bumps the version. New forwards wait while a swap is pending, so a steady stream
    of forward passes cannot starve it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layouts: Sequence[Layout],
        *,
        precision: str | None = None,
        external_slots: Sequence[Sequence[Tensor]] | None = None,
    ):
        self.model = model
        self.wire_layouts = list(layouts)
        self.layouts = [layout.astype(precision_dtype(precision)) for layout in layouts]
        state = model.state_dict()
        names = [n for layout in self.layouts for n in layout.names]
        if sorted(names) != sorted(state):
            missing = sorted(set(state) - set(names))
            extra = sorted(set(names) - set(state))
            raise ValueError(
                f"the trainer's tensors do not match the receiver's model: "
                f"model tensors not sent {missing[:5]}, sent tensors not in the model {extra[:5]}"
            )
        if external_slots is None:
            self.slots = [[layout.allocate() for layout in self.layouts] for _ in range(2)]
        else:
            self.slots = [list(slot) for slot in external_slots]
        self.views = [self._merged_views(slot) for slot in self.slots]
        self.version = -1
        self.active: int | None = None  # None: the model still holds its own initial tensors
        self._cond = threading.Condition()
        self._readers = 0
        self._swap_pending = False

    def _merged_views(self, slot: Sequence[Tensor]) -> dict[str, Tensor]:
        views: dict[str, Tensor] = {}
        for layout, buffer in zip(self.layouts, slot, strict=True):
            views.update(layout.views(buffer))
        return views

    def staging(self) -> int:
        """Index of the slot that no forward pass reads, to fill with the next version."""
        return 1 if self.active == 0 else 0

    @contextmanager
    def serving(self) -> Iterator[int]:
        """Hold the current weights for one forward pass (or chunk); yields their version."""
        with self._cond:
            self._cond.wait_for(lambda: not self._swap_pending)
            self._readers += 1
            version = self.version
        try:
            yield version
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def swap(self, slot: int, version: int) -> float:
        """Serve ``slot`` as ``version`` once in-flight forwards end; returns seconds waited."""
        start = time.perf_counter()
        with self._cond:
            self._swap_pending = True
            self._cond.wait_for(lambda: self._readers == 0)
            waited = time.perf_counter() - start
            for name, view in self.views[slot].items():
                module, attr = _owner(self.model, name)
                if attr in module._parameters:
                    module._parameters[attr].data = view
                else:
                    module._buffers[attr] = view
            self.active, self.version = slot, version
            self._swap_pending = False
            self._cond.notify_all()
        return waited
