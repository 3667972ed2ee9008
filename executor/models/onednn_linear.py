"""Float linears on oneDNN-prepacked weights: the CPU's fast `x @ W.T + b`.

`F.linear` on CPU runs MKL's sgemm on the plain `[N, K]` weight and repacks panels of it on
every call. oneDNN can pack a weight once, at load, into the blocked layout its kernels read
(`torch.ops.mkldnn._reorder_linear_weight`) and then multiply without repacking
(`torch.ops.mkldnn._linear_pointwise`); the gain is measured in docs/performance.md
("Packed float linears").

A packed weight is an opaque MKLDNN tensor: no storage, no strides, and torch.compile cannot
take it as a graph input. So the packed weight lives in a table here, and the model holds a
`PackedWeight.key`: a one-element float tensor expanded to `[N]`, whose data pointer names
the table entry and whose shape carries N for the fake (shape-only) implementation. The op
`model_executor::onednn_linear(x, key, bias)` is a library op with a fake (shape-only)
implementation, opaque to dynamo and inductor, so the compiled layer halves call it like any
extern kernel, and every layer (each with its own key) shares one compiled graph; eager
steps skip the op and the table and call oneDNN on the packed tensor (`packed_linear`). The
entry is dropped when its `PackedWeight` is collected.

Packing is for float32 weights on CPU builds of torch with mkldnn; `packing_refusal` says why
anywhere else.
"""

from __future__ import annotations

import weakref

import torch

# The row count oneDNN chooses its packed layout for. The packed weight serves any row count
# (benchmarks/packed_linear.py compares hints).
PACK_BATCH_HINT = 16

_PACKED: dict[int, torch.Tensor] = {}  # key.data_ptr() -> the packed weight


def packing_refusal(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why oneDNN packing cannot serve weights of `dtype` on `device`, or None when it can."""
    if device.type != "cpu":
        return f"oneDNN packing is for CPU weights, not {device.type}"
    if dtype != torch.float32:
        return f"oneDNN packing is used for float32 weights only, not {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no mkldnn (oneDNN)"
    return None


class PackedWeight:
    """One packed `[N, K]` weight (`tensor`, opaque) and the key tensor that names it in the op."""

    def __init__(self, weight: torch.Tensor, batch_hint: int = PACK_BATCH_HINT) -> None:
        refusal = packing_refusal(weight.device, weight.dtype)
        if refusal is not None:
            raise ValueError(refusal)
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is [out, in], got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.nbytes = weight.nbytes  # what the packed copy holds (the same values, blocked)
        self.batch_hint = batch_hint
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), batch_hint
        )
        self.key = torch.zeros(1, dtype=torch.float32).expand(self.out_features)
        ptr = self.key.data_ptr()
        _PACKED[ptr] = self.tensor
        # The entry goes when the PackedWeight does, before its key can be freed and reused.
        weakref.finalize(self, _PACKED.pop, ptr, None)

    def release(self) -> None:
        """Free the packed weight (memory released by tag); the key stays, so compiled code
        that names it finds the weight again after `restore`. Not to be run meanwhile."""
        _PACKED.pop(self.key.data_ptr(), None)
        self.tensor = torch.empty(0)

    def restore(self, packed: torch.Tensor) -> None:
        """Hold `packed` (a packed weight of this shape) under the same key again."""
        self.tensor = packed
        _PACKED[self.key.data_ptr()] = packed

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` [N, K] packed the way this one is (not installed: `restore` or copy it)."""
        return torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), self.batch_hint
        )


def packed_weights_alive() -> int:
    """How many packed weights the table holds (tests: entries go with their owners)."""
    return len(_PACKED)


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 -> x @ W.T + bias [M, N], eagerly: oneDNN on the packed tensor, with
    no table lookup. Traced code calls `onednn_linear` on the key instead."""
    return torch.ops.mkldnn._linear_pointwise(x, weight.tensor, bias, "none", [], "")


# A plain library op (dispatcher -> the CPU kernel below), not `torch.library.custom_op`,
# whose Python wrapper costs more per call than oneDNN's own call does.
_LIB = torch.library.Library("model_executor", "DEF")
_LIB.define("onednn_linear(Tensor x, Tensor key, Tensor? bias) -> Tensor")


def _onednn_linear_cpu(
    x: torch.Tensor, key: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    packed = _PACKED.get(key.data_ptr())
    if packed is None:
        raise RuntimeError(
            "onednn_linear: no packed weight for this key (its PackedWeight was freed, or the "
            "key tensor was copied: keys are not state to clone or move)"
        )
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_LIB.impl("onednn_linear", _onednn_linear_cpu, "CPU")


@torch.library.register_fake("model_executor::onednn_linear")
def _onednn_linear_fake(
    x: torch.Tensor, key: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], key.shape[0]))


def onednn_linear(x: torch.Tensor, key: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The op `model_executor::onednn_linear`: x [M, K] float32 -> x @ W.T + bias [M, N],
    with W the weight packed under `key`."""
    return torch.ops.model_executor.onednn_linear.default(x, key, bias)
