"""The wire codec: proto messages <-> domain objects, translated exactly once.

Tensor bytes are decoded with `torch.frombuffer` (no copy of the payload); encoding takes a
tensor's bytes in one call, never per element. Every decoding error is a
BatchValidationError that names the field, so the server answers INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import numpy as np
import torch

from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.core.forward_batch import (
    WIRE_TENSOR_FIELDS,
    ForwardBatch,
    ForwardMode,
    LogprobsMode,
    SamplingBatch,
    SamplingParams,
)
from executor.core.limits import BatchLimits
from executor.core.outputs import ForwardOutput, StepStats
from executor.service.controls_codec import (
    add_controls_to_proto,
    check_control_claims,
    controls_fields,
)
from executor.service.extras_codec import (
    add_outputs_to_proto,
    check_output_claims,
    extras_from_proto,
    extras_to_proto,
    outputs_from_proto,
)
from executor.service.info_codec import (  # re-exported: GetInfo and the toggles' codec
    info_from_proto,
    info_to_proto,
    runtime_config_from_proto,
    runtime_config_to_proto,
    runtime_update_from_proto,
    runtime_update_to_proto,
)
from executor.service.lora_codec import (
    adapters_from_proto,
    add_adapters_to_proto,
    check_lora_claims,
)
from executor.validation import INPUT_EMBEDS_OFF, check_request_count, check_token_count
from model_executor.v1 import executor_pb2 as pb

# bytes are immutable; torch.frombuffer warns that its tensor could write into them. The
# decoded tensors never do. One filter for that message only, not a catch_warnings per field.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_TO_TORCH = {
    pb.INT32: torch.int32,
    pb.INT64: torch.int64,
    pb.FLOAT32: torch.float32,
    pb.BFLOAT16: torch.bfloat16,
    pb.FLOAT16: torch.float16,
}
_TO_PB = {v: k for k, v in _TO_TORCH.items()}
_LITTLE_ENDIAN = sys.byteorder == "little"
_MAX_EXTENT = 2**62
_NUMPY_LE = {torch.int32: "<i4", torch.int64: "<i8", torch.float32: "<f4", torch.float16: "<f2"}
_ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in _TO_TORCH.values()}
_WIRE_ITEMSIZE = {k: _ITEMSIZE[d] for k, d in _TO_TORCH.items()}
_MAX_RANK = 8  # batch fields are vectors or matrices; this bounds per-dimension work


def tensor_to_proto(t: torch.Tensor) -> pb.Tensor:
    if t.dtype not in _TO_PB:
        raise ValueError(f"dtype {t.dtype} has no wire type")
    if t.device.type != "cpu" or t.requires_grad or not t.is_contiguous():
        t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        data = t.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    elif _LITTLE_ENDIAN:  # the wire's byte order: the bytes as they are
        data = t.numpy().tobytes()
    else:
        data = t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
    return pb.Tensor(dtype=_TO_PB[t.dtype], shape=list(t.shape), data=data)


def tensor_from_proto(msg: pb.Tensor, field: str) -> torch.Tensor:
    """A tensor viewing the message's bytes (no copy). Read-only in practice: never written."""
    dtype = _TO_TORCH.get(msg.dtype)
    if dtype is None:
        raise BatchValidationError(
            field, f"dtype must be one of INT32, INT64, FLOAT32, BFLOAT16, FLOAT16, got {msg.dtype}"
        )
    dims = msg.shape
    rank = len(dims)
    if rank > _MAX_RANK:  # before any per-dimension work
        raise BatchValidationError(field, f"rank must be <= {_MAX_RANK}, got {rank}")
    if rank == 1:  # the usual batch field: no tuple, no product
        numel = dims[0]
        if numel < 0:
            raise BatchValidationError(field, f"shape must be non-negative, got {list(dims)}")
    else:
        if any(d < 0 for d in dims):
            raise BatchValidationError(field, f"shape must be non-negative, got {list(dims)}")
        numel = math.prod(dims)  # Python integers: no overflow, a huge claim just mismatches
    data = msg.data
    itemsize = _ITEMSIZE[dtype]
    if len(data) != numel * itemsize:
        raise BatchValidationError(
            field,
            f"data has {len(data)} bytes, shape {list(dims)} of {pb.DType.Name(msg.dtype)} needs {numel * itemsize}",
        )
    if numel == 0:
        # An empty tensor's other dimensions can be anything; their product still has to fit
        # the strides torch computes, or building it overflows.
        shape = tuple(dims)
        if math.prod(max(d, 1) for d in shape) > _MAX_EXTENT:
            raise BatchValidationError(field, f"shape {list(shape)} is too large")
        return torch.empty(shape, dtype=dtype)
    if not _LITTLE_ENDIAN:  # the wire is little-endian: swap into a native copy
        wire = np.frombuffer(data, dtype="<i2" if dtype == torch.bfloat16 else _NUMPY_LE[dtype])
        native = torch.from_numpy(wire.astype(wire.dtype.newbyteorder("="))).view(tuple(dims))
        return native.view(torch.bfloat16) if dtype == torch.bfloat16 else native
    flat = torch.frombuffer(data, dtype=dtype)
    return flat if rank == 1 else flat.view(tuple(dims))  # a view costs more than the decode


