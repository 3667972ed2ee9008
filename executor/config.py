"""Start-up configuration: one frozen dataclass, validated once, plus what it resolves to.

`ExecutorConfig` holds what the operator asked for ("auto" allowed); `resolve_device`,
`choose_dtype` and `resolve_max_context_len` here (and the graph settings' resolvers in
`executor.graphs.settings`) turn the "auto" values into concrete ones on this machine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attention import BACKEND_NAMES as ATTENTION_BACKEND_NAMES
from executor.core import names
from executor.core.limits import BatchLimits
from executor.core.lora_types import parse_lora_setting
from executor.core.names import GraphMode, SeqLensPolicy

if TYPE_CHECKING:
    from executor.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The graph modes a running executor is in; `auto` is a start-up value only, resolved before
# the executor runs.
RUNTIME_GRAPH_MODES = tuple(m.value for m in GraphMode)  # none | decode | extend | both
GRAPH_MODES = ("auto", *RUNTIME_GRAPH_MODES)
NEEDS_CPU_SEQ_LENS_VALUES = tuple(p.value for p in SeqLensPolicy)  # auto | on | off
# What a captured graph is: a CUDA graph, an inductor-compiled callable (CPU), or the CPU
# stand-in that only checks CUDA's capture rules; `auto` = cuda on CUDA, compiled elsewhere.
GRAPH_BACKENDS = ("auto", *names.GRAPH_BACKENDS)
QUANTIZATION_MODES = ("auto", "none", "gguf", "int8", "int4")
# What `auto` resolves to and what a model is loaded with (executor.models.quant_kernel).
LOADED_QUANTIZATIONS = QUANTIZATION_MODES[1:]
# What the float linears run on (executor.models.packing).
LINEAR_KERNELS = ("auto", "onednn", "aten")
QUANT_KERNELS = ("auto", "qmm", "torch")
PIPELINE_STEPS = ("auto", "on", "off")
LM_HEAD_DTYPES = ("auto", "float32")


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def check_digest_setting(value: str) -> None:
    """ValueError unless `value` is \"\" or 64 lowercase hex digits."""
    if value and not _HEX64.match(value):
        raise ValueError(f"model_sha256 must be 64 lowercase hex digits (sha256), got {value!r}")


def setting(default: Any, help: str, *, repeat: bool = False) -> Any:
    """A config field with its help text (shown by --help and in docs/configuration.md);
    `repeat`: a list setting, its flag repeatable (the values joined by commas)."""
    return field(default=default, metadata={"help": help, "repeat": repeat})


