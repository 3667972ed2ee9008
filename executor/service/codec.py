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

from executor.errors import BatchValidationError, RuntimeConfigError
from executor.forward_batch import ForwardBatch, ForwardMode, SamplingBatch, SamplingParams
from executor.service.runtime_config import RuntimeConfig, RuntimeConfigUpdate
from executor.step.outputs import ExecutorInfo, ForwardOutput, StepStats
from executor.validation import BatchLimits, check_request_count, check_token_count
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
# The ForwardBatch message's tensor fields.
BATCH_TENSOR_FIELDS = (
    "input_ids",
    "req_pool_indices",
    "seq_lens",
    "out_cache_loc",
    "positions",
    "extend_prefix_lens",
    "extend_seq_lens",
    "prefix_cache_loc",
    "released_req_pool_indices",
    "input_embeds",
    "future_token_slots",
    "released_future_slots",
)
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
    if msg.dtype not in _TO_TORCH:
        raise BatchValidationError(
            field, f"dtype must be one of INT32, INT64, FLOAT32, BFLOAT16, FLOAT16, got {msg.dtype}"
        )
    dtype = _TO_TORCH[msg.dtype]
    if len(msg.shape) > _MAX_RANK:  # before any per-dimension work
        raise BatchValidationError(field, f"rank must be <= {_MAX_RANK}, got {len(msg.shape)}")
    shape = tuple(msg.shape)
    if len(shape) == 1:  # the usual batch field: no generator, no product
        numel = shape[0]
        if numel < 0:
            raise BatchValidationError(field, f"shape must be non-negative, got {list(shape)}")
    else:
        if any(d < 0 for d in shape):
            raise BatchValidationError(field, f"shape must be non-negative, got {list(shape)}")
        numel = math.prod(shape)  # Python integers: no overflow, a huge claim just mismatches
    itemsize = _ITEMSIZE[dtype]
    if len(msg.data) != numel * itemsize:
        raise BatchValidationError(
            field,
            f"data has {len(msg.data)} bytes, shape {list(shape)} of {pb.DType.Name(msg.dtype)} needs {numel * itemsize}",
        )
    if numel == 0:
        # An empty tensor's other dimensions can be anything; their product still has to fit
        # the strides torch computes, or building it overflows.
        if math.prod(max(d, 1) for d in shape) > _MAX_EXTENT:
            raise BatchValidationError(field, f"shape {list(shape)} is too large")
        return torch.empty(shape, dtype=dtype)
    if not _LITTLE_ENDIAN:  # the wire is little-endian: swap into a native copy
        wire = np.frombuffer(msg.data, dtype="<i2" if dtype == torch.bfloat16 else _NUMPY_LE[dtype])
        native = torch.from_numpy(wire.astype(wire.dtype.newbyteorder("="))).view(shape)
        return native.view(torch.bfloat16) if dtype == torch.bfloat16 else native
    flat = torch.frombuffer(msg.data, dtype=dtype)
    return flat if len(shape) == 1 else flat.view(shape)  # a view costs more than the decode


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
            )
            for p in params
        ],
        bs,
    )


def _element_count(msg: pb.Tensor) -> int:
    """The element count a tensor's bytes hold (header math: no per-element work)."""
    return len(msg.data) // _ITEMSIZE.get(_TO_TORCH.get(msg.dtype, torch.int64), 8)


def check_size_claims(msg: pb.ForwardBatch, limits: BatchLimits) -> None:
    """Refuse a batch whose requests or tokens exceed the limits before anything is built:
    lengths of repeated fields and tensor byte counts only (BatchTooLargeError). Every other
    rule is validation's, on the device thread."""
    check_request_count("sampling_params", len(msg.sampling_params), limits)
    for name in ("req_pool_indices", "seq_lens", "future_token_slots"):
        if msg.HasField(name):
            check_request_count(name, _element_count(getattr(msg, name)), limits)
    for name in ("input_ids", "out_cache_loc", "positions"):
        if msg.HasField(name):
            check_token_count(name, _element_count(getattr(msg, name)), limits)


