"""The in-process executor: owns the model, the KV cache and the device; runs one batch per call.

`ModelExecutor.forward(batch)` is the whole step a remote scheduler asks for:
validate (nothing changes if the batch is refused), complete the derived fields, write the
row table, run the model, sample, and undo the row-table write if anything after it fails.
It is not thread-safe: one thread owns the device (the gRPC server's worker).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import structlog
import torch

import executor
from attention import AttentionLayout, create_backend, decide_needs_cpu_seq_lens
from executor.batch_prep import complete_batch
from executor.config import ExecutorConfig, resolve_cache_dir, resolve_device, resolve_dtype
from executor.forward_batch import ForwardBatch
from executor.kv_cache import KVPool, ReqToTokenPool
from executor.model_runner import ModelRunner
from executor.models.loader import LoadedModel, load_model
from executor.sampling import Sampler
from executor.tokenizer import Tokenizer, load_tokenizer
from executor.validation import BatchLimits, validate_batch
from ops.host_transfer import to_host

log = structlog.get_logger(__name__)

DEFAULT_MAX_CONTEXT_LEN = 8192


@dataclass
class StepStats:
    """What one step did and cost (timings in nanoseconds)."""

    path: str
    batch_size: int
    padded_batch_size: int
    num_tokens: int
    padded_num_tokens: int
    timings_ns: dict[str, int] = field(default_factory=dict)


@dataclass
class ForwardOutput:
    """Host tensors, one entry per request of the batch."""

    next_token_ids: torch.Tensor  # [bs] int64
    stats: StepStats
    next_token_logprobs: torch.Tensor | None = None  # [bs] float32
    top_logprob_ids: torch.Tensor | None = None  # [bs, k] int64
    top_logprobs: torch.Tensor | None = None  # [bs, k] float32
    logits: torch.Tensor | None = None  # [bs, vocab] float32, in-process callers only


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


class ModelExecutor:
    def __init__(self, config: ExecutorConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        max_context_len = config.max_context_len or DEFAULT_MAX_CONTEXT_LEN
        if loaded is None:
            loaded = load_model(
                config.model,
                device=self.device,
                dtype=self.dtype,
                max_positions=max_context_len,
                cache_dir=resolve_cache_dir(config),
            )
        self.loaded = loaded
        self.model = loaded.model
        mcfg = loaded.config
        if not config.max_context_len:
            max_context_len = min(mcfg.max_position_embeddings, DEFAULT_MAX_CONTEXT_LEN)
        if max_context_len > self.model.max_positions:
            raise ValueError(
                f"max_context_len ({max_context_len}) exceeds the model's rotary table ({self.model.max_positions})"
            )
        self.limits = BatchLimits(
            max_reqs=config.max_reqs,
            kv_slots=config.kv_slots,
            max_context_len=max_context_len,
            vocab_size=mcfg.vocab_size,
            hidden_size=mcfg.hidden_size,
            max_batch_size=config.max_batch_size or config.max_reqs,
            max_tokens_per_batch=config.max_tokens_per_batch,
        )
        self.req_to_token_pool = ReqToTokenPool(config.max_reqs, max_context_len, self.device)
        self.kv_pool = KVPool(
            config.kv_slots,
            mcfg.num_layers,
            mcfg.num_kv_heads,
            mcfg.head_dim,
            self.dtype,
            self.device,
        )
        layout = AttentionLayout(
            mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim, mcfg.attention_scaling
        )
        self.attn_backend = create_backend(
            config.attention_backend,
            layout=layout,
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            device=self.device,
        )
        # Raises (start-up) if config.needs_cpu_seq_lens=off contradicts a backend or path.
        self.needs_cpu_seq_lens = decide_needs_cpu_seq_lens(config, [self.attn_backend])
        self.runner = ModelRunner(self.model, self.attn_backend)
        self.sampler = Sampler(self.device, config.seed)
        # Wraps the device part of every step (device move, model, sampling). Tests install
        # ops.host_read_guard.HostReadGuard here to prove every host read there is counted.
        self.device_step_guard: Callable[[], AbstractContextManager[object]] = nullcontext
        log.info(
            "executor ready",
            model=mcfg.name,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.attn_backend.name,
            needs_cpu_seq_lens=self.needs_cpu_seq_lens,
            max_reqs=config.max_reqs,
            kv_slots=config.kv_slots,
            max_context_len=max_context_len,
            kv_cache_mib=round(self.kv_pool.nbytes / 2**20, 1),
        )

    @property
    def info(self) -> ExecutorInfo:
        mcfg = self.loaded.config
        return ExecutorInfo(
            model_name=mcfg.name,
            architecture=mcfg.architecture,
            vocab_size=mcfg.vocab_size,
            hidden_size=mcfg.hidden_size,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            limits=self.limits,
            eos_token_ids=mcfg.eos_token_ids,
            bos_token_id=mcfg.bos_token_id,
            attention_backend=self.attn_backend.name,
            version=executor.__version__,
        )

    def load_tokenizer(self) -> Tokenizer:
        """The model's own tokenizer (the executor itself works on token ids only)."""
        mcfg = self.loaded.config
        return load_tokenizer(
            self.loaded.source,
            mcfg.vocab_size,
            mcfg.bos_token_id,
            mcfg.eos_token_ids,
            resolve_cache_dir(self.config),
        )

    def validate(self, batch: ForwardBatch) -> None:
        """Raise BatchValidationError if the batch breaks a rule; changes nothing."""
        validate_batch(batch, self.limits, self.req_to_token_pool.resident_lens)

    def forward(self, batch: ForwardBatch, *, return_logits: bool = False) -> ForwardOutput:
        """Run one step. A refused or failed batch leaves the row table as it was.

        `return_logits` adds each request's last-token logits (a host copy) to the output.
        """
        t0 = time.perf_counter_ns()
        self.validate(batch)
        host = complete_batch(
            batch,
            needs_cpu_seq_lens=self.needs_cpu_seq_lens,
            max_context_len=self.limits.max_context_len,
        )
        assert host.sampling is not None
        plan = self.sampler.plan(host.sampling)
        t1 = time.perf_counter_ns()
        write = (
            self.req_to_token_pool.write_batch(host) if not host.forward_mode.is_idle() else None
        )
        try:
            with self.device_step_guard():
                fb = host.to(self.device)
                t2 = time.perf_counter_ns()
                out = self.runner.forward(fb)
                t3 = time.perf_counter_ns()
                assert fb.sampling is not None
                sample = self.sampler.sample(
                    out.logits,
                    plan,
                    fb.sampling,
                    fb.seq_lens,
                    return_logprob=host.return_logprob,
                    top_logprobs_num=host.top_logprobs_num,
                )
                logits = to_host(out.logits, "logits") if return_logits else None
        except BaseException:
            if write is not None:
                self.req_to_token_pool.undo(write)
            raise
        t4 = time.perf_counter_ns()
        stats = StepStats(
            path=out.path,
            batch_size=host.batch_size,
            padded_batch_size=out.padded_batch_size,
            num_tokens=host.num_tokens,
            padded_num_tokens=out.padded_num_tokens,
            timings_ns={
                "validate": t1 - t0,
                "stage": t2 - t1,
                "forward": t3 - t2,
                "sample": t4 - t3,
                "total": t4 - t0,
            },
        )
        return ForwardOutput(
            next_token_ids=sample.next_token_ids,
            stats=stats,
            next_token_logprobs=sample.next_token_logprobs,
            top_logprob_ids=sample.top_logprob_ids,
            top_logprobs=sample.top_logprobs,
            logits=logits,
        )
