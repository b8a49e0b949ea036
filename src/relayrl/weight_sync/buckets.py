"""Flat, bucketed layouts of named tensors and the receiver's double-buffered copy of them.

Every transport moves the same thing: the bytes of a ``Layout``, a fixed arrangement of named
tensors in one flat byte buffer, split into buckets. The trainer packs its tensors into that
buffer (or straight into shared memory) once per version; a receiver fills one of its two slots
and swaps it in between forward passes, so no forward ever sees a mix of two versions.

A tensor in a layout is either whole or a *piece*: rows ``[start, start + its rows)`` of a full
tensor (what each rank of a row-sharded trainer holds, see ``sharding.py``). A receiver whose
shards send pieces holds the full tensors and writes each piece into its rows.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils import parametrize

ALIGN = 64  # bytes; every tensor starts on a cache line, so dtype views of the buffer are legal
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
# Weight-only quantised copies: every 2-D floating tensor (linear and embedding weights) is held
# in the storage dtype with one float32 scale per row (absmax / largest representable value) and
# dequantised on access; 1-D tensors (norms, biases) keep the trainer's dtype.
QUANTIZED: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, 448.0),
}
STORAGE = {dtype for dtype, _ in QUANTIZED.values()}
SCALE = "::scale"  # suffix of the name under which a quantised tensor's row scales travel

Rows = Mapping[str, tuple[int, tuple[int, ...]]]
"""Which tensors are pieces: name -> (first row, full shape); the tensor holds rows
``[first, first + tensor.shape[0])`` of a tensor of the full shape."""


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
    """The dtype a receiver holds its floating tensors in; None keeps the trainer's (and so do
    the quantised precisions, for the tensors they leave unquantised)."""
    if precision is None or precision in QUANTIZED:
        return None
    if precision not in PRECISIONS:
        allowed = sorted(PRECISIONS) + sorted(QUANTIZED)
        raise ValueError(f"precision={precision!r} is not one of {allowed} or null")
    return PRECISIONS[precision]


def _quantizable(spec: TensorSpec) -> bool:
    return len(spec.shape) == 2 and parse_dtype(spec.dtype).is_floating_point


class Dequantize(torch.nn.Module):
    """Parametrization that turns a quantised weight and its row scales back into ``dtype``."""

    def __init__(self, rows: int, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.register_buffer("scale", torch.ones(rows, dtype=torch.float32))

    def forward(self, stored: Tensor) -> Tensor:
        """weight = stored * scale, per row."""
        return (stored.to(torch.float32) * self.scale[:, None]).to(self.dtype)


def quantize(tensor: Tensor, precision: str) -> tuple[Tensor, Tensor]:
    """Symmetric per-row quantisation: (values in the storage dtype, float32 scales [rows])."""
    dtype, largest = QUANTIZED[precision]
    values = tensor.detach().to(torch.float32)
    scale = values.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / largest
    scaled = values / scale[:, None]
    if not dtype.is_floating_point:
        scaled = scaled.round()
    return scaled.clamp(-largest, largest).to(dtype), scale


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lives in a flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    full_shape: tuple[int, ...] | None = None  # set for a piece: the shape of its full tensor
    row_start: int = 0  # a piece's first row in its full tensor

    @property
    def row_stop(self) -> int:
        """One past a piece's last row in its full tensor."""
        return self.row_start + self.shape[0]


def _piece(
    name: str, shape: tuple[int, ...], start: int, full_shape: Sequence[int]
) -> tuple[int, ...]:
    """``full_shape`` as a tuple of ints, once rows [start, start + shape[0]) fit in it."""
    full = tuple(int(d) for d in full_shape)
    if not full or len(shape) != len(full) or shape[1:] != full[1:]:
        raise ValueError(
            f"piece {name!r} of shape {shape} cannot be rows of a tensor of shape {full}: "
            "every dimension but the first must agree"
        )
    if start < 0 or start + shape[0] > full[0]:
        raise ValueError(
            f"piece {name!r}: rows [{start}, {start + shape[0]}) fall outside the {full[0]} rows "
            f"of its full shape {full}"
        )
    return full


