"""Linears whose weights stay quantized on the device: `Int4Linear` and `Int8Linear`.

Both have `Linear`'s interface (`forward(x) -> x @ W.T + b` in x's dtype, `in_features`,
`out_features`), so the model code does not change: the loader swaps them in.

They run torch's own weight-only kernels with bfloat16 activations (convert in, convert
out; norms, rotary and attention stay in the model dtype). On CPU the int4 kernel is
`_weight_int4pack_mm_for_cpu`, 10-40x slower with float32 activations than with bfloat16, hence
the conversion; on CUDA `_weight_int4pack_mm`. Both dequantize `(q - 8) * scale + zero` per
group of 32 inputs, with `scale` and `zero` in bfloat16 (checked against a float reference in
tests/test_quantized.py). The int8 kernel (`_weight_int8pack_mm`, both devices) multiplies by a
per-output-channel scale.

An 8-bit `GroupQuant` (GGUF's Q8_0: one scale per 32 values, which the int8 kernel cannot
take) runs as two exact int4 terms: `q = 16 * hi + lo` with `hi` in -8..7 and `lo` in 0..15, so
`w = 16 d (hi + 8 - 8) + (d (lo - 8) + 8 d)`.

Nothing here reads a device value on the host or depends on data for a shape, so the layers
capture into graphs like `Linear`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch
from torch import nn

from executor.models.layers import PackedLinear
from executor.models.quant_formats import ChannelQuant, GroupQuant, QuantizedWeight
from ops import qmm

COMPUTE_DTYPE = torch.bfloat16


def _int4_inner_k_tiles(k: int) -> int:
    """The CUDA packing's tile count: the largest of 8, 4, 2 whose tiles (16 inputs each) divide K."""
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


def int4_shape_problem(n: int, k: int, group: int, device: torch.device) -> str | None:
    """Why the int4 kernels cannot take an [n, k] weight on `device`, or None when they can."""
    rows = 16 if device.type == "cpu" else 8
    if group not in (32, 64, 128, 256):
        return f"the group size must be 32, 64, 128 or 256, got {group}"
    if k % group:
        return f"the input size {k} must be a multiple of the group size {group}"
    if n % rows:
        return f"the output size {n} must be a multiple of {rows} on {device.type}"
    return None


def pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """4-bit values [N, K] (0..15) into the int4 kernel's layout on `device`."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    q = q.to(torch.int32)
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).to(device)
    return torch.ops.aten._convert_weight_to_int4pack(packed, _int4_inner_k_tiles(q.shape[1]))


def int4_terms(w: GroupQuant) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q 0..15, scale, zero) terms whose int4 products sum to the weight (two for 8 bits)."""
    if w.bits == 4:
        return [(w.q, w.scale, w.zero)]
    hi = w.q >> 4  # arithmetic shift: -8..7
    lo = w.q & 15
    return [(hi + 8, 16 * w.scale, torch.zeros_like(w.zero)), (lo, w.scale, w.zero + 8 * w.scale)]


class Restorable(nn.Module):
    """A quantized module rebuilt from its buffers and `CACHED_ATTRS` (the packed-weight cache,
    `quant_cache.py`) without repacking: no constructor runs, the attributes and buffers are
    set as the constructor left them."""

    CACHED_ATTRS: tuple[str, ...] = ()

    def cached_attrs(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.CACHED_ATTRS}

    @classmethod
    def restore(
        cls, attrs: Mapping[str, object], buffers: Mapping[str, torch.Tensor | None]
    ) -> Restorable:
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        for name in cls.CACHED_ATTRS:
            setattr(module, name, attrs[name])
        for name, tensor in buffers.items():
            module.register_buffer(name, tensor)
        return module


class QuantizedLinear(Restorable, ABC):
    """The shared frame: reshape to 2-D, run the kernel in bfloat16, back to x's dtype, bias."""

    CACHED_ATTRS: tuple[str, ...] = ("in_features", "out_features", "format")

    @classmethod
    def restore(
        cls, attrs: Mapping[str, object], buffers: Mapping[str, torch.Tensor | None]
    ) -> Restorable:
        return super().restore(attrs, {"bias": None, **buffers})  # a cache has no None entries

    def __init__(
        self, in_features: int, out_features: int, bias: torch.Tensor | None, fmt: str
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.format = fmt  # what the values came from: Q4_0, Q4_1, Q8_0, int4, int8
        self.bias: torch.Tensor | None
        self.register_buffer("bias", bias)

    @abstractmethod
    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16 -> [M, N] bfloat16 through the subclass's kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = self._matmul(x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


class Int4Linear(QuantizedLinear):
    CACHED_ATTRS = (*QuantizedLinear.CACHED_ATTRS, "group", "on_cpu", "terms")

    def __init__(
        self, weight: GroupQuant, bias: torch.Tensor | None, *, device: torch.device
    ) -> None:
        n, k = weight.shape
        problem = int4_shape_problem(n, k, weight.group, device)
        if problem is not None:
            raise ValueError(f"int4 weight [{n}, {k}]: {problem}")
        super().__init__(k, n, bias, weight.source)
        self.group = weight.group
        self.on_cpu = device.type == "cpu"
        self.terms = len(int4_terms(weight))
        for i, (q, scale, zero) in enumerate(int4_terms(weight)):
            scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1)  # [K // group, N, 2]
            self.register_buffer(f"packed_{i}", pack_int4(q, device))
            self.register_buffer(
                f"scale_zeros_{i}", scale_zeros.to(device=device, dtype=COMPUTE_DTYPE).contiguous()
            )

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        mm = (
            torch.ops.aten._weight_int4pack_mm_for_cpu
            if self.on_cpu
            else torch.ops.aten._weight_int4pack_mm
        )
        out = mm(x, self.packed_0, self.group, self.scale_zeros_0)
        if self.terms == 1:
            return out
        # Sum the two terms of an 8-bit weight in float32, not bfloat16.
        return out.float() + mm(x, self.packed_1, self.group, self.scale_zeros_1).float()