def _optional(batch: pb.ForwardBatch, name: str) -> torch.Tensor | None:
    return tensor_from_proto(getattr(batch, name), name) if batch.HasField(name) else None


def _required(batch: pb.ForwardBatch, name: str) -> torch.Tensor:
    if not batch.HasField(name):
        raise BatchValidationError(name, "is required")
    return tensor_from_proto(getattr(batch, name), name)


def sampling_from_proto(params: Any, bs: int) -> SamplingBatch | None:
    if len(params) == 0:
        return None
    return SamplingBatch.from_params(
        [
            SamplingParams(
                temperature=p.temperature,
                top_p=p.top_p if p.top_p != 0 else 1.0,  # proto3 default: unset
                top_k=p.top_k,
                min_p=p.min_p,
                seed=p.seed if p.HasField("seed") else None,
                logprobs_mode=_logprobs_mode(p.logprobs_mode, i),
            )
            for i, p in enumerate(params)
        ],
        bs,
    )


def _logprobs_mode(value: int, i: int) -> LogprobsMode:
    if value not in _LOGPROBS_MODES:
        raise BatchValidationError(
            f"sampling_params[{i}].logprobs_mode",
            f"must be LOGPROBS_MODE_RAW or LOGPROBS_MODE_PROCESSED, got {value}",
        )
    return LogprobsMode(value)


_LOGPROBS_MODES = frozenset(int(m) for m in LogprobsMode)


def _element_count(msg: pb.Tensor) -> int:
    """The element count a tensor's bytes hold (header math: no per-element work)."""
    return len(msg.data) // _WIRE_ITEMSIZE.get(msg.dtype, 8)


# Size claims from the header (check_size_claims): fields counted in requests, in tokens.
_REQUEST_CLAIMS = ("req_pool_indices", "seq_lens", "future_token_slots", "ngram_draft")
_TOKEN_CLAIMS = ("input_ids", "out_cache_loc", "positions")


def check_size_claims(msg: pb.ForwardBatch, limits: BatchLimits) -> None:
    """Refuse a batch whose requests or tokens exceed the limits before anything is built:
    lengths of repeated fields and tensor byte counts only (BatchTooLargeError). Every other
    rule is validation's, on the device thread."""
    if msg.HasField("input_embeds") and not limits.allow_input_embeds:
        raise BatchValidationError("input_embeds", INPUT_EMBEDS_OFF)
    # A release list longer than the table it frees is never valid: refused by its length.
    for name, cap in (
        ("released_req_pool_indices", limits.max_reqs),
        ("released_future_slots", max(limits.future_slots, 1)),
    ):
        if msg.HasField(name) and _element_count(getattr(msg, name)) > cap:
            raise BatchTooLargeError(
                name, f"has {_element_count(getattr(msg, name))} entries; must be <= {cap}"
            )
    most = limits.max_batch_size
    if len(msg.sampling_params) > most:
        check_request_count("sampling_params", len(msg.sampling_params), limits)
    for name in _REQUEST_CLAIMS:
        if msg.HasField(name) and _element_count(getattr(msg, name)) > most:
            check_request_count(name, _element_count(getattr(msg, name)), limits)
    most = limits.max_tokens_per_batch
    for name in _TOKEN_CLAIMS:
        if msg.HasField(name) and _element_count(getattr(msg, name)) > most:
            check_token_count(name, _element_count(getattr(msg, name)), limits)
    if msg.row_controls or msg.HasField("vocab_mask"):
        check_control_claims(msg, limits)
    if msg.row_adapters:
        check_lora_claims(msg, limits)
    if msg.row_outputs:
        tokens = _element_count(msg.input_ids) if msg.HasField("input_ids") else 0
        check_output_claims(msg, limits, tokens)


_MODES = {m.value: m for m in ForwardMode}
# The optional tensor fields, in the order they are decoded (the first bad one is named).
_OPTIONAL = (
    "positions",
    "extend_prefix_lens",
    "extend_seq_lens",
    "prefix_cache_loc",
    "released_req_pool_indices",
    "future_token_slots",
    "ngram_draft",
    "released_future_slots",
)


