"""The in-process executor: owns the model, the KV cache and the device; runs one batch per call.

`ModelExecutor` builds the pieces once (model, limits, row table and KV pool, future-token
table, attention backend, runner) and hands batches to :class:`executor.step.Step`.
Runtime toggles live in `toggles` (:class:`executor.core.toggles.Toggles`) and change only
through `control` (:class:`executor.step.graph_control.GraphControl`), on the thread that runs
the steps, between two of them. Not thread-safe: one thread (the server's worker) owns it.

Tensor parallel (`comm` of size > 1, `executor.parallel`): every rank builds its own
`ModelExecutor` over its shard. Rank 0 admits each batch, broadcasts it (`TpLeader`) and
runs it; the other ranks run `run_shard` on what they receive (`executor.tp_worker`),
so every rank runs the same path, row table included. Rank 0 samples from the gathered
logits. Runtime toggles are broadcast the same way.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from dataclasses import replace

import structlog
import torch

import executor
from attention import create_backend, decide_needs_cpu_seq_lens
from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.config import (
    ExecutorConfig,
    batch_limits,
    resolve_cache_dir,
    resolve_device,
    resolve_max_context_len,
    resolve_max_loras,
)
from executor.controls.step_controls import CONTROL_NAMES
from executor.core.clock import StepClock
from executor.core.errors import LoraStateError, TestHooks
from executor.core.forward_batch import ForwardBatch
from executor.core.lora_types import LoadedAdapter, LoraInfo, parse_lora_setting
from executor.core.names import GraphMode, SeqLensPolicy
from executor.core.observer import ExecutorObserver, NullObserver
from executor.core.outputs import ForwardOutput
from executor.core.step_batch import StepBatch
from executor.core.toggles import Toggles
from executor.future_tokens import FutureTokenTable
from executor.graphs.compile_cache import use_compile_caches
from executor.graphs.settings import (
    check_graph_mode,
    graph_settings,
    resolve_graph_backend,
    resolve_graph_mode,
)
from executor.info import ExecutorInfo, log_ready, start_up_choices
from executor.kv_cache import KVPool, ReqToTokenPool
from executor.lora.adapters import LoraAdapters
from executor.model_runner import ModelRunner
from executor.models.batch_invariance import apply_batch_invariance
from executor.models.decoder_model import DecoderModel
from executor.models.loader import LoadedModel, load_model, load_served_model
from executor.models.moe import routed_expert_layout
from executor.models.standin import StandIn
from executor.models.tokenizer import Tokenizer, load_tokenizer
from executor.parallel.comm import TpComm
from executor.parallel.leader import TpLeader
from executor.step.assembly import assemble_step
from executor.step.graph_control import GraphControl
from executor.weights.control import WeightsControl
from executor.weights.memory import TaggedMemory
from ops import host_kernels
from ops.device_scope import device_scope, on_own_device

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
        compile_only: bool = False,
    ) -> None:
        """`stop`, when set by the host (a shutdown during start-up), ends graph capture at
        the next bucket with StartupCancelled. `comm`: this rank's tensor-parallel group
        (required when `config.tp_size` > 1; `executor.parallel.group.init_comm`).
        `compile_only`: an executor that only compiles graphs for another process (the
        compile worker): its KV cache is allocated, never written; it captures nothing."""
        self.config = config
        self.comm = comm or TpComm()
        if self.comm.size != config.tp_size:
            raise ValueError(
                f"tp_size={config.tp_size} needs a process group of that size "
                f"(got {self.comm.size}); start it with `serve` or torchrun"
            )
        self.observer: ExecutorObserver = observer or NullObserver()  # captures, fallbacks
        self.device = resolve_device(config, local_rank)
        # Every entry point makes the device current on the calling thread (loader, device
        # worker, runtime captures): CUDA launches and streams follow the current device.
        with device_scope(self.device):
            self._init_on_device(config, loaded, stop, compile_only)

    def _init_on_device(
        self,
        config: ExecutorConfig,
        loaded: LoadedModel | None,
        stop: threading.Event | None,
        compile_only: bool,
    ) -> None:
        # Inductor's, Triton's and the kernels' compiled code live under the cache dir, set
        # before anything here can compile (the qmm kernel at load, graphs at capture).
        use_compile_caches(resolve_cache_dir(config))
        # Admission's and staging's host kernels (without them: the Python paths, slower).
        kernel = host_kernels.load(resolve_cache_dir(config))
        if isinstance(kernel, str):
            log.warning("host index kernels unavailable; admission runs in Python", reason=kernel)
        served = load_served_model(config, self.device, self.comm, loaded)
        self.loaded = loaded = served.loaded
        self.dtype = served.dtype.dtype
        self.choices = start_up_choices(config, self.device, served)
        # The device thread prepares the next batch while a step runs (device_worker).
        self.pipelines = self.choices[-1].value == "on"
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
            # The stand-in accelerator runs no model, so it routes nothing.
            routes=((), 0) if config.simulated_step_ms else routed_expert_layout(self.model),
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
            zeroed=not compile_only,
        )
        layout = mcfg.attention_layout(plan.num_heads, plan.num_kv_heads)
        self.attn_backend = create_backend(
            config.attention_backend,
            layout=layout,
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            device=self.device,
        )
        apply_batch_invariance(config, self.model, self.attn_backend)  # before any step runs
        # LoRA: the adapter slots, beside the model's linears before any graph is captured.
        slots = resolve_max_loras(config)
        self.lora: LoraAdapters | None = None
        if slots:
            self.lora = LoraAdapters(
                self.model,
                slots=slots,
                max_rank=config.max_lora_rank,
                max_reqs=config.max_reqs,
                comm=self.comm,
                lock=threading.Lock(),  # the step lock, once `control` exists
            )
        # The runtime toggles start from the config; `control` changes them between steps.
        refusal = self.attn_backend.graph_capture_refusal()
        check_graph_mode(config, self.attn_backend.name, refusal)
        graph_mode = GraphMode(resolve_graph_mode(config, self.device, refusal))
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
            standin=StandIn(mcfg.vocab_size, mcfg.hidden_size, self.dtype, self.future.tokens)
            if config.simulated_step_ms
            else None,
        )
        self.kv_pool.commit_pages(self.runner.idle_gate.yielding)  # CPU: between steps
        self.control = GraphControl(
            self.toggles,
            self.runner,
            self.attn_backend,
            config=config,
            device=self.device,
            observer=self.observer,
            comm=self.comm,
        )
        memory = TaggedMemory(self.model, self.kv_pool, self.device)
        if not compile_only:  # on every rank, in the same order (captures run collectives)
            if self.lora is not None:
                self.lora.lock = self.control.step_lock
                for name, path in parse_lora_setting(config.lora):  # every rank reads its cut
                    self.lora.load(name, path)
            memory.own_pools()  # CUDA: before any graph captures the memory's addresses
            self.control.start()
        self.hooks = TestHooks()
        parts = assemble_step(
            config,
            self.limits,
            model=self.model,
            device=self.device,
            pool=self.req_to_token_pool,
            future=self.future,
            lora=self.lora,
            runner=self.runner,
            toggles=self.toggles,
            hooks=self.hooks,
            comm=self.comm,
            observer=self.observer,
            lock=self.control.step_lock,
            kv_pool=self.kv_pool,
            max_context_len=max_context_len,
        )
        self.controls, self.features, self.step = parts.controls, parts.features, parts.step
        self.kv_transfer = parts.kv_transfer  # the KV data plane (KV calls) over the same pools
        # Weights and memory changed while serving, between two steps (executor.weights).
        self.weights = WeightsControl(
            model=self.model,
            memory=memory,
            runner=self.runner,
            toggles=self.toggles,
            comm=self.comm,
            device=self.device,
            dtype=self.dtype,
            step_lock=self.control.step_lock,
            reload=self._reload_model,
            empty_rows=self._empty_rows,
            on_version=self._set_weight_version,
        )
        self.step.weight_version = self.weights.version
        self.kv_transfer.guard = self.weights.check_serving
        self.control.memory_guard = self.weights.check_serving
        self.leader: TpLeader | None = None
        if self.comm.enabled and self.comm.rank == 0:
            # Rank 0 of a group: broadcasts every step and toggle from now on, pings idle workers.
            self.leader = TpLeader(self.comm, heartbeat_s=config.tp_timeout_s / 4)
            self.control.leader = self.step.leader = self.kv_transfer.leader = self.leader
            self.weights.leader = self.leader
            if self.lora is not None:
                self.lora.leader = self.leader
            self.future.keep_host_mirror()
        log_ready(
            self.info,
            tp_rank=self.comm.rank,
            needs_cpu_seq_lens=self.toggles.needs_cpu_seq_lens,
            kv_cache_mib=round(self.kv_pool.nbytes / 2**20, 1),
            eager_input_no_copy=config.eager_input_no_copy,
            graph_mode=str(graph_mode),
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
            lora=self.lora.info() if self.lora is not None else LoraInfo(),
            choices=(*self.choices, *self.control.choices()),
            weight_version=self.weights.version,
            memory=self.weights.report(),
            weight_update_max_tensors=self.weights.catalog.max_tensors,
            weight_update_max_bytes=self.weights.catalog.max_bytes,
        )

    @on_own_device
    def warmup(self) -> None:
        """One EXTEND and one DECODE step on the reserved row 0 and slot 0 (zeros, the padding
        sink): no state a scheduler can see. It bypasses validation, which (rightly) refuses
        row 0, and undoes its row-table writes."""
        n = 8
        zeros = [0] * n
        for batch in (
            make_extend_batch(input_ids=[zeros], req_pool_indices=[0], out_cache_loc=[zeros]),
            make_decode_batch(
                input_ids=[0], req_pool_indices=[0], seq_lens=[n + 1], out_cache_loc=[0]
            ),
        ):
            self.step.warm(batch)

    @on_own_device
    def load_lora(self, name: str, path: str) -> LoadedAdapter:
        """Load the PEFT adapter at `path` as `name` into a free slot (between two steps; the
        server reads the files on its RPC thread first). Refused with nothing changed:
        LoraAdapterError (it does not fit), LoraStateError (LoRA off, the name, the slots)."""
        return self.lora_adapters().load(name, path)

    @on_own_device
    def unload_lora(self, name: str) -> LoadedAdapter:
        """Free adapter `name`'s slot; refused (LoraStateError) while live rows use it."""
        return self.lora_adapters().unload(name)

    def lora_adapters(self) -> LoraAdapters:
        if self.lora is None:
            raise LoraStateError("LoRA is off on this executor (start it with max_loras > 0)")
        return self.lora

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
        self.weights.check_serving()  # released memory: refused, nothing changes
        return self.step.forward(
            batch, StepClock() if clock is None else clock, return_logits=return_logits
        )

    def _set_weight_version(self, version: str) -> None:
        self.step.weight_version = version  # under the step lock: between two steps

    def _reload_model(self) -> DecoderModel:
        """The model file's weights in the served form (ResumeMemory of `weights`)."""
        loaded = load_model(
            self.loaded.source.spec,
            device=self.device,
            dtype=self.dtype,
            max_positions=self.model.max_positions,
            cache_dir=resolve_cache_dir(self.config),
            quantization=self.loaded.quantization,
            comm=self.comm,
            linear_kernel=self.loaded.linear_kernel,
            quant_kernel=self.loaded.quant_kernel,
        )
        return loaded.model

    def _empty_rows(self) -> None:
        """Release every row, as a batch releases them (ResumeMemory of `kv_cache`)."""
        rows = torch.arange(1, self.limits.max_reqs + 1, dtype=torch.int64)
        batch = replace(make_idle_batch(), released_req_pool_indices=rows)
        self.step.forward(batch, StepClock())

    # The step in halves, for the device thread's pipeline (`executor.service.device_worker`):
    # prepare N+1 between N's launch and N's read.
    @on_own_device
    def prepare(self, batch: ForwardBatch, clock: StepClock) -> StepBatch:
        """Admit and stage a batch (every refusal first; its state changes applied)."""
        self.weights.check_serving()  # released memory: refused, nothing changes
        sb = self.step.admit(batch, clock)
        self.step.stage(sb)
        return sb

    @on_own_device
    def launch(self, sb: StepBatch) -> None:
        self.step.launch(sb)

    @on_own_device
    def finish(self, sb: StepBatch) -> ForwardOutput:
        """Read a launched step: its answer (undone if the read fails)."""
        return self.step.read(sb)

    @on_own_device
    def undo(self, sb: StepBatch) -> None:
        """Undo a staged step that will not launch (the step before it failed)."""
        self.step.undo(sb)

    @property
    def step_lock(self) -> AbstractContextManager[bool]:
        """Held over a whole step (a background capture's buckets wait for it, re-entrant)."""
        return self.control.step_lock

    @property
    def launches_ahead(self) -> bool:
        """Whether a batch prepared while a step runs is launched behind it before that step
        is read (not under tensor parallelism: the group runs one step at a time)."""
        return self.pipelines and self.leader is None

    def seconds_to_ready(self, sb: StepBatch) -> float:
        """How long before a launched step's results can be read (0: now)."""
        return self.step.timeline.seconds_to_ready(sb.launched())

    @on_own_device
    def run_shard(self, host: ForwardBatch, *, keep_rows: bool) -> None:
        """A worker rank: run a step rank 0 admitted and broadcast."""
        self.step.run_shard(host, keep_rows=keep_rows)

    def close(self) -> None:
        """Rank 0 of a group: stop the heartbeat and tell the workers to stop (a no-op
        otherwise). Call once no step can run any more."""
        if self.leader is not None:
            self.leader.close()
