"""What the executor reports about itself: `ExecutorInfo` (GetInfo) and `SettingChoice`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from executor.config import ExecutorConfig
from executor.core.limits import BatchLimits
from executor.core.lora_types import LoraInfo
from executor.kv_transfer.layout import KVLayout, KVTransferLimits
from executor.models.decoder_model import DecoderModel
from executor.models.layers import Linear
from executor.models.loader import ServedModel
from executor.weights.memory import MemoryReport


@dataclass(frozen=True)
class SettingChoice:
    """What a start-up setting became on this machine: `auto` resolved, or as configured."""

    setting: str  # the ExecutorConfig field: dtype, quantization, quant_kernel, ...
    value: str
    reason: str  # what `auto` saw, or "configured"


@dataclass(frozen=True)
class ExecutorInfo:
    """Everything a scheduler needs to allocate rows and slots and to stop requests."""

    model_name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    dtype: str
    device: str
    limits: BatchLimits
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    attention_backend: str
    version: str
    quantization: str = "none"  # none | gguf | int8 | int4
    linear_kernel: str = "aten"  # what the float linears run on: onednn (packed) | aten
    weight_bytes: int = 0  # resident bytes of the model's weights (this rank's shard)
    # Why graph capture stopped for good (a poisoned capture; graph paths run eagerly); "".
    graph_capture_disabled: str = ""
    tp_size: int = 1  # tensor-parallel ranks
    sampling_controls: tuple[str, ...] = ()  # the controls applied (proto field names)
    deferred_mask_timeout_ms: int = 0  # how long sampling waits for a deferred vocab mask
    kv_layout: KVLayout | None = None  # the KV cache as a transfer sees it (this rank's heads)
    kv_transfer_limits: KVTransferLimits | None = None  # the caps on one KV transfer
    lora: LoraInfo = field(default_factory=LoraInfo)  # adapters loaded, slots, rank cap
    # What each performance setting became here and why (the start-up log says the same).
    choices: tuple[SettingChoice, ...] = ()
    weight_version: str = ""  # the weights in use now
    memory: MemoryReport | None = None  # released tags, KV epoch
    # What one weight update may carry at most, from the model (the server may cap less).
    weight_update_max_tensors: int = 0
    weight_update_max_bytes: int = 0


def pipeline_choice(config: ExecutorConfig, device: torch.device) -> SettingChoice:
    """Whether the device thread prepares the next batch while a step runs (`pipeline_steps`)."""
    if config.pipeline_steps != "auto":
        return SettingChoice("pipeline_steps", config.pipeline_steps, "configured")
    if config.simulated_step_ms:
        return SettingChoice(
            "pipeline_steps", "on", "auto: the stand-in's steps run asynchronously"
        )
    if device.type == "cuda":
        return SettingChoice("pipeline_steps", "on", "auto: CUDA runs a step asynchronously")
    return SettingChoice("pipeline_steps", "off", "auto: a CPU device's forward is synchronous")


def eager_inputs_choice(config: ExecutorConfig) -> SettingChoice:
    """Which eager path a step takes at start-up (`eager_input_no_copy`; a runtime toggle too)."""
    if config.eager_input_no_copy:
        return SettingChoice("eager_input_no_copy", "true", "configured")
    return SettingChoice(
        "eager_input_no_copy",
        "false",
        "default: eager inputs go through the input registry (one grouped device copy a step, "
        "within the spread of a real model's eager step; benchmarks/eager_registry.py)",
    )


def lm_head_choice(config: ExecutorConfig, model: DecoderModel) -> SettingChoice:
    """The dtype the LM head computes in (`lm_head_dtype`); sets it on `model`."""
    act = str(model.activation_dtype).removeprefix("torch.")
    if config.lm_head_dtype == "auto":
        model.head_dtype = None
        return SettingChoice("lm_head_dtype", act, "auto: the model's dtype")
    model.head_dtype = torch.float32
    if model.lm_head is not None and not isinstance(model.lm_head, Linear):
        kind = type(model.lm_head).__name__
        why = f"configured; the {kind} head takes float32 hidden states, its kernel keeps its own precision"
        return SettingChoice("lm_head_dtype", "float32", why)
    return SettingChoice("lm_head_dtype", "float32", "configured")


def log_ready(info: ExecutorInfo, **extra: Any) -> None:
    """The start-up's last log lines: `executor ready` with what GetInfo says and `extra` (this
    rank's runtime state), then one `setting chosen` line per setting choice."""
    log = structlog.get_logger("executor.model_executor")
    log.info(
        "executor ready",
        model=info.model_name,
        device=info.device,
        dtype=info.dtype,
        quantization=info.quantization,
        linear_kernel=info.linear_kernel,
        weight_mib=round(info.weight_bytes / 2**20, 1),
        attention_backend=info.attention_backend,
        max_reqs=info.limits.max_reqs,
        kv_slots=info.limits.kv_slots,
        max_context_len=info.limits.max_context_len,
        tp_size=info.tp_size,
        **extra,
    )
    for choice in info.choices:
        log.info("setting chosen", setting=choice.setting, value=choice.value, reason=choice.reason)


def start_up_choices(
    config: ExecutorConfig, device: torch.device, served: ServedModel
) -> tuple[SettingChoice, ...]:
    """What each start-up setting resolved to, and why (the pipeline's last: `pipelines`)."""
    loaded = served.loaded
    return (
        SettingChoice("device", str(device), "configured" if config.device != "auto" else "auto"),
        SettingChoice("dtype", str(served.dtype.dtype).removeprefix("torch."), served.dtype.reason),
        SettingChoice("quantization", loaded.quantization, served.quantization_reason),
        SettingChoice("quant_kernel", loaded.quant_kernel, loaded.quant_kernel_reason),
        SettingChoice("linear_kernel", loaded.linear_kernel, loaded.linear_kernel_reason),
        lm_head_choice(config, loaded.model),
        SettingChoice(
            "batch_invariant",
            "on" if config.batch_invariant else "off",
            "configured" if config.batch_invariant else "default",
        ),
        eager_inputs_choice(config),
        pipeline_choice(config, device),
    )