def batch_from_proto(
    msg: pb.ForwardBatch, limits: BatchLimits | None = None, *, batch_id: int = 0
) -> ForwardBatch:
    """Decode a wire batch into a host ForwardBatch (validation happens on the device thread).

    The codec refuses only what it must before it allocates: an unknown mode, a tensor whose
    bytes do not match its dtype and shape, a missing required field, and (with `limits`)
    size claims beyond them, from the header alone."""
    mode = _MODES.get(msg.forward_mode)
    if mode is None:
        raise BatchValidationError(
            "forward_mode", f"must be EXTEND, DECODE, IDLE or VERIFY, got {msg.forward_mode}"
        )
    if limits is not None:
        check_size_claims(msg, limits)
    if mode is ForwardMode.IDLE and not msg.HasField("req_pool_indices"):
        empty = torch.zeros(0, dtype=torch.int64)
        rows, seq_lens, out_loc = empty, empty, empty
    else:
        rows = _required(msg, "req_pool_indices")
        seq_lens = _required(msg, "seq_lens")
        out_loc = _required(msg, "out_cache_loc")
    bs = int(rows.shape[0]) if rows.dim() == 1 else -1
    input_embeds = _optional(msg, "input_embeds")
    input_ids = _optional(msg, "input_ids")
    if input_ids is None and input_embeds is None and mode is ForwardMode.IDLE:
        input_ids = torch.zeros(0, dtype=torch.int64)
    fields: dict[str, Any] = {
        name: tensor_from_proto(getattr(msg, name), name)
        for name in _OPTIONAL
        if msg.HasField(name)
    }
    if msg.sampling_params:
        fields["sampling"] = sampling_from_proto(msg.sampling_params, max(bs, 0))
    if (
        msg.row_controls
        or msg.vocab_mask_deferred
        or msg.HasField("vocab_mask")
        or msg.HasField("vocab_mask_rows")
    ):
        fields.update(controls_fields(msg, batch_id, tensor_from_proto))
    if msg.row_outputs or msg.prompt_top_logprobs_num:
        fields.update(outputs_from_proto(msg))
    if msg.row_adapters:
        fields["row_adapters"] = adapters_from_proto(msg)
    return ForwardBatch.create(
        forward_mode=mode,
        batch_size=bs,
        input_ids=input_ids,
        req_pool_indices=rows,
        seq_lens=seq_lens,
        out_cache_loc=out_loc,
        input_embeds=input_embeds,
        return_logprob=msg.return_logprob,
        top_logprobs_num=msg.top_logprobs_num,
        **fields,
    )


def batch_to_proto(fb: ForwardBatch) -> pb.ForwardBatch:
    msg = pb.ForwardBatch(
        forward_mode=int(fb.forward_mode),
        return_logprob=fb.return_logprob,
        top_logprobs_num=fb.top_logprobs_num,
    )
    for name in WIRE_TENSOR_FIELDS:
        value = getattr(fb, name)
        if value is not None:
            getattr(msg, name).CopyFrom(tensor_to_proto(value))
    if fb.sampling is not None:
        s = fb.sampling
        # One tolist() per field, not one tensor read per request and field.
        columns = zip(
            s.temperatures.tolist(),
            s.top_ps.tolist(),
            s.top_ks.tolist(),
            s.min_ps.tolist(),
            s.seeds.tolist(),
            s.has_seed.tolist(),
            s.processed.tolist(),
            strict=True,
        )
        for temperature, top_p, top_k, min_p, seed, has_seed, processed in columns:
            p = msg.sampling_params.add(
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                logprobs_mode=int(LogprobsMode.PROCESSED if processed else LogprobsMode.RAW),
            )
            if has_seed:
                p.seed = seed % (1 << 64)
    add_controls_to_proto(fb, msg, tensor_to_proto)
    add_adapters_to_proto(fb, msg)
    add_outputs_to_proto(fb, msg)
    return msg


