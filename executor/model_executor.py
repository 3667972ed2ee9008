"""The in-process executor: owns the model, the KV cache and the device; runs one batch per call.

`ModelExecutor` builds the pieces once (model, limits, row table and KV pool, future-token
table, attention backend, runner) and hands batches to :class:`executor.step.Step`.
Runtime toggles live in `toggles` (:class:`executor.core.toggles.Toggles`) and change only
through `control` (:class:`executor.step.graph_control.GraphControl`), on the thread that runs
the steps, between two of them. Not thread-safe: one thread owns the device (the gRPC
server's worker).

Tensor parallel (`comm` of size > 1, `executor.parallel`): every rank builds its own
`ModelExecutor` over its shard. Rank 0 admits each batch, broadcasts it (`TpLeader`) and
runs it; the other ranks run `run_shard` on what they receive (`executor.tp_worker`),
so every rank runs the same path, row table included. Rank 0 samples from the gathered
logits. Runtime toggles are broadcast the same way.
"""

from __future__ import annotations

import threading

import structlog

import executor
from attention import create_backend, decide_needs_cpu_seq_lens
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import (
    DEFAULT_MAX_CONTEXT_LEN,
    ExecutorConfig,
    batch_limits,
    choose_dtype,
    resolve_cache_dir,
    resolve_device,
    resolve_graph_backend,
    resolve_graph_mode,
    resolve_max_context_len,
)
from executor.controls.step_controls import CONTROL_NAMES, StepControls
from executor.core.errors import TestHooks
from executor.core.forward_batch import ForwardBatch
from executor.core.names import GraphMode, SeqLensPolicy
from executor.core.observer import ExecutorObserver, NullObserver
from executor.core.outputs import ForwardOutput
from executor.core.toggles import Toggles
from executor.future_tokens import FutureTokenTable
from executor.graphs.settings import graph_settings
from executor.info import ExecutorInfo, SettingChoice
from executor.kv_cache import KVPool, ReqToTokenPool
from executor.kv_transfer.engine import KVTransfer
from executor.kv_transfer.layout import KVLayout, KVTransferLimits
from executor.model_runner import ModelRunner
from executor.models.loader import LoadedModel, load_model, resolve_quantization
from executor.models.tokenizer import Tokenizer, load_tokenizer
from executor.parallel.comm import TpComm
from executor.parallel.leader import TpLeader
from executor.sampling import Sampler
from executor.step.clock import StepClock
from executor.step.graph_control import GraphControl
from executor.step.step import Step
from ops import host_kernels
from ops.device_scope import device_scope, on_own_device
from ops.h2d_staging import H2DStaging

log = structlog.get_logger(__name__)