@dataclass(frozen=True)
class Layout:
    """Named tensors (whole or pieces) laid out in one flat byte buffer, cut into buckets of
    whole entries."""

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
        rows: Rows | None = None,
    ) -> Layout:
        """The layout of ``tensors``, with floating tensors cast to ``dtype`` when one is given;
        the tensors named in ``rows`` are pieces of full tensors."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        rows = rows or {}
        unknown = sorted(set(rows) - set(tensors))
        if unknown:
            raise ValueError(f"rows names tensors that are not among the tensors: {unknown[:5]}")
        specs, offset = [], 0
        for name, tensor in tensors.items():
            tdtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * torch.empty((), dtype=tdtype).element_size()
            shape = tuple(tensor.shape)
            start, full = rows.get(name, (0, None))
            if full is not None:
                full = _piece(name, shape, start, full)
            specs.append(
                TensorSpec(name, shape, dtype_name(tdtype), offset, nbytes, full, int(start))
            )
            offset += -(-nbytes // ALIGN) * ALIGN
        buckets, start = [], 0
        for spec in specs:
            if spec.offset > start and spec.offset + spec.nbytes - start > bucket_bytes:
                buckets.append((start, spec.offset))
                start = spec.offset
        if offset > start:
            buckets.append((start, offset))
        return cls(tuple(specs), offset, tuple(buckets))

    def astype(self, precision: str | None) -> Layout:
        """The layout a receiver in ``precision`` holds (None: the trainer's own)."""
        if self.pieced:
            raise ValueError(
                "a receiver holds pieces as full tensors: take astype of the full tensors' layout"
            )
        if precision is None:
            return self
        bucket_bytes = max((end - start for start, end in self.buckets), default=1)
        fake: dict[str, Tensor] = {}
        for s in self.specs:
            dtype = parse_dtype(s.dtype)
            if precision in QUANTIZED and _quantizable(s):
                fake[s.name] = torch.empty(s.shape, dtype=QUANTIZED[precision][0], device="meta")
                fake[s.name + SCALE] = torch.empty(s.shape[0], dtype=torch.float32, device="meta")
            else:
                fake[s.name] = torch.empty(s.shape, dtype=dtype, device="meta")
        return Layout.of(fake, bucket_bytes=bucket_bytes, dtype=precision_dtype(precision))

    @property
    def pieced(self) -> bool:
        """Whether any tensor of this layout is a piece of a full tensor."""
        return any(s.full_shape is not None for s in self.specs)

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
    """Copy (and cast) every tensor of ``src`` into the same-named view of ``dst``; a tensor that
    already is that view (bound into the buffer) is skipped."""
    with torch.no_grad():
        for name, tensor in src.items():
            view = dst[name]
            if tensor.data_ptr() != view.data_ptr():
                view.copy_(tensor)


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _check_cover(state: Mapping[str, Tensor], layouts: Sequence[Layout]) -> None:
    """Raise unless the shards' whole tensors and pieces make up ``state`` exactly once."""
    pieces: dict[str, list[TensorSpec]] = {}
    whole = []
    for spec in (s for layout in layouts for s in layout.specs):
        if spec.full_shape is None:
            whole.append(spec.name)
        else:
            pieces.setdefault(spec.name, []).append(spec)
    names = whole + list(pieces)
    if sorted(names) != sorted(state):
        missing = sorted(set(state) - set(names))
        extra = sorted(set(names) - set(state))
        twice = sorted(name for name, count in Counter(names).items() if count > 1)
        raise ValueError(
            f"the trainer's tensors do not match the receiver's model: "
            f"model tensors not sent {missing[:5]}, sent tensors not in the model {extra[:5]}, "
            f"sent more than once (whole, or whole and in pieces) {twice[:5]}"
        )
    for name, specs in pieces.items():
        _check_tiling(name, specs, tuple(state[name].shape))


def _check_tiling(name: str, specs: Sequence[TensorSpec], model_shape: tuple[int, ...]) -> None:
    """Raise unless the pieces of ``name`` hold every row of the model's tensor exactly once."""
    for spec in specs:
        if spec.full_shape != model_shape:
            raise ValueError(
                f"tensor {name!r}: a piece gives its full shape as {spec.full_shape}, "
                f"the receiver's model has {model_shape}"
            )
    dtypes = sorted({spec.dtype for spec in specs})
    if len(dtypes) > 1:
        raise ValueError(f"tensor {name!r}: its pieces disagree on the dtype: {dtypes}")
    rows, covered = model_shape[0], 0
    for spec in sorted((s for s in specs if s.shape[0]), key=lambda s: s.row_start):
        if spec.row_start > covered:
            raise _gap(name, covered, spec.row_start, rows)
        if spec.row_start < covered:
            raise ValueError(
                f"tensor {name!r}: rows [{spec.row_start}, {min(covered, spec.row_stop)}) "
                "are in more than one shard's piece"
            )
        covered = spec.row_stop
    if covered < rows:
        raise _gap(name, covered, rows, rows)


def _gap(name: str, start: int, stop: int, rows: int) -> ValueError:
    return ValueError(
        f"tensor {name!r}: rows [{start}, {stop}) of its {rows} are in no shard's piece"
    )


def _full_layout(state: Mapping[str, Tensor], layouts: Sequence[Layout]) -> Layout:
    """The layout of the model's full tensors, in the trainer's dtypes, that the shards' whole
    tensors and pieces make up."""
    specs = {s.name: s for layout in layouts for s in layout.specs}
    full = {}
    for name in state:
        spec = specs[name]
        shape = spec.shape if spec.full_shape is None else spec.full_shape
        full[name] = torch.empty(shape, dtype=parse_dtype(spec.dtype), device="meta")
    return Layout.of(full)


class ReceiverState:
    """A receiver's weights: two slots, a serving lock, and an atomic swap between them.

    The model's tensors are bound to views of the active slot. A transport fills the other slot
    (``fill``, which casts or quantises into the receiver's precision; or, for zero-copy shared
    memory, points at a slot the trainer filled) and calls ``swap``, which waits for forward
    passes in flight (``serving`` blocks) to finish, rebinds the model's tensors and bumps the
    version. New forwards wait while a swap is pending, so a steady stream of forward passes
    cannot starve it. In a quantised precision (``int8``, ``fp8``) each 2-D weight becomes a
    parametrization that dequantises the stored values with their row scales on access, unless
    the model already holds it quantised in a module that computes with it (``weight_sync.int8``,
    the int8 generator): then the swap hands that module its stored values and scales
    (``rebind``).

    Each trainer shard sends whole tensors, pieces (rows of a full tensor), or both; the pieces
    of a tensor over all shards must hold each of its rows once. When there are pieces, both
    slots hold the full tensors in one buffer and ``fill`` writes each piece into its rows.
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
        self.precision = precision
        self.wire_layouts = list(layouts)
        state = model.state_dict()
        _check_cover(state, self.wire_layouts)
        if any(layout.pieced for layout in self.wire_layouts):
            self.layouts = [_full_layout(state, self.wire_layouts).astype(precision)]
        else:
            self.layouts = [layout.astype(precision) for layout in self.wire_layouts]
        self.quantized = (
            {s.name for layout in self.wire_layouts for s in layout.specs if _quantizable(s)}
            if precision in QUANTIZED
            else set()
        )
        # A model that computes with quantised weights (weight_sync.int8) is filled in its own
        # storage dtype only; cast into, its tensors would hold garbage.
        sent = {s.name: parse_dtype(s.dtype) for layout in self.wire_layouts for s in layout.specs}
        storage = QUANTIZED[precision][0] if precision in QUANTIZED else None
        held = sorted(
            name
            for name, tensor in state.items()
            if tensor.dtype in STORAGE
            and sent[name].is_floating_point
            and not (name in self.quantized and tensor.dtype == storage)
        )
        if held:
            raise ValueError(
                f"the model already holds {held[:3]} quantised (int8 compute modules, see "
                f"weight_sync.int8): receive with precision='int8', not {precision!r}"
            )
        self._slots_for: dict[str, Callable[[Tensor], None]] = {}
        for name, tensor in state.items():
            self._bind_target(name, tensor)
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

    def _bind_target(self, name: str, current: Tensor) -> None:
        module, attr = _owner(self.model, name)
        if name in self.quantized and current.dtype == QUANTIZED[self.precision][0]:
            # The module computes with the quantised values itself (weight_sync.int8): the swap
            # hands it the values and their scales.
            if not hasattr(module, "rebind"):
                raise ValueError(f"{name!r} is held quantised by a module with no rebind()")
            self._slots_for[name] = lambda view, m=module, a=attr: m.rebind(a, view)
            self._slots_for[name + SCALE] = lambda view, m=module: m.rebind("scale", view)
        elif name in self.quantized:
            dequant = Dequantize(current.shape[0], current.dtype)
            parametrize.register_parametrization(module, attr, dequant, unsafe=True)
            stored = module.parametrizations[attr].original
            stored.requires_grad_(False)
            self._slots_for[name] = lambda view, p=stored: setattr(p, "data", view)
            self._slots_for[name + SCALE] = lambda view, d=dequant: d._buffers.__setitem__(
                "scale", view
            )
        elif attr in module._parameters:
            param = module._parameters[attr]
            self._slots_for[name] = lambda view, p=param: setattr(p, "data", view)
        else:
            self._slots_for[name] = lambda view, m=module, a=attr: m._buffers.__setitem__(a, view)

    def _merged_views(self, slot: Sequence[Tensor]) -> dict[str, Tensor]:
        views: dict[str, Tensor] = {}
        for layout, buffer in zip(self.layouts, slot, strict=True):
            views.update(layout.views(buffer))
        return views

    def staging(self) -> int:
        """Index of the slot that no forward pass reads, to fill with the next version."""
        return 1 if self.active == 0 else 0

    def fill(self, slot: int, tensors: Mapping[str, Tensor], layout: Layout) -> None:
        """Write one shard's ``tensors`` (laid out as ``layout`` on the wire) into ``slot``, cast
        or quantised to this precision; a piece goes into its rows of the full tensor."""
        views = self.views[slot]
        rows = {
            s.name: slice(s.row_start, s.row_stop) for s in layout.specs if s.full_shape is not None
        }
        with torch.no_grad():
            for name, tensor in tensors.items():
                where = rows.get(name, Ellipsis)  # Ellipsis: the whole tensor, 0-d ones too
                if name in self.quantized:
                    # Scales are per row, so a piece's values and scales are its rows of the
                    # whole tensor's: quantising pieces is exact.
                    values, scale = quantize(tensor, self.precision)
                    views[name][where].copy_(values)
                    views[name + SCALE][where].copy_(scale)
                else:
                    views[name][where].copy_(tensor)

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
                self._slots_for[name](view)
            self.active, self.version = slot, version
            self._swap_pending = False
            self._cond.notify_all()
        return waited
