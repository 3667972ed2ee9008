"""Stage checkpoint tensors for the served model, then write them in, in place.

What sits at a target decides how its new values go in; the weights keep their storage, so
captured graphs (which read the parameters' memory) stay valid:
- a float parameter (`Linear`, `Embedding`, `RMSNorm`, stacked experts) or a bias buffer:
  its rows are copied in place;
- a oneDNN-packed linear (`PackedLinear`, CPU only): the plain weight is packed again, off
  the device thread, and installed under the same key (what compiled code names: no graph
  holds the packed memory itself); a fused linear the update covers only in part is unpacked
  first; a tied head's packed copy follows the embedding;
- a linear quantized at load (int4, int8): the whole fused weight is quantized as the loader
  quantizes it and the buffers are copied in place. An update must cover every part of it
  (q, k and v; gate and up): the other parts' float values are no longer kept;
- GGUF blocks kept quantized (Q4_0, Q4_1, Q8_0 linears, a quantized embedding): refused.

`check` refuses, from the header, what the model cannot take (ModelStateError,
FAILED_PRECONDITION). `stage` runs off the device thread while steps run: it cuts each tensor
to this rank's shard, casts it to the weights' dtype, and prepares the packed and quantized
forms of whole targets. `write` runs between two steps: it first prepares what is left (a
partly covered packed linear), so that nothing is written unless everything can be, then
copies.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from executor.core.errors import ModelStateError
from executor.models.decoder_model import DecoderModel
from executor.models.layers import PackedLinear
from executor.models.quant_formats import quantize_int4, quantize_int8
from executor.models.quantized import (
    GroupQmmLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    quantized_linear,
)
from executor.models.weights import CheckpointTarget
from executor.weights.catalog import UpdatePlan, WeightCatalog

REQUANTIZED = ("int4", "int8")  # formats quantized at load, which an update re-quantizes


@dataclass
class Piece:
    rows: tuple[int, int]  # rows of the target's tensor (this rank's)
    value: torch.Tensor  # [rows, ...] in the weights' dtype


@dataclass
class StagedTarget:
    target: CheckpointTarget
    pieces: list[Piece] = field(default_factory=list)
    covered: bool = False  # every part of the target is in the update
    prepared: Any = None  # the packed tensor or the quantized module, when made ahead
    tied_head: torch.Tensor | None = None  # a tied head's packed copy (embedding updates)


@dataclass
class StagedUpdate:
    """An update, checked and staged on this rank, not yet written."""

    plan: UpdatePlan
    targets: list[StagedTarget]
    nbytes: int = 0  # bytes received or read (the dtypes they came in)
    stage_seconds: float = 0.0


def check(model: DecoderModel, catalog: WeightCatalog, plan: UpdatePlan) -> None:
    """Refuse (ModelStateError) an update whose tensors the served model cannot take."""
    names = set(s.name for s in plan.specs)
    for entry in plan.entries:
        target = entry.target
        if target is None:
            continue
        module = model.get_submodule(target.module)
        if isinstance(module, QuantizedEmbedding):
            raise ModelStateError(
                f"{entry.name}: the embedding is kept as GGUF {module.format} blocks, and "
                "re-quantizing into GGUF's block formats is not supported; serve with "
                "quantization=none, int8 or int4 to take weight updates"
            )
        if not isinstance(module, QuantizedLinear) or target.attr != "weight":
            continue
        if module.format not in REQUANTIZED:
            raise ModelStateError(
                f"{entry.name}: {target.name} is kept as GGUF {module.format} blocks, and "
                "re-quantizing into GGUF's block formats is not supported; serve with "
                "quantization=none, int8 or int4 to take weight updates"
            )
        missing = [p for p in target.parts if p not in names]
        if missing:
            raise ModelStateError(
                f"{entry.name}: {target.name} is kept {module.format}-quantized as one tensor, "
                f"so an update must carry all of its parts ({', '.join(target.parts)}); "
                f"missing: {', '.join(missing)}"
            )


def stage(
    model: DecoderModel,
    catalog: WeightCatalog,
    plan: UpdatePlan,
    sources: Iterable[Any],
    *,
    dtype: torch.dtype,
    pin: bool = False,
) -> StagedUpdate:
    """`sources`: each tensor of `plan` in order, whole (a tensor, or a lazy slice that reads
    only this rank's part). Cut, cast and prepared; nothing of the model is written. A target
    is prepared (packed, quantized) as soon as its last part is in, on this thread: oneDNN's
    own threads do the packing, and a second thread team beside them (measured) only slowed
    both down."""
    t0 = time.perf_counter()
    names = {s.name for s in plan.specs}
    staged: dict[str, StagedTarget] = {}
    for entry, source in zip(plan.entries, sources, strict=True):
        if entry.target is None:
            continue  # a tied head's copy: the embedding is the head
        value = catalog.plan.take(entry.name, source).to(dtype).contiguous()
        if pin and not value.is_pinned() and value.device.type == "cpu":
            value = value.pin_memory()
        key = entry.target.name
        if key not in staged:
            parts = entry.target.parts
            staged[key] = StagedTarget(entry.target, covered=all(p in names for p in parts))
        st = staged[key]
        st.pieces.append(Piece(entry.rows, value))
        if st.covered and len(st.pieces) == len(st.target.parts):
            st.pieces.sort(key=lambda p: p.rows[0])
            _prepare(model, st)
    for st in staged.values():
        st.pieces.sort(key=lambda p: p.rows[0])
    update = StagedUpdate(plan, list(staged.values()), nbytes=plan.nbytes)
    update.stage_seconds = time.perf_counter() - t0
    return update


def _whole(st: StagedTarget) -> torch.Tensor:
    values = [p.value for p in st.pieces]
    return values[0] if len(values) == 1 else torch.cat(values, dim=0)


def _prepare(model: DecoderModel, st: StagedTarget) -> None:
    """The packed or quantized form of a target the update covers whole."""
    target = st.target
    module = model.get_submodule(target.module)
    if target.attr == "weight" and isinstance(module, PackedLinear):
        st.prepared = module.packed.pack(_whole(st))
    elif target.attr == "weight" and isinstance(module, QuantizedLinear):
        whole = _whole(st)
        weight = quantize_int4(whole) if module.format == "int4" else quantize_int8(whole)
        device = next(module.buffers()).device
        st.prepared = quantized_linear(
            weight, None, device=device, use_qmm=isinstance(module, GroupQmmLinear)
        )
    if (
        target.module == "embed_tokens"
        and model.config.tie_word_embeddings
        and isinstance(model.lm_head, PackedLinear)
    ):
        st.tied_head = model.lm_head.packed.pack(_whole(st))


def write(model: DecoderModel, update: StagedUpdate) -> None:
    """Write a staged update into the model (the device thread, between two steps)."""
    for st in update.targets:  # everything that allocates, before the first write
        module = model.get_submodule(st.target.module)
        if st.prepared is None and st.target.attr == "weight" and isinstance(module, PackedLinear):
            dense = module.packed.tensor.to_dense()
            for piece in st.pieces:
                dense[piece.rows[0] : piece.rows[1]] = piece.value
            st.prepared = module.packed.pack(dense)
    with torch.no_grad():
        for st in update.targets:
            _write_target(model, st)


def _write_target(model: DecoderModel, st: StagedTarget) -> None:
    target = st.target
    module = model.get_submodule(target.module)
    if target.attr == "weight" and isinstance(module, PackedLinear):
        # CPU only (no CUDA graph holds it): the packed handle changes under the same key,
        # which is what compiled code names; a copy would cost a pass over the weight.
        module.packed.restore(st.prepared)
    elif target.attr == "weight" and isinstance(module, QuantizedLinear):
        prepared: nn.Module = st.prepared
        for name, buffer in prepared.named_buffers():
            if name != "bias":
                _copy_into(getattr(module, name), buffer)
    else:
        dest = target.tensor(model)
        for piece in st.pieces:
            _copy_into(dest[piece.rows[0] : piece.rows[1]], piece.value)
    if st.tied_head is not None:
        assert isinstance(model.lm_head, PackedLinear)
        model.lm_head.packed.restore(st.tied_head)


def _copy_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    """`dest[...] = src` in place. Host to host, one memcpy: `copy_` spreads a plain copy over
    the intra-op threads, which on a busy CPU was 15x slower than one memcpy
    (docs/performance.md, "Weight updates"). Elsewhere (to the device) `copy_`."""
    if (
        dest.device.type == "cpu"
        and src.device.type == "cpu"
        and dest.dtype == src.dtype
        and dest.shape == src.shape
        and dest.is_contiguous()
        and src.is_contiguous()
    ):
        ctypes.memmove(dest.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dest.copy_(src, non_blocking=True)


def digest(model: DecoderModel) -> str:
    """SHA-256 of every weight the model holds now (its state, and its packed weights'
    values): equal digests, equal weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(_raw(tensor))
    for path, module in sorted(model.named_modules(), key=lambda m: m[0]):
        if isinstance(module, PackedLinear):
            h.update(path.encode())
            h.update(_raw(module.packed.tensor.to_dense()))
    return h.hexdigest()


def _raw(tensor: torch.Tensor) -> bytes:
    # A copy: numpy() on the weights' own storage would pin it (no release by resize then).
    flat = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()