def batch_from_proto(msg: pb.ForwardBatch, limits: BatchLimits | None = None) -> ForwardBatch:
    """Decode a wire batch into a host ForwardBatch (validation happens on the device thread).

    The codec refuses only what it must before it allocates: an unknown mode, a tensor whose
    bytes do not match its dtype and shape, a missing required field, and (with `limits`)
    size claims beyond them, from the header alone."""
    if msg.forward_mode not in (pb.EXTEND, pb.DECODE, pb.IDLE):
        raise BatchValidationError(
            "forward_mode", f"must be EXTEND, DECODE or IDLE, got {msg.forward_mode}"
        )
    if limits is not None:
        check_size_claims(msg, limits)
    mode = ForwardMode(msg.forward_mode)
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
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=input_ids,
        req_pool_indices=rows,
        seq_lens=seq_lens,
        out_cache_loc=out_loc,
        positions=_optional(msg, "positions"),
        extend_prefix_lens=_optional(msg, "extend_prefix_lens"),
        extend_seq_lens=_optional(msg, "extend_seq_lens"),
        prefix_cache_loc=_optional(msg, "prefix_cache_loc"),
        released_req_pool_indices=_optional(msg, "released_req_pool_indices"),
        input_embeds=input_embeds,
        future_token_slots=_optional(msg, "future_token_slots"),
        released_future_slots=_optional(msg, "released_future_slots"),
        sampling=sampling_from_proto(msg.sampling_params, max(bs, 0)),
        return_logprob=msg.return_logprob,
        top_logprobs_num=msg.top_logprobs_num,
    )


def batch_to_proto(fb: ForwardBatch) -> pb.ForwardBatch:
    msg = pb.ForwardBatch(
        forward_mode=int(fb.forward_mode),
        return_logprob=fb.return_logprob,
        top_logprobs_num=fb.top_logprobs_num,
    )
    for name in BATCH_TENSOR_FIELDS:
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
            strict=True,
        )
        for temperature, top_p, top_k, min_p, seed, has_seed in columns:
            p = msg.sampling_params.add(
                temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p
            )
            if has_seed:
                p.seed = seed % (1 << 64)
    return msg


def response_to_proto(out: ForwardOutput, batch_id: int) -> pb.ForwardResponse:
    st = out.stats
    msg = pb.ForwardResponse(
        batch_id=batch_id,
        next_token_ids=tensor_to_proto(out.next_token_ids),
        stats=pb.ForwardStats(
            path=st.path,
            batch_size=st.batch_size,
            padded_batch_size=st.padded_batch_size,
            num_tokens=st.num_tokens,
            padded_num_tokens=st.padded_num_tokens,
            timings_ns=st.timings_ns,
            mode=st.mode,
            fill_registry=st.fill_registry or "",
            fill_tensors=st.fill_tensors,
            fill_bytes=st.fill_bytes,
            fill_copy_calls=st.fill_copy_calls,
            d2h_syncs=st.d2h_syncs,
            h2d_syncs=st.h2d_syncs,
            h2d_copies=st.h2d_copies,
        ),
    )
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
        ),
        next_token_logprobs=opt("next_token_logprobs"),
        top_logprob_ids=opt("top_logprob_ids"),
        top_logprobs=opt("top_logprobs"),
    )


def info_to_proto(
    info: ExecutorInfo, model_spec: str, runtime_config: RuntimeConfig | None = None
) -> pb.GetInfoResponse:
    lim = info.limits
    msg = pb.GetInfoResponse(
        tp_size=info.tp_size,
        model_name=info.model_name,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        hidden_size=info.hidden_size,
        dtype=info.dtype,
        device=info.device,
        max_reqs=lim.max_reqs,
        kv_slots=lim.kv_slots,
        max_context_len=lim.max_context_len,
        max_batch_size=lim.max_batch_size,
        max_tokens_per_batch=lim.max_tokens_per_batch,
        max_top_logprobs=lim.max_top_logprobs,
        future_slots=lim.future_slots,
        eos_token_ids=list(info.eos_token_ids),
        attention_backend=info.attention_backend,
        server_version=info.version,
        model_spec=model_spec,
        quantization=info.quantization,
        linear_kernel=info.linear_kernel,
        weight_bytes=info.weight_bytes,
        graph_capture_disabled=info.graph_capture_disabled,
    )
    if info.bos_token_id is not None:
        msg.bos_token_id = info.bos_token_id
    if runtime_config is not None:
        msg.runtime_config.CopyFrom(runtime_config_to_proto(runtime_config))
    return msg


def info_from_proto(msg: pb.GetInfoResponse) -> tuple[ExecutorInfo, str]:
    limits = BatchLimits(
        max_reqs=msg.max_reqs,
        kv_slots=msg.kv_slots,
        max_context_len=msg.max_context_len,
        vocab_size=msg.vocab_size,
        hidden_size=msg.hidden_size,
        max_batch_size=msg.max_batch_size,
        max_tokens_per_batch=msg.max_tokens_per_batch,
        max_top_logprobs=msg.max_top_logprobs,
        future_slots=msg.future_slots,
    )
    info = ExecutorInfo(
        model_name=msg.model_name,
        architecture=msg.architecture,
        vocab_size=msg.vocab_size,
        hidden_size=msg.hidden_size,
        dtype=msg.dtype,
        device=msg.device,
        limits=limits,
        eos_token_ids=tuple(msg.eos_token_ids),
        bos_token_id=msg.bos_token_id if msg.HasField("bos_token_id") else None,
        attention_backend=msg.attention_backend,
        version=msg.server_version,
        quantization=msg.quantization,
        linear_kernel=msg.linear_kernel or "aten",  # "": a server from before the setting
        weight_bytes=msg.weight_bytes,
        graph_capture_disabled=msg.graph_capture_disabled,
        tp_size=msg.tp_size or 1,  # 0: a server from before tensor parallelism
    )
    return info, msg.model_spec


