"""GetInfo and the runtime toggles on the wire (the batch codec is `codec.py`)."""

from __future__ import annotations

from typing import Any

import torch

from executor.core.controls_types import mask_words
from executor.core.errors import BatchValidationError, RuntimeConfigError
from executor.core.limits import BatchLimits
from executor.info import ExecutorInfo, SettingChoice
from executor.kv_transfer.layout import KVLayout, KVTransferLimits
from executor.service.lora_codec import add_lora_info_to_proto, lora_info_from_proto
from executor.service.runtime_config import RuntimeConfig, RuntimeConfigUpdate
from executor.weights.memory import MemoryReport
from model_executor.v1 import executor_pb2 as pb

_KV_DTYPES = {pb.FLOAT32: torch.float32, pb.BFLOAT16: torch.bfloat16, pb.FLOAT16: torch.float16}
_KV_DTYPE_PB = {v: k for k, v in _KV_DTYPES.items()}


def layout_to_proto(layout: KVLayout, limits: KVTransferLimits) -> pb.KvLayout:
    return pb.KvLayout(
        num_layers=layout.num_layers,
        kv_heads=layout.kv_heads,
        kv_heads_total=layout.kv_heads_total,
        head_dim=layout.head_dim,
        dtype=_KV_DTYPE_PB[layout.dtype],
        kv_slots=layout.kv_slots,
        bytes_per_slot=layout.bytes_per_slot,
        tp_size=layout.tp_size,
        max_transfer_slots=limits.max_slots,
        max_transfer_runs=limits.max_runs,
        chunk_bytes=limits.chunk_bytes,
        max_push_transfers=limits.max_push_transfers,
        transfer_memory=limits.transfer_memory,
    )


def layout_from_proto(msg: pb.KvLayout, field: str) -> KVLayout:
    if msg.dtype not in _KV_DTYPES:
        raise BatchValidationError(
            f"{field}.dtype", f"must be FLOAT32, BFLOAT16 or FLOAT16, got {msg.dtype}"
        )
    return KVLayout(
        num_layers=msg.num_layers,
        kv_heads=msg.kv_heads,
        kv_heads_total=msg.kv_heads_total,
        head_dim=msg.head_dim,
        dtype=_KV_DTYPES[msg.dtype],
        kv_slots=msg.kv_slots,
        tp_size=msg.tp_size,
    )


def limits_from_proto(msg: pb.KvLayout) -> KVTransferLimits:
    return KVTransferLimits(
        msg.max_transfer_slots,
        msg.max_transfer_runs,
        msg.chunk_bytes,
        msg.max_push_transfers,
        msg.transfer_memory,
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
        sampling_controls=list(info.sampling_controls),
        vocab_mask_words=mask_words(info.vocab_size),
        max_logit_bias=lim.max_logit_bias,
        max_control_token_ids=lim.max_control_token_ids,
        deferred_mask_timeout_ms=info.deferred_mask_timeout_ms,
        max_draft_tokens=lim.max_draft_tokens,
        max_ngram=lim.max_ngram,
        max_score_token_ids=lim.max_score_token_ids,
        max_prompt_logprob_bytes=lim.max_prompt_logprob_bytes,
        max_hidden_bytes=lim.max_hidden_bytes,
        max_output_bytes=lim.max_output_bytes,
        max_routed_expert_bytes=lim.max_routed_expert_bytes,
        routed_expert_layers=list(lim.routed_expert_layers),
        routed_experts_top_k=lim.routed_experts_top_k,
        allow_input_embeds=lim.allow_input_embeds,
        setting_choices=[
            pb.SettingChoice(setting=c.setting, value=c.value, reason=c.reason)
            for c in info.choices
        ],
    )
    if info.kv_layout is not None and info.kv_transfer_limits is not None:
        msg.kv_layout.CopyFrom(layout_to_proto(info.kv_layout, info.kv_transfer_limits))
    add_lora_info_to_proto(info.lora, msg)
    msg.weight_version = info.weight_version
    if info.memory is not None:
        msg.memory.CopyFrom(
            pb.MemoryState(
                released=list(info.memory.released),
                kv_epoch=info.memory.kv_epoch,
                weights_await_update=info.memory.awaiting_update,
            )
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
        max_logit_bias=msg.max_logit_bias,
        max_control_token_ids=msg.max_control_token_ids,
        max_draft_tokens=msg.max_draft_tokens,
        max_ngram=msg.max_ngram,
        max_score_token_ids=msg.max_score_token_ids,
        max_prompt_logprob_bytes=msg.max_prompt_logprob_bytes,
        max_hidden_bytes=msg.max_hidden_bytes,
        max_output_bytes=msg.max_output_bytes,
        max_routed_expert_bytes=msg.max_routed_expert_bytes,
        routed_expert_layers=tuple(msg.routed_expert_layers),
        routed_experts_top_k=msg.routed_experts_top_k,
        allow_input_embeds=msg.allow_input_embeds,
    )
    has_kv = msg.HasField("kv_layout")  # unset: a server from before the KV data plane
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
        sampling_controls=tuple(msg.sampling_controls),
        deferred_mask_timeout_ms=msg.deferred_mask_timeout_ms,
        kv_layout=layout_from_proto(msg.kv_layout, "kv_layout") if has_kv else None,
        kv_transfer_limits=limits_from_proto(msg.kv_layout) if has_kv else None,
        choices=tuple(SettingChoice(c.setting, c.value, c.reason) for c in msg.setting_choices),
        lora=lora_info_from_proto(msg),
        weight_version=msg.weight_version,
        memory=MemoryReport(
            tuple(msg.memory.released), msg.memory.kv_epoch, msg.memory.weights_await_update
        ),
        weight_update_max_tensors=msg.weight_update_limits.max_tensors,
        weight_update_max_bytes=msg.weight_update_limits.max_update_bytes,
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