@dataclass(frozen=True)
class ExecutorConfig:
    """What the executor is built from. Every field has a default a newcomer can run with.

    Each field is also a CLI flag (`--kv-slots`) and an environment variable
    (`MODEL_EXECUTOR_KV_SLOTS`); see :mod:`executor.service.settings`.
    """

    model: str = setting(
        "smollm2",
        "model: smollm2, a tiny-random config (tiny-random, tiny-random-<family>: executor/models/tiny_random.py), a .gguf file or a HF directory",
    )
    model_sha256: str = setting(
        "",
        "pinned sha256 of the model: a .gguf's bytes, or of a HF directory's sorted "
        "`sha256sum config.json *.safetensors*` lines; loading other files is refused; '' = "
        "not pinned",
    )
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = setting(
        "auto",
        "auto (bfloat16 on CUDA and on CPUs with AVX512-BF16/AMX, else float32) | float32 | "
        "bfloat16 | float16",
    )
    max_reqs: int = setting(128, "request rows: valid rows are 1..max_reqs")
    max_context_len: int = setting(
        0, "longest request in tokens; 0 = the model's context length, capped at 8192"
    )
    kv_slots: int = setting(65536, "KV cache slots: valid slots are 1..kv_slots")
    max_batch_size: int = setting(0, "most requests in one batch; 0 = max_reqs")
    max_tokens_per_batch: int = setting(8192, "most tokens in one batch (EXTEND chunks must fit)")
    attention_backend: str = setting(
        "auto",
        " | ".join(["auto (triton on CUDA, torch_paged on CPU)", *ATTENTION_BACKEND_NAMES[1:]]),
    )
    graph_mode: str = setting(
        "auto",
        "auto (both on CUDA, none on CPU, where a server compiles bs-1 DECODE graphs in the "
        "background; none with an attention backend that cannot be captured) | none | decode "
        "(full graphs) | extend (piecewise) | both; a runtime toggle too",
    )
    graph_backend: str = setting(
        "auto",
        "auto (cuda on CUDA, compiled on CPU) | cuda (CUDA graphs) | compiled (torch.compile, "
        "inductor: the layer halves, compiled once for every layer and bucket) | compiled_step "
        "(each DECODE bucket's whole step compiled on its own, attention and KV write "
        "included: one compiled call a step, the fastest CPU decode, but a compile per "
        "(batch size, KV bucket): pick few buckets; EXTEND pieces as compiled) | standin (the "
        "uncompiled CPU stand-in that checks CUDA's capture rules)",
    )
    graph_max_bs: int = setting(
        0,
        "largest DECODE batch with a captured graph; 0 = min(max_batch_size, 160), on CPU "
        "min(max_batch_size, 64)",
    )
    graph_batch_sizes: str = setting(
        "",
        "DECODE graph buckets, e.g. '1,2,4,8'; '' = 1,2,4,8 then every 8 up to graph_max_bs "
        "(on CPU: powers of two)",
    )
    piecewise_max_tokens: int = setting(
        0,
        "largest EXTEND token count with captured pieces; 0 = min(max_tokens_per_batch, 2048), "
        "on CPU min(max_tokens_per_batch, 1024)",
    )
    piecewise_token_sizes: str = setting(
        "",
        "piecewise token buckets, e.g. '16,64,256'; '' = the default ladder up to "
        "piecewise_max_tokens (on CPU: powers of two from 16)",
    )
    needs_cpu_seq_lens: str = setting(
        "auto",
        "auto (on when a backend or path needs the host copy of seq_lens) | on | off "
        "(refused when something needs it); a runtime toggle too",
    )
    cache_dir: str = setting(
        "",
        "where dequantized weights, tokenizers and compiled code are cached (inductor's and "
        "Triton's compile caches, the qmm kernel, whole compiled DECODE steps): a restart on "
        "the same directory loads instead of compiling; '' = ~/.cache/model-executor",
    )
    seed: int = setting(0, "seeds the draws of requests that bring no seed of their own")
    max_top_logprobs: int = setting(
        20,
        "most top_logprobs_num a batch may ask for (each request's answer grows by 12 bytes per "
        "entry; the send limit is derived from it); reported by GetInfo",
    )
    deferred_mask_timeout_s: float = setting(
        5.0,
        "how long sampling waits for a batch's deferred vocab mask (ForwardStream) before the "
        "batch fails DEADLINE_EXCEEDED; the device waits meanwhile; reported by GetInfo",
    )
    future_slots: int = setting(
        0,
        "size of the future-token table (overlap scheduling: input id -k reads the token a "
        "request sampled into future slot k); valid slots 1..future_slots; 0 = 4 * max_reqs; "
        "reported by GetInfo",
    )
    detailed_refusals: bool = setting(
        False,
        "name another request's row and position when a batch writes into a slot it holds "
        "(debugging a scheduler); off: the refusal says only that the slot is taken",
    )
    allow_input_embeds: bool = setting(
        False,
        "accept ForwardBatch.input_embeds (client-computed embeddings instead of token ids); "
        "off: such a batch is refused before it is decoded; reported by GetInfo",
    )
    allow_custom_positions: bool = setting(
        False,
        "accept explicit positions that differ from each token's index in its request "
        "(models with non-sequential positions, e.g. multimodal M-RoPE or position-id "
        "offsets for packed sequences, would need it); off: such a batch is refused",
    )
    quantization: str = setting(
        "auto",
        "auto (gguf for a GGUF file on a CPU where the qmm kernel loads or with native "
        "bfloat16 activations, else none) | "
        "none | gguf (run the GGUF's own Q4_0/Q4_1/Q8_0 blocks, the embedding and tied LM head "
        "included) | int8 (per-channel; CPU only: refused on CUDA) | int4 (group 32): int8/int4 "
        "quantize the decoder linears at load, the embedding and LM head stay float",
    )
    quant_kernel: str = setting(
        "auto",
        "auto | qmm | torch: what group-quantized linears (gguf, int4) run on; qmm is a CPU "
        "kernel built for this machine on first use (int8 activations times the stored 4- or "
        "8-bit weights, as llama.cpp computes), torch is torch's int4 kernels (bfloat16 "
        "activations); auto = torch for bfloat16 activations on a CPU with native bfloat16, "
        "else qmm where it builds and loads (x86-64, AVX2, a C compiler), else torch",
    )
    linear_kernel: str = setting(
        "auto",
        "auto | onednn | aten: what the float linears run on; onednn packs each weight once at "
        "load into oneDNN's blocked layout (CPU, float32; a tied LM head gets a packed copy), "
        "aten is F.linear; auto = onednn where it can run, else aten",
    )
    eager_input_no_copy: bool = setting(
        False,
        "run eager steps on the batch's own tensors instead of staging them through the eager "
        "input registry (saves one device copy per staged field per step); a runtime toggle too",
    )
    pipeline_steps: str = setting(
        "auto",
        "auto | on | off: admit and stage the next queued batch while a step runs on the "
        "device (launch, prepare the next, read); auto = on where the forward runs "
        "asynchronously (CUDA, simulated_step_ms), off on a CPU device, whose forward is "
        "synchronous (on there only reorders the host's work: for tests)",
    )
    lm_head_dtype: str = setting(
        "auto",
        "auto | float32: the dtype the LM head computes the logits in; auto = the model's "
        "dtype (the logits are float32 either way); float32 runs the head's matmul on float32 "
        "hidden states and weights on a bfloat16/float16 model (every path, a tied or "
        "vocabulary-sharded head too; a quantized head's kernel keeps its own precision)",
    )
    batch_invariant: bool = setting(
        False,
        "a row's logits (and so its logprobs and greedy tokens) bitwise the same whatever "
        "batch it runs in: other rows, batch size, how its prompt was chunked; linears run a "
        "fixed number of rows per GEMM call; attention on the CPU one query row per SDPA row "
        "over aligned key lengths, on CUDA the triton backend with its decode splits set by "
        "each request's own length; float weights, dense models; eager or graph steps alike "
        "(graphs run the eager kernels; graph_mode auto stays none); costs step time "
        "(docs/performance.md); reported by GetInfo",
    )
    simulated_step_ms: float = setting(
        0.0,
        "a stand-in accelerator, for measuring the pipeline (and testing a scheduler's) "
        "without a GPU: each step's device work takes this many ms after its launch, the host "
        "free meanwhile, and the model is replaced by a deterministic stand-in (next token = "
        "(31 * last input id + 7 * position + 11) mod vocab; README); 0 = off",
    )
    tp_size: int = setting(
        1,
        "tensor-parallel ranks (one device each; gloo on CPU, NCCL on CUDA): serve starts "
        "tp_size - 1 worker processes, or joins the group torchrun set up (RANK, WORLD_SIZE, "
        "MASTER_ADDR, MASTER_PORT)",
    )
    lora: str = setting(
        "",
        "LoRA adapters loaded at start-up, NAME=PATH (a PEFT adapter directory), repeatable "
        "(env and file: comma-separated); reported by GetInfo",
        repeat=True,
    )
    max_loras: int = setting(
        0,
        "LoRA adapter slots (adapters loaded at once; a batch may mix them all); 0 = one per "
        "--lora adapter (none: LoRA off, LoadLora refused); reported by GetInfo",
    )
    max_lora_rank: int = setting(
        16,
        "the largest LoRA rank a slot holds (a larger adapter is refused); a batch with "
        "adapter rows costs about max_loras x max_lora_rank columns per linear layer",
    )
    tp_timeout_s: int = setting(
        60,
        "tensor parallel: a collective waits this long for a rank before the group is declared "
        "failed (the server goes NOT_SERVING and exits non-zero); idle ranks are pinged every "
        "quarter of it. Ranks capture graphs in step, so it must exceed the largest gap between "
        "two ranks' start-up (CPU graph compiles can take minutes on a loaded machine)",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            expected = type(f.default)
            value = getattr(self, f.name)
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ValueError(f"{f.name} must be {expected.__name__}, got {value!r}")
        if self.model_sha256:
            check_digest_setting(self.model_sha256)
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        if not 0 <= self.simulated_step_ms <= 10_000:
            raise ValueError(f"simulated_step_ms must be in 0..10000, got {self.simulated_step_ms}")
        if not self.deferred_mask_timeout_s > 0:
            raise ValueError(
                f"deferred_mask_timeout_s must be > 0, got {self.deferred_mask_timeout_s}"
            )
        positive = ("max_reqs", "kv_slots", "max_tokens_per_batch", "tp_size", "tp_timeout_s")
        for name in (*positive, "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_context_len",
            "max_batch_size",
            "graph_max_bs",
            "piecewise_max_tokens",
            "max_top_logprobs",
            "future_slots",
            "max_loras",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = derived), got {getattr(self, name)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.graph_backend == "compiled_step" and self.tp_size > 1:
            raise ValueError(
                "graph_backend 'compiled_step' needs tp_size 1 (a whole step would hold the "
                "all-reduces, which run eagerly between compiled functions): use 'compiled', "
                f"got tp_size={self.tp_size}"
            )
        adapters = parse_lora_setting(self.lora)  # ValueError naming the entry
        if self.max_loras and len(adapters) > self.max_loras:
            raise ValueError(
                f"lora names {len(adapters)} adapters, more than max_loras={self.max_loras}"
            )

    def replace(self, **changes: Any) -> ExecutorConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ExecutorConfig(**values)


# The settings that take one of a list of values (ExecutorConfig.__post_init__ checks them).
_CHOICES: dict[str, tuple[str, ...]] = {
    "pipeline_steps": PIPELINE_STEPS,
    "lm_head_dtype": LM_HEAD_DTYPES,
    "attention_backend": tuple(ATTENTION_BACKEND_NAMES),
    "graph_mode": GRAPH_MODES,
    "graph_backend": GRAPH_BACKENDS,
    "needs_cpu_seq_lens": NEEDS_CPU_SEQ_LENS_VALUES,
    "linear_kernel": LINEAR_KERNELS,
    "quant_kernel": QUANT_KERNELS,
    "quantization": QUANTIZATION_MODES,
}


def batch_limits(
    config: ExecutorConfig,
    *,
    vocab_size: int,
    hidden_size: int,
    max_context_len: int,
    routes: tuple[tuple[int, ...], int] = ((), 0),
) -> BatchLimits:
    """The caps batches are checked against (and the wire's byte limits sized from);
    `routes`: the model's sparse MoE layers and their top-k (`models.moe`)."""
    return BatchLimits(
        max_reqs=config.max_reqs,
        kv_slots=config.kv_slots,
        max_context_len=max_context_len,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        max_batch_size=config.max_batch_size or config.max_reqs,
        max_tokens_per_batch=config.max_tokens_per_batch,
        max_top_logprobs=config.max_top_logprobs,
        future_slots=resolve_future_slots(config),
        allow_input_embeds=config.allow_input_embeds,
        routed_expert_layers=routes[0],
        routed_experts_top_k=routes[1],
    )


def resolve_max_loras(config: ExecutorConfig) -> int:
    """LoRA adapter slots: the configured number, or one per start-up adapter (0: off)."""
    return config.max_loras or len(parse_lora_setting(config.lora))


def resolve_future_slots(config: ExecutorConfig) -> int:
    """The future-token table's size: the configured one, or 4 slots per request row."""
    return config.future_slots or 4 * config.max_reqs


def resolve_device(config: ExecutorConfig, local_rank: int = 0) -> torch.device:
    """The device of this process. A CUDA device always names its index (`cuda` -> `cuda:0`),
    so the threads that make it current (ops.device_scope) and the streams agree on it; a
    tensor-parallel rank on CUDA takes the `local_rank`-th device from the configured one."""
    if config.device == "auto":
        return (
            torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        )
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (
            f" (CUDA {torch.version.cuda}) sees no GPU: check the pod's GPU limit, its runtime "
            "class and CUDA_VISIBLE_DEVICES"
            if torch.version.cuda
            else " is a CPU-only build"
        )
        raise ValueError(
            f"device {config.device!r} was asked for but CUDA is not available: {build}"
        )
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = (0 if device.index is None else device.index) + local_rank
        if index >= count:
            raise ValueError(
                f"device {config.device!r}"
                + (f" (tensor-parallel rank {local_rank})" if local_rank else "")
                + f": this machine has {count} CUDA device(s) (0..{count - 1})"
            )
        return torch.device("cuda", index)
    return device


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # why `auto` chose it (or "configured")


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: the CPUs where bfloat16 matmuls are not emulated (slower than
    float32 elsewhere: docs/choices.md)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def choose_dtype(config: ExecutorConfig, device: torch.device) -> DtypeChoice:
    if config.dtype != "auto":
        return DtypeChoice(DTYPES[config.dtype], "configured")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "auto: CUDA")
    if cpu_has_native_bf16():
        return DtypeChoice(torch.bfloat16, "auto: the CPU has native bfloat16 (AVX512-BF16/AMX)")
    return DtypeChoice(
        torch.float32,
        "auto: the CPU has no native bfloat16 (no AVX512-BF16/AMX), float32 is faster",
    )


DEFAULT_MAX_CONTEXT_LEN = 8192


def resolve_max_context_len(config: ExecutorConfig, model: ModelConfig) -> int:
    """The configured context length, or the model's own capped at DEFAULT_MAX_CONTEXT_LEN."""
    return config.max_context_len or min(model.max_position_embeddings, DEFAULT_MAX_CONTEXT_LEN)


def resolve_cache_dir(config: ExecutorConfig) -> Path:
    if config.cache_dir:
        return Path(config.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "model-executor"