_NEEDS_CPU_SEQ_LENS = {
    "auto": pb.NEEDS_CPU_SEQ_LENS_AUTO,
    "on": pb.NEEDS_CPU_SEQ_LENS_ON,
    "off": pb.NEEDS_CPU_SEQ_LENS_OFF,
}
_GRAPH_MODE = {
    "none": pb.GRAPH_MODE_NONE,
    "decode": pb.GRAPH_MODE_DECODE,
    "extend": pb.GRAPH_MODE_EXTEND,
    "both": pb.GRAPH_MODE_BOTH,
}
_NEEDS_CPU_SEQ_LENS_NAMES = {v: k for k, v in _NEEDS_CPU_SEQ_LENS.items()}
_GRAPH_MODE_NAMES = {v: k for k, v in _GRAPH_MODE.items()}


def runtime_config_to_proto(config: RuntimeConfig) -> pb.RuntimeConfig:
    return pb.RuntimeConfig(
        eager_input_no_copy=config.eager_input_no_copy,
        needs_cpu_seq_lens=_NEEDS_CPU_SEQ_LENS[config.needs_cpu_seq_lens],
        graph_mode=_GRAPH_MODE[config.graph_mode],
        log_level=config.log_level,
        trace_sample_ratio=config.trace_sample_ratio,
        needs_cpu_seq_lens_effective=config.needs_cpu_seq_lens_effective,
        graph_capture=config.graph_capture,
    )


def runtime_config_from_proto(msg: pb.RuntimeConfig) -> RuntimeConfig:
    return RuntimeConfig(
        eager_input_no_copy=msg.eager_input_no_copy,
        needs_cpu_seq_lens=_NEEDS_CPU_SEQ_LENS_NAMES.get(msg.needs_cpu_seq_lens, "auto"),
        needs_cpu_seq_lens_effective=msg.needs_cpu_seq_lens_effective,
        graph_mode=_GRAPH_MODE_NAMES.get(msg.graph_mode, "none"),
        log_level=msg.log_level,
        trace_sample_ratio=msg.trace_sample_ratio,
        graph_capture=msg.graph_capture or "idle",
    )


def runtime_update_to_proto(update: RuntimeConfigUpdate) -> pb.RuntimeConfig:
    msg = pb.RuntimeConfig()
    if update.eager_input_no_copy is not None:
        msg.eager_input_no_copy = update.eager_input_no_copy
    if update.needs_cpu_seq_lens is not None:
        msg.needs_cpu_seq_lens = _NEEDS_CPU_SEQ_LENS[update.needs_cpu_seq_lens]
    if update.graph_mode is not None:
        msg.graph_mode = _GRAPH_MODE[update.graph_mode]
    if update.log_level is not None:
        msg.log_level = update.log_level
    if update.trace_sample_ratio is not None:
        msg.trace_sample_ratio = update.trace_sample_ratio
    return msg


def runtime_update_from_proto(msg: pb.RuntimeConfig) -> RuntimeConfigUpdate:
    """The fields an update sets; RuntimeConfigError (INVALID_ARGUMENT) for a malformed one."""
    if msg.HasField("needs_cpu_seq_lens_effective"):
        raise RuntimeConfigError(
            "needs_cpu_seq_lens_effective is output only; set needs_cpu_seq_lens instead"
        )
    if msg.HasField("graph_capture"):
        raise RuntimeConfigError("graph_capture is output only; set graph_mode instead")
    values: dict[str, Any] = {}
    if msg.HasField("eager_input_no_copy"):
        values["eager_input_no_copy"] = msg.eager_input_no_copy
    for name, names in (
        ("needs_cpu_seq_lens", _NEEDS_CPU_SEQ_LENS_NAMES),
        ("graph_mode", _GRAPH_MODE_NAMES),
    ):
        if msg.HasField(name):
            value = getattr(msg, name)
            if value not in names:
                raise RuntimeConfigError(
                    f"{name} must be one of {', '.join(sorted(names.values()))}, got enum value {value}"
                )
            values[name] = names[value]
    if msg.HasField("log_level"):
        values["log_level"] = msg.log_level
    if msg.HasField("trace_sample_ratio"):
        values["trace_sample_ratio"] = msg.trace_sample_ratio
    return RuntimeConfigUpdate(**values)