class ModelExecutor:
    """The model, its KV cache and the device, and the step that runs batches on them."""

    def __init__(
        self,
        config: ExecutorConfig,
        loaded: LoadedModel | None = None,
        *,
        observer: ExecutorObserver | None = None,
        stop: threading.Event | None = None,
        comm: TpComm | None = None,
        local_rank: int = 0,
    ) -> None:
        """`stop`, when set by the host (a shutdown during start-up), ends graph capture at
        the next bucket with StartupCancelled. `comm`: this rank's tensor-parallel group
        (required when `config.tp_size` > 1; `executor.parallel.group.init_comm`)."""
        self.config = config
        self.comm = comm or TpComm()
        if self.comm.size != config.tp_size:
            raise ValueError(
                f"tp_size={config.tp_size} needs a process group of that size "
                f"(got {self.comm.size}); start it with `serve` or torchrun"
            )
        # Told about graph captures and fallbacks (the server's metrics; a no-op in-process).
        self.observer: ExecutorObserver = observer or NullObserver()
        self.device = resolve_device(config, local_rank)
        # Every entry point makes the device current on the calling thread (loader, device
        # worker, runtime captures): CUDA launches and streams follow the current device.
        with device_scope(self.device):
            self._init_on_device(config, loaded, stop)

    def _init_on_device(
        self, config: ExecutorConfig, loaded: LoadedModel | None, stop: threading.Event | None
    ) -> None:
        # Admission's and staging's host kernels: built on first use; without them every
        # step takes the (complete, slower) Python path.
        kernel = host_kernels.load(resolve_cache_dir(config))
        if isinstance(kernel, str):
            log.warning("host index kernels unavailable; admission runs in Python", reason=kernel)
        dtype_choice = choose_dtype(config, self.device)
        self.dtype = dtype_choice.dtype
        log.info(
            "dtype chosen", dtype=str(self.dtype).removeprefix("torch."), reason=dtype_choice.reason
        )
        quantization, why = resolve_quantization(config)
        if loaded is not None:
            why = "the caller's loaded model"
        if loaded is None:
            loaded = load_model(
                config.model,
                device=self.device,
                dtype=self.dtype,
                max_positions=config.max_context_len or DEFAULT_MAX_CONTEXT_LEN,
                cache_dir=resolve_cache_dir(config),
                quantization=quantization,
                comm=self.comm,
                linear_kernel=config.linear_kernel,
                quant_kernel=config.quant_kernel,
                sha256=config.model_sha256,
            )
        self.loaded = loaded
        self.choices = (
            SettingChoice(
                "device", str(self.device), "configured" if config.device != "auto" else "auto"
            ),
            SettingChoice("dtype", str(self.dtype).removeprefix("torch."), dtype_choice.reason),
            SettingChoice("quantization", loaded.quantization, why),
            SettingChoice("quant_kernel", loaded.quant_kernel, loaded.quant_kernel_reason),
            SettingChoice("linear_kernel", loaded.linear_kernel, loaded.linear_kernel_reason),
        )
        self.model = loaded.model
        mcfg = loaded.config
        max_context_len = resolve_max_context_len(config, mcfg)
        if max_context_len > self.model.max_positions:
            raise ValueError(
                f"max_context_len ({max_context_len}) exceeds the model's rotary table ({self.model.max_positions})"
            )
        self.limits = batch_limits(
            config,
            vocab_size=mcfg.vocab_size,
            hidden_size=mcfg.hidden_size,
            max_context_len=max_context_len,
        )
        self.req_to_token_pool = ReqToTokenPool(
            config.max_reqs,
            max_context_len,
            self.device,
            kv_slots=config.kv_slots,
            detailed_refusals=config.detailed_refusals,
        )
        self.future = FutureTokenTable(self.limits.future_slots, self.device)
        plan = self.model.plan  # this rank's heads (all of them at tp_size 1)
        self.kv_pool = KVPool(
            config.kv_slots,
            mcfg.num_layers,
            plan.num_kv_heads,
            mcfg.head_dim,
            self.dtype,
            self.device,
        )
        layout = mcfg.attention_layout(plan.num_heads, plan.num_kv_heads)
        self.attn_backend = create_backend(
            config.attention_backend,
            layout=layout,
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            device=self.device,
        )
        # The runtime toggles start from the config; `control` changes them between steps.
        graph_mode = GraphMode(resolve_graph_mode(config, self.device))
        policy = SeqLensPolicy(config.needs_cpu_seq_lens)
        self.toggles = Toggles(
            graph_mode=graph_mode,
            seq_lens_policy=policy,
            # Raises ValueError (start-up) if needs_cpu_seq_lens=off contradicts a backend or path.
            needs_cpu_seq_lens=decide_needs_cpu_seq_lens(
                policy, [self.attn_backend], piecewise_mode=graph_mode.piecewise_mode
            ),
            eager_input_no_copy=config.eager_input_no_copy,
        )
        self.runner = ModelRunner(
            self.model,
            self.attn_backend,
            device=self.device,
            toggles=self.toggles,
            graphs=graph_settings(config, self.limits, self.device),
            graph_backend=resolve_graph_backend(config, self.device),
            cache_dir=resolve_cache_dir(config),
            stop=stop,
            future_tokens=self.future.tokens,
        )
        self.control = GraphControl(
            self.toggles,
            self.runner,
            self.attn_backend,
            config=config,
            device=self.device,
            observer=self.observer,
            comm=self.comm,
        )
        self.control.start()  # on every rank, in the same order (captures run collectives)
        self.hooks = TestHooks()
        self.step = Step(
            limits=self.limits,
            allow_custom_positions=config.allow_custom_positions,
            pool=self.req_to_token_pool,
            future=self.future,
            runner=self.runner,
            sampler=Sampler(self.device, config.seed),
            staging=H2DStaging(self.device),
            controls=StepControls(
                self.limits,
                mcfg.eos_token_ids,
                self.device,
                deferred_mask_timeout_s=config.deferred_mask_timeout_s,
            ),
            toggles=self.toggles,
            hooks=self.hooks,
            comm=self.comm,
            observer=self.observer,
            lock=self.control.step_lock,
        )
        # The KV data plane: this rank's heads of a request's K/V, out of and into the pool.
        self.kv_transfer = KVTransfer(
            self.req_to_token_pool,
            self.kv_pool,
            self.step.controls.slot_tokens,
            KVLayout(
                num_layers=mcfg.num_layers,
                kv_heads=plan.num_kv_heads,
                kv_heads_total=mcfg.num_kv_heads,
                head_dim=mcfg.head_dim,
                dtype=self.dtype,
                kv_slots=config.kv_slots,
                tp_size=self.comm.size,
            ),
            KVTransferLimits(max_slots=max_context_len, max_runs=max_context_len),
            self.control.step_lock,
            comm=self.comm,
        )
        self.leader: TpLeader | None = None
        if self.comm.enabled and self.comm.rank == 0:
            # Rank 0 of a group: broadcasts every step and toggle from now on, pings idle workers.
            self.leader = TpLeader(self.comm, heartbeat_s=config.tp_timeout_s / 4)
            self.control.leader = self.step.leader = self.kv_transfer.leader = self.leader
            self.future.keep_host_mirror()
        log.info(
            "executor ready",
            model=mcfg.name,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.loaded.quantization,
            linear_kernel=self.loaded.linear_kernel,
            weight_mib=round(self.loaded.weight_bytes / 2**20, 1),
            attention_backend=self.attn_backend.name,
            needs_cpu_seq_lens=self.toggles.needs_cpu_seq_lens,
            max_reqs=config.max_reqs,
            kv_slots=config.kv_slots,
            max_context_len=max_context_len,
            kv_cache_mib=round(self.kv_pool.nbytes / 2**20, 1),
            eager_input_no_copy=config.eager_input_no_copy,
            graph_mode=str(graph_mode),
            tp_rank=self.comm.rank,
            tp_size=self.comm.size,
        )
        for choice in (*self.choices, *self.control.choices()):
            log.info(
                "setting chosen", setting=choice.setting, value=choice.value, reason=choice.reason
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
            quantization=self.loaded.quantization,
            linear_kernel=self.loaded.linear_kernel,
            weight_bytes=self.loaded.weight_bytes,
            graph_capture_disabled=self.runner.graph_factory.poisoned or "",
            tp_size=self.comm.size,
            sampling_controls=CONTROL_NAMES,
            deferred_mask_timeout_ms=round(self.config.deferred_mask_timeout_s * 1000),
            kv_layout=self.kv_transfer.layout,
            kv_transfer_limits=self.kv_transfer.limits,
            choices=(*self.choices, *self.control.choices()),
        )

    @on_own_device
    def warmup(self) -> None:
        """Run one EXTEND and one DECODE step on the reserved row 0 and slot 0.

        Row 0 holds only zeros and slot 0 is the padding sink, so the warm-up touches no
        state a scheduler can see; it bypasses validation, which (rightly) refuses row 0, and
        undoes its row-table writes.
        """
        n = 8
        zeros = [0] * n
        for batch in (
            make_extend_batch(input_ids=[zeros], req_pool_indices=[0], out_cache_loc=[zeros]),
            make_decode_batch(
                input_ids=[0], req_pool_indices=[0], seq_lens=[n + 1], out_cache_loc=[0]
            ),
        ):
            with self.control.step_lock:
                admitted = self.step.complete(batch)
                self.step.run(admitted, StepClock(), return_logits=False, keep_rows=False)

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

    @on_own_device
    def forward(
        self,
        batch: ForwardBatch,
        *,
        return_logits: bool = False,
        clock: StepClock | None = None,
    ) -> ForwardOutput:
        """Run one step (:meth:`executor.step.Step.forward`). A refused or failed batch
        leaves the executor as it was.

        `return_logits` adds each request's last-token logits (a host copy) to the output;
        `clock` times the phases (the device worker passes one holding the queue wait).
        """
        return self.step.forward(
            batch, StepClock() if clock is None else clock, return_logits=return_logits
        )

    @on_own_device
    def run_shard(self, host: ForwardBatch, *, keep_rows: bool) -> None:
        """A worker rank: run a step rank 0 admitted and broadcast."""
        self.step.run_shard(host, keep_rows=keep_rows)

    def close(self) -> None:
        """Rank 0 of a group: stop the heartbeat and tell the workers to stop (a no-op
        otherwise). Call once no step can run any more."""
        if self.leader is not None:
            self.leader.close()