class Int8Linear(QuantizedLinear):
    def __init__(
        self, weight: ChannelQuant, bias: torch.Tensor | None, *, device: torch.device
    ) -> None:
        n, k = weight.shape
        super().__init__(k, n, bias, weight.source)
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("qweight", weight.q.to(device=device, dtype=torch.int8).contiguous())
        self.register_buffer("scales", weight.scale.to(device=device, dtype=COMPUTE_DTYPE))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)


class GroupQmmLinear(QuantizedLinear):
    """A `GroupQuant` weight (4- or 8-bit, group 32) in `ops.qmm`'s layout, multiplied by its
    CPU kernel: float32 activations in (quantized to int8 per group inside the kernel), the
    weights as stored, no bfloat16 conversion. 8-bit weights run as one term."""

    CACHED_ATTRS = (*QuantizedLinear.CACHED_ATTRS, "bits")

    def __init__(
        self, weight: GroupQuant, bias: torch.Tensor | None, *, device: torch.device
    ) -> None:
        n, k = weight.shape
        if device.type != "cpu":
            raise ValueError(f"the qmm kernel runs on the CPU, not {device.type}")
        if weight.group != qmm.GROUP or k % qmm.GROUP:
            raise ValueError(
                f"qmm weight [{n}, {k}]: groups of {qmm.GROUP} inputs, got group {weight.group}"
            )
        super().__init__(k, n, bias, weight.source)
        self.bits = weight.bits
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.mn: torch.Tensor
        # w = (q - offset) * scale + zero = q * scale + (zero - offset * scale)
        self.register_buffer("qweight", qmm.pack_groups(weight.q, weight.bits))
        # Halves, as GGUF stores them (Q4_0's d, Q4_1's d and m, Q8_0's d are exact in them).
        self.register_buffer("scale", weight.scale.to(torch.float16).contiguous())
        self.register_buffer("mn", (weight.zero - weight.offset * weight.scale).to(torch.float16))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return qmm.qmm(x.float(), self.qweight, self.scale, self.mn, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]  # float32 in and out: the kernel's own activation type
        out = self._matmul(x.reshape(-1, self.in_features)).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)


class QuantizedEmbedding(Restorable):
    """`Embedding`'s interface over a `GroupQuant` table (GGUF's Q8_0 `token_embd`): gathers the
    rows' 8-bit values and scales and dequantizes only those, so the result is exactly the
    float32 table's rows (then cast to `dtype`), at a quarter of its bytes."""

    CACHED_ATTRS = ("group", "offset", "dtype_name", "format")

    def __init__(self, table: GroupQuant, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.group = table.group
        self.offset = table.offset
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.format = table.source
        self.q: torch.Tensor
        self.scale: torch.Tensor
        self.zero: torch.Tensor
        self.register_buffer("q", table.q.to(device=device, dtype=torch.int8))
        self.register_buffer("scale", table.scale.to(device=device, dtype=torch.float32))
        self.register_buffer("zero", table.zero.to(device=device, dtype=torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Broadcast over [T, groups, group] (no repeat_interleave: its size would be read
        # from the data, which graph capture refuses).
        q = self.q[ids].unflatten(-1, (-1, self.group)).float() - self.offset
        rows = q * self.scale[ids][..., None] + self.zero[ids][..., None]
        return rows.flatten(-2).to(getattr(torch, self.dtype_name))


def quantized_linear(
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    *,
    device: torch.device,
    use_qmm: bool = False,
) -> QuantizedLinear:
    """The layer for `weight`'s form: GroupQuant -> GroupQmmLinear (`use_qmm`, the CPU kernel
    of `ops.qmm`) or Int4Linear (torch's int4 kernels), ChannelQuant -> Int8Linear."""
    if isinstance(weight, GroupQuant):
        if use_qmm:
            return GroupQmmLinear(weight, bias, device=device)
        return Int4Linear(weight, bias, device=device)
    return Int8Linear(weight, bias, device=device)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's weights: its state (parameters and persistent buffers, so not the
    rotary tables), each storage counted once, plus the oneDNN-packed weights (not state:
    `layers.PackedLinear` holds them outside torch's storages)."""
    seen: dict[int, int] = {}
    for t in module.state_dict().values():
        seen[t.data_ptr()] = t.nbytes
    packed = sum(m.packed.nbytes for m in module.modules() if isinstance(m, PackedLinear))
    return sum(seen.values()) + packed