def response_to_proto(out: ForwardOutput, batch_id: int) -> pb.ForwardResponse:
    """The answer to one batch. Fields are set in place (every step: a message built from
    keyword arguments is built twice, once as an argument and once copied in)."""
    msg = pb.ForwardResponse(batch_id=batch_id)
    ids = out.next_token_ids
    if ids.dtype is torch.int64 and ids.dim() == 1 and ids.is_cpu and not ids.requires_grad:
        wire = msg.next_token_ids
        wire.dtype = pb.INT64
        wire.shape.append(ids.numel())
        data = ids.numpy()
        wire.data = (data if _LITTLE_ENDIAN else data.astype("<i8")).tobytes()
    else:
        msg.next_token_ids.CopyFrom(tensor_to_proto(ids))
    st, stats = out.stats, msg.stats
    stats.path = st.path
    stats.batch_size = st.batch_size
    stats.padded_batch_size = st.padded_batch_size
    stats.num_tokens = st.num_tokens
    stats.padded_num_tokens = st.padded_num_tokens
    stats.timings_ns.update(st.timings_ns)
    stats.mode = st.mode
    stats.fill_registry = st.fill_registry or ""
    stats.fill_tensors = st.fill_tensors
    stats.fill_bytes = st.fill_bytes
    stats.fill_copy_calls = st.fill_copy_calls
    stats.d2h_syncs = st.d2h_syncs
    stats.h2d_syncs = st.h2d_syncs
    stats.h2d_copies = st.h2d_copies
    if st.control_rows:
        stats.control_rows.update(st.control_rows)
    stats.draft_tokens = st.draft_tokens
    stats.accepted_drafts = st.accepted_drafts
    stats.lora_rows = st.lora_rows
    stats.host_gap_ns = st.host_gap_ns
    if out.weight_version:
        msg.weight_version = out.weight_version
    if out.extras is not None:
        extras_to_proto(out.extras, msg, tensor_to_proto)
    if out.accepted_tokens is not None and out.accepted_lengths is not None:
        lengths = tensor_to_proto(out.accepted_lengths)
        msg.accepted_tokens.values.CopyFrom(tensor_to_proto(out.accepted_tokens))
        msg.accepted_tokens.lengths.CopyFrom(lengths)
        if out.accepted_logprobs is not None:
            msg.accepted_logprobs.values.CopyFrom(tensor_to_proto(out.accepted_logprobs))
            msg.accepted_logprobs.lengths.CopyFrom(lengths)
    if out.next_token_logprobs is not None:
        msg.next_token_logprobs.CopyFrom(tensor_to_proto(out.next_token_logprobs))
    if out.top_logprob_ids is not None and out.top_logprobs is not None:
        msg.top_logprob_ids.CopyFrom(tensor_to_proto(out.top_logprob_ids))
        msg.top_logprobs.CopyFrom(tensor_to_proto(out.top_logprobs))
    return msg


def response_from_proto(msg: pb.ForwardResponse) -> ForwardOutput:
    def opt(name: str) -> torch.Tensor | None:
        return tensor_from_proto(getattr(msg, name), name) if msg.HasField(name) else None

    st = msg.stats
    return ForwardOutput(
        next_token_ids=tensor_from_proto(msg.next_token_ids, "next_token_ids"),
        stats=StepStats(
            path=st.path,
            batch_size=st.batch_size,
            padded_batch_size=st.padded_batch_size,
            num_tokens=st.num_tokens,
            padded_num_tokens=st.padded_num_tokens,
            timings_ns=dict(st.timings_ns),
            mode=st.mode,
            fill_registry=st.fill_registry or None,
            fill_tensors=st.fill_tensors,
            fill_bytes=st.fill_bytes,
            fill_copy_calls=st.fill_copy_calls,
            d2h_syncs=st.d2h_syncs,
            h2d_syncs=st.h2d_syncs,
            h2d_copies=st.h2d_copies,
            control_rows=dict(st.control_rows),
            draft_tokens=st.draft_tokens,
            accepted_drafts=st.accepted_drafts,
            lora_rows=st.lora_rows,
            host_gap_ns=st.host_gap_ns,
        ),
        next_token_logprobs=opt("next_token_logprobs"),
        top_logprob_ids=opt("top_logprob_ids"),
        top_logprobs=opt("top_logprobs"),
        accepted_tokens=_ragged_values(msg, "accepted_tokens"),
        accepted_lengths=_ragged_lengths(msg, "accepted_tokens"),
        accepted_logprobs=_ragged_values(msg, "accepted_logprobs"),
        extras=extras_from_proto(msg, tensor_from_proto),
        weight_version=msg.weight_version,
    )


def _ragged_values(msg: pb.ForwardResponse, name: str) -> torch.Tensor | None:
    if not msg.HasField(name):
        return None
    return tensor_from_proto(getattr(msg, name).values, name + ".values")


def _ragged_lengths(msg: pb.ForwardResponse, name: str) -> torch.Tensor | None:
    if not msg.HasField(name):
        return None
    return tensor_from_proto(getattr(msg, name).lengths, name + ".lengths")


__all__ = [
    "info_from_proto",
    "info_to_proto",
    "runtime_config_from_proto",
    "runtime_config_to_proto",
    "runtime_update_from_proto",
    "runtime_update_to_proto",
]
