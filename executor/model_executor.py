"""The in-process executor: owns the model, the KV cache and the device; runs one batch per call.

`ModelExecutor.forward(batch)` is the whole step a remote scheduler asks for:
validate (nothing changes if the batch is refused), complete the derived fields, write the
row table, run the model, sample, and undo the row-table write if anything after it fails.
It is not thread-safe: one thread owns the device (the gRPC server's worker).

The runtime toggles (`set_eager_input_no_copy`, `set_needs_cpu_seq_lens`, `set_graph_mode`,
or all at once with `apply_toggles`) are called on that same thread between two steps.

Tensor parallel (`comm` of size > 1, `executor.parallel`): every rank builds its own
`ModelExecutor` over its shard. Rank 0 validates, completes and writes the row table, then
broadcasts the step (`TpLeader`) and runs it; the other ranks run `run_shard` on what they
receive (`executor.parallel.worker`), so every rank runs the same path, row table included.
Rank 0 samples from the gathered logits. Runtime toggles are broadcast the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import structlog
import torch

import executor
from attention import create_backend, decide_needs_cpu_seq_lens
from attention.selection import SeqLensPolicy
from executor.batch_prep import complete_batch, make_decode_batch, make_extend_batch
from executor.config import (
    DEFAULT_MAX_CONTEXT_LEN,
    RUNTIME_GRAPH_MODES,
    ExecutorConfig,
    choose_dtype,
    resolve_cache_dir,
    resolve_device,
    resolve_future_slots,
    resolve_graph_backend,
    resolve_graph_mode,
    resolve_max_context_len,
)
from executor.errors import FaultInjector, ToggleRefusedError
from executor.forward_batch import ForwardBatch, ForwardMode
from executor.future_tokens import FutureTokenTable
from executor.graphs.buckets import (
    CPU_GRAPH_MAX_BS,
    CPU_PIECEWISE_MAX_TOKENS,
    cpu_decode_buckets,
    cpu_piecewise_buckets,
    default_decode_buckets,
    default_piecewise_buckets,
    parse_bucket_list,
)
from executor.graphs.capture import CaptureReport
from executor.kv_cache import KVPool, ReqToTokenPool
from executor.model_runner import GraphSettings, ModelRunner, RunnerOutput, wants_decode_graphs
from executor.models.loader import LoadedModel, load_model
from executor.models.tokenizer import Tokenizer, load_tokenizer
from executor.observer import ExecutorObserver, NullObserver
from executor.parallel import broadcast
from executor.parallel.comm import TpComm
from executor.parallel.leader import TpLeader
from executor.sampling import SampleOutput, Sampler
from executor.validation import BatchLimits, validate_batch
from ops.device_scope import device_scope, on_own_device
from ops.h2d_staging import H2DStaging
from ops.host_transfer import host_transfers, to_host

log = structlog.get_logger(__name__)

MODE_NAMES = {ForwardMode.EXTEND: "extend", ForwardMode.DECODE: "decode", ForwardMode.IDLE: "idle"}


def graph_settings(
    config: ExecutorConfig, limits: BatchLimits, device: torch.device | None = None
) -> GraphSettings:
    """Bucket lists from config (explicit lists win), never beyond the executor's limits;
    the defaults are the CPU ladders (:mod:`executor.graphs.buckets`) on a CPU device."""
    cpu = device is not None and device.type == "cpu"
    max_bs = config.graph_max_bs or min(limits.max_batch_size, CPU_GRAPH_MAX_BS if cpu else 160)
    decode = parse_bucket_list(config.graph_batch_sizes) or (
        cpu_decode_buckets(max_bs) if cpu else default_decode_buckets(max_bs)
    )
    max_tokens = config.piecewise_max_tokens or min(
        limits.max_tokens_per_batch, CPU_PIECEWISE_MAX_TOKENS if cpu else 2048
    )
    piecewise = parse_bucket_list(config.piecewise_token_sizes) or (
        cpu_piecewise_buckets(max_tokens) if cpu else default_piecewise_buckets(max_tokens)
    )
    decode = [b for b in decode if b <= limits.max_batch_size] or [limits.max_batch_size]
    piecewise = [t for t in piecewise if t <= limits.max_tokens_per_batch] or [
        limits.max_tokens_per_batch
    ]
    return GraphSettings(
        decode_buckets=decode, piecewise_buckets=piecewise, max_bs=limits.max_batch_size
    )


@dataclass
class StepStats:
    """What one step did and cost (timings in nanoseconds)."""

    path: str
    batch_size: int
    padded_batch_size: int
    num_tokens: int
    padded_num_tokens: int
    timings_ns: dict[str, int] = field(default_factory=dict)
    mode: str = ""  # decode | extend | idle
    # What the input staging copied this step (issue 4); None / 0 when nothing was staged.
    fill_registry: str | None = None  # eager_decode | eager_extend
    fill_tensors: int = 0
    fill_bytes: int = 0
    fill_copy_calls: int = 0
    # Graph mode wanted a graph path but the step ran eagerly: "<kind>:<reason>".
    graph_fallback: str | None = None
    d2h_syncs: int = 0  # device-to-host transfers (ops.host_transfer.to_host) the step made
    # Host-to-device (ops.host_transfer.to_device): synchronizing uploads (pageable memory or
    # blocking), and asynchronous copies from the pinned staging buffer (1 per step).
    h2d_syncs: int = 0
    h2d_copies: int = 0
    future_refs: int = 0  # input ids resolved from the future-token table on the device
    # Wall-clock start (time.time_ns) of each phase in `timings_ns` (validate, stage, forward,
    # sample; queue when a worker ran it): trace spans are drawn from these afterwards.
    # Not sent over the wire.
    started_ns: dict[str, int] = field(default_factory=dict)
    allreduce_ns: int = 0  # tensor parallel: time in the step's all-reduces (rank 0's clock)


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
    quantization: str = "none"  # none | gguf | int8 | int4
    linear_kernel: str = "aten"  # what the float linears run on: onednn (packed) | aten
    weight_bytes: int = 0  # resident bytes of the model's weights (this rank's shard)
    # Why graph capture stopped for good (a poisoned capture; graph paths run eagerly); "".
    graph_capture_disabled: str = ""
    tp_size: int = 1  # tensor-parallel ranks


@dataclass(frozen=True)
class _Policy:
    """A needs_cpu_seq_lens decision's inputs (attention.selection.SeqLensPolicy)."""

    needs_cpu_seq_lens: str
    graph_mode: str


class ModelExecutor:
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
        dtype_choice = choose_dtype(config, self.device)
        self.dtype = dtype_choice.dtype
        log.info(
            "dtype chosen", dtype=str(self.dtype).removeprefix("torch."), reason=dtype_choice.reason
        )
        if loaded is None:
            loaded = load_model(
                config.model,
                device=self.device,
                dtype=self.dtype,
                max_positions=config.max_context_len or DEFAULT_MAX_CONTEXT_LEN,
                cache_dir=resolve_cache_dir(config),
                quantization=config.quantization,
                comm=self.comm,
                linear_kernel=config.linear_kernel,
            )
        self.loaded = loaded
        self.model = loaded.model
        mcfg = loaded.config
        max_context_len = resolve_max_context_len(config, mcfg)
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
            max_top_logprobs=config.max_top_logprobs,
            future_slots=resolve_future_slots(config),
        )
        self.req_to_token_pool = ReqToTokenPool(
            config.max_reqs, max_context_len, self.device, kv_slots=config.kv_slots
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
        # Runtime toggles start from the config; `apply_toggles` changes them between steps.
        graph_mode = resolve_graph_mode(config, self.device)
        self.graph_mode = graph_mode
        self.needs_cpu_seq_lens_policy = config.needs_cpu_seq_lens  # auto | on | off
        # Raises ValueError (start-up) if needs_cpu_seq_lens=off contradicts a backend or path.
        self.needs_cpu_seq_lens = decide_needs_cpu_seq_lens(
            _Policy(self.needs_cpu_seq_lens_policy, graph_mode), [self.attn_backend]
        )
        self.runner = ModelRunner(
            self.model,
            self.attn_backend,
            device=self.device,
            needs_cpu_seq_lens=self.needs_cpu_seq_lens,
            eager_input_no_copy=config.eager_input_no_copy,
            graphs=graph_settings(config, self.limits, self.device),
            graph_backend=resolve_graph_backend(config, self.device),
            cache_dir=resolve_cache_dir(config),
            stop=stop,
            future_tokens=self.future.tokens,
        )
        self.capture_reports: list[CaptureReport] = []
        # A step and a background capture's bucket never overlap (set_graph_mode(background)).
        self._step_lock = threading.Lock()
        self._capture_thread: threading.Thread | None = None
        # idle | capturing graph_mode=<mode> | failed: <reason> (the runtime toggle's status)
        self.graph_capture = "idle"
        # Called (on the capture thread) when a background capture ends, either way.
        self.graph_mode_listener: Callable[[], None] | None = None
        self.leader: TpLeader | None = None
        if graph_mode != "none":  # on every rank, in the same order (captures run collectives)
            self._record_captures(self.runner.enable_graphs(graph_mode))
        if wants_decode_graphs(graph_mode) and (
            refusal := self.attn_backend.graph_capture_refusal()
        ):
            log.warning(
                "decode graphs refused: DECODE runs eagerly",
                attention_backend=self.attn_backend.name,
                reason=refusal,
            )
        if self.comm.enabled and self.comm.rank == 0:
            # Rank 0 of a group: broadcasts every step and toggle from now on, pings idle workers.
            self.leader = TpLeader(self.comm, heartbeat_s=config.tp_timeout_s / 4)
            self.future.keep_host_mirror()
        self.sampler = Sampler(self.device, config.seed)
        self.staging = H2DStaging(self.device)  # the step's one host-to-device copy
        # Wraps the device part of every step (device move, model, sampling). Tests install
        # executor.graphs.capture_rules.HostReadGuard here to prove every host read there is counted.
        self.device_step_guard: Callable[[], AbstractContextManager[object]] = nullcontext
        # Tests only (executor/errors.py): make the forward or the sampler raise on a chosen step.
        self.faults: FaultInjector | None = None
        log.info(
            "executor ready",
            model=mcfg.name,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.loaded.quantization,
            linear_kernel=self.loaded.linear_kernel,
            weight_mib=round(self.loaded.weight_bytes / 2**20, 1),
            attention_backend=self.attn_backend.name,
            needs_cpu_seq_lens=self.needs_cpu_seq_lens,
            max_reqs=config.max_reqs,
            kv_slots=config.kv_slots,
            max_context_len=max_context_len,
            kv_cache_mib=round(self.kv_pool.nbytes / 2**20, 1),
            eager_input_no_copy=config.eager_input_no_copy,
            graph_mode=graph_mode,
            tp_rank=self.comm.rank,
            tp_size=self.comm.size,
        )

    @on_own_device
    def set_graph_mode(self, mode: str, *, background: bool = False) -> list[CaptureReport]:
        """Switch graph paths between two batches; a runner turned on for the first time is
        captured now. Refused (ToggleRefusedError, nothing changed) when the mode cannot be
        honoured: decode graphs with a backend that cannot be captured, or the piecewise path
        while needs_cpu_seq_lens is forced off, or while a background capture runs.

        With `background`, a mode that needs a capture captures on a background thread, bucket
        by bucket, while steps keep running on the current path between two buckets;
        `graph_capture` says "capturing" until the new mode is in use (then "idle", or
        "failed: ..."). Returns the reports of a capture done here ([] in the background)."""
        if self.leader is not None and not self.leader.lock.locked():
            raise ToggleRefusedError(
                "graph_mode: under tensor parallelism change it through apply_toggles, which "
                "has every rank capture in step"
            )
        mode = self._resolve_graph_mode(mode)
        if self.graph_capture.startswith("capturing"):
            raise ToggleRefusedError(
                f"graph_mode={mode}: a graph capture is in progress ({self.graph_capture}); "
                "retry when GetRuntimeConfig's graph_capture is no longer 'capturing'"
            )
        if wants_decode_graphs(mode) and self.attn_backend.graph_capture_refusal() is not None:
            raise ToggleRefusedError(
                f"graph_mode={mode}: attention backend {self.attn_backend.name!r} cannot be "
                f"captured in a graph{self._capture_refusal()}"
            )
        try:
            needs = self.check_needs_cpu_seq_lens(self.needs_cpu_seq_lens_policy, mode)
        except ToggleRefusedError as e:
            raise ToggleRefusedError(f"graph_mode={mode}: {e}") from e
        if background and self.runner.needs_capture(mode):
            self._capture_in_background(mode, needs)
            return []
        reports = self.runner.enable_graphs(mode)
        self._use_graph_mode(mode, needs, reports)
        return reports

    def _resolve_graph_mode(self, mode: str) -> str:
        if mode == "auto":
            mode = resolve_graph_mode(self.config.replace(graph_mode="auto"), self.device)
        if mode not in RUNTIME_GRAPH_MODES:
            raise ToggleRefusedError(
                f"graph_mode must be one of auto, {', '.join(RUNTIME_GRAPH_MODES)}, got {mode!r}"
            )
        return mode

    def _capture_refusal(self) -> str:
        reason = self.attn_backend.graph_capture_refusal()
        return f" ({reason})" if reason else ""

    def _use_graph_mode(self, mode: str, needs: bool, reports: list[CaptureReport]) -> None:
        self._record_captures(reports)
        self.graph_mode = mode
        self.needs_cpu_seq_lens = needs
        self.runner.eager_inputs.needs_cpu_seq_lens = needs
        log.info("graph mode changed", graph_mode=mode, captured=[r.kind for r in reports])

    def _capture_in_background(self, mode: str, needs: bool) -> None:
        """Capture what `mode` needs on a thread of its own; install it between two steps."""
        self.graph_capture = f"capturing graph_mode={mode}"
        log.info("graph capture started in the background", graph_mode=mode)

        def body() -> None:
            with device_scope(self.device):
                try:
                    captured = self.runner.capture_for(mode, progress=False, lock=self._step_lock)
                except BaseException as e:  # a shutdown (StartupCancelled) or a bug
                    self.graph_capture = f"failed: {type(e).__name__}: {e}"
                    log.error("background graph capture failed", graph_mode=mode, error=str(e))
                else:
                    with self._step_lock:  # between two steps
                        self.runner.install(mode, captured)
                        self._use_graph_mode(mode, needs, captured.reports)
                        self.graph_capture = "idle"
                if self.graph_mode_listener is not None:
                    self.graph_mode_listener()

        self._capture_thread = threading.Thread(target=body, name="graph-capture", daemon=True)
        self._capture_thread.start()

    def wait_for_capture(self, timeout: float | None = None) -> bool:
        """Wait for a background capture to end; False if it is still running."""
        thread = self._capture_thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _record_captures(self, reports: list[CaptureReport]) -> None:
        self.capture_reports.extend(reports)
        for r in reports:
            self.observer.on_graph_capture(r.kind, r.seconds, ok=not r.failed)
        poisoned = self.runner.graph_factory.poisoned
        if poisoned is not None and any(r.poisoned for r in reports):
            log.error("graph capture disabled, graph paths run eagerly", reason=poisoned)
            self.observer.on_graph_capture_disabled(poisoned)

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
            with self._step_lock:
                self._run(self._complete(batch), return_logits=False, keep_rows=False)

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

    # --- runtime toggles: call between two steps, on the thread that runs them ---

    @property
    def eager_input_no_copy(self) -> bool:
        return self.runner.eager_input_no_copy

    def set_eager_input_no_copy(self, enabled: bool) -> None:
        """Run the next eager steps on the batch's own tensors (True) or staged (False)."""
        self.runner.eager_input_no_copy = enabled

    def check_needs_cpu_seq_lens(self, mode: str, graph_mode: str | None = None) -> bool:
        """The effective `needs_cpu_seq_lens` for `mode` (auto | on | off) under `graph_mode`
        (default: the current one); ToggleRefusedError where something in use needs the
        host lengths and `mode` is off. Changes nothing."""
        policy: SeqLensPolicy = _Policy(mode, self.graph_mode if graph_mode is None else graph_mode)
        try:
            return decide_needs_cpu_seq_lens(policy, [self.attn_backend])
        except ValueError as exc:
            raise ToggleRefusedError(str(exc)) from None

    def set_needs_cpu_seq_lens(self, mode: str) -> bool:
        """Re-decide whether batches carry `seq_lens_cpu` for `mode`; the effective value.

        Raises ToggleRefusedError (and changes nothing) where `off` is impossible. Call it
        again after a graph-mode change: enabling the piecewise path turns `auto` on.
        """
        effective = self.check_needs_cpu_seq_lens(mode)
        self.needs_cpu_seq_lens_policy = mode
        self.needs_cpu_seq_lens = effective  # what _complete builds batches with
        self.runner.eager_inputs.needs_cpu_seq_lens = effective  # rebuilds the decode registry
        return effective

    @on_own_device
    def apply_toggles(
        self,
        *,
        eager_input_no_copy: bool | None = None,
        needs_cpu_seq_lens: str | None = None,
        graph_mode: str | None = None,
        background_capture: bool = False,
    ) -> None:
        """Apply the given toggles (None keeps a value) all together or not at all.

        Every check runs before anything changes; then the graph mode (which may capture, and
        raises ToggleRefusedError with nothing changed if it cannot), then the host-lengths
        decision under the new graph mode, then the eager path.

        With `background_capture` (the server's runtime config), a graph mode that needs a
        capture captures in the background (`set_graph_mode`); the host-lengths decision for
        it is taken when it is installed, so `needs_cpu_seq_lens` cannot change in the same
        update (refused, nothing changed).
        """
        target_mode = (
            self.needs_cpu_seq_lens_policy if needs_cpu_seq_lens is None else needs_cpu_seq_lens
        )
        target_graph = self._resolve_graph_mode(
            self.graph_mode if graph_mode is None else graph_mode
        )
        self.check_needs_cpu_seq_lens(target_mode, target_graph)  # raises before any change
        changes_graph = target_graph != self.graph_mode
        if self.graph_capture.startswith("capturing") and (
            changes_graph or target_mode != self.needs_cpu_seq_lens_policy
        ):
            raise ToggleRefusedError(
                f"a graph capture is in progress ({self.graph_capture}): graph_mode and "
                "needs_cpu_seq_lens cannot change until it ends"
            )
        # Not under tensor parallelism: every rank captures in step, inside the leader's lock.
        background = (
            background_capture
            and not self.comm.enabled
            and changes_graph
            and self.runner.needs_capture(target_graph)
        )
        if background and target_mode != self.needs_cpu_seq_lens_policy:
            raise ToggleRefusedError(
                f"graph_mode={target_graph} captures in the background: change "
                "needs_cpu_seq_lens in a separate update"
            )
        if self.leader is not None:  # every rank applies it (a capture runs collectives)
            with self.leader.holding():
                self.leader.send(
                    broadcast.Command(
                        broadcast.TOGGLES,
                        toggles={
                            "eager_input_no_copy": eager_input_no_copy,
                            "needs_cpu_seq_lens": needs_cpu_seq_lens,
                            "graph_mode": graph_mode,
                        },
                    )
                )
                self._apply_toggles(target_mode, target_graph, eager_input_no_copy, False)
            return
        self._apply_toggles(target_mode, target_graph, eager_input_no_copy, background)

    def _apply_toggles(
        self,
        target_mode: str,
        target_graph: str,
        eager_input_no_copy: bool | None,
        background: bool,
    ) -> None:
        if target_graph != self.graph_mode:
            self.set_graph_mode(target_graph, background=background)
        if not background:
            self.set_needs_cpu_seq_lens(target_mode)
        if eager_input_no_copy is not None:
            self.set_eager_input_no_copy(eager_input_no_copy)

    def validate(self, batch: ForwardBatch) -> None:
        """Raise BatchValidationError if the batch breaks a rule; changes nothing."""
        validate_batch(
            batch,
            self.limits,
            self.req_to_token_pool.resident_lens,
            allow_custom_positions=self.config.allow_custom_positions,
            future_assigned=self.future.assigned,
        )

    @on_own_device
    def forward(self, batch: ForwardBatch, *, return_logits: bool = False) -> ForwardOutput:
        """Run one step. A refused or failed batch leaves the row table as it was.

        `return_logits` adds each request's last-token logits (a host copy) to the output.
        """
        d2h0, h2d_syncs0, h2d_copies0 = host_transfers.totals()
        self.comm.take_allreduce_ns()  # drop what warm-up or a capture accumulated
        wall0 = time.time_ns()
        t0 = time.perf_counter_ns()
        self.validate(batch)
        t1 = time.perf_counter_ns()
        host = self._complete(batch)
        t2 = time.perf_counter_ns()
        with self._step_lock:  # a background capture holds it only while it captures a bucket
            out, sample, logits, timings = self._run(
                host, return_logits=return_logits, keep_rows=True
            )
        timings["validate"] = t1 - t0
        timings["stage"] += t2 - t1  # completing the batch is part of staging it
        timings["total"] = time.perf_counter_ns() - t0
        allreduce_ns = self.comm.take_allreduce_ns()
        # The phases run back to back: validate, stage (complete + device move), forward, sample.
        started = {"validate": wall0, "stage": wall0 + timings["validate"]}
        started["forward"] = started["stage"] + timings["stage"]
        started["sample"] = started["forward"] + timings["forward"]
        stats = StepStats(
            path=out.path,
            batch_size=host.batch_size,
            padded_batch_size=out.padded_batch_size,
            num_tokens=host.num_tokens,
            padded_num_tokens=out.padded_num_tokens,
            timings_ns=timings,
            mode=MODE_NAMES[host.forward_mode],
            fill_registry=out.fill_registry,
            fill_tensors=out.fill_stats.tensors_copied,
            fill_bytes=out.fill_stats.bytes_copied,
            fill_copy_calls=out.fill_stats.copy_calls,
            graph_fallback=out.graph_fallback,
            d2h_syncs=host_transfers.total_syncs - d2h0,
            h2d_syncs=host_transfers.total_h2d_syncs - h2d_syncs0,
            h2d_copies=host_transfers.total_h2d_copies - h2d_copies0,
            started_ns=started,
            future_refs=host.future_refs,
            allreduce_ns=allreduce_ns,
        )
        if out.graph_fallback is not None:
            kind, reason = out.graph_fallback.split(":", 1)
            self.observer.on_graph_fallback(kind, reason)
        return ForwardOutput(
            next_token_ids=sample.next_token_ids,
            stats=stats,
            next_token_logprobs=sample.next_token_logprobs,
            top_logprob_ids=sample.top_logprob_ids,
            top_logprobs=sample.top_logprobs,
            logits=logits,
        )

    def _complete(self, batch: ForwardBatch) -> ForwardBatch:
        return complete_batch(
            batch,
            needs_cpu_seq_lens=self.needs_cpu_seq_lens,
            max_context_len=self.limits.max_context_len,
        )

    def _run(
        self, host: ForwardBatch, *, return_logits: bool, keep_rows: bool
    ) -> tuple[RunnerOutput, SampleOutput, torch.Tensor | None, dict[str, int]]:
        """Write the row table, run the model, sample. The write is undone if anything fails
        (or always, with `keep_rows=False`)."""
        assert host.sampling is not None
        if self.leader is None:
            return self._run_step(host, return_logits=return_logits, keep_rows=keep_rows)
        with self.leader.holding():  # no heartbeat between the broadcast and the collectives
            return self._run_step(host, return_logits=return_logits, keep_rows=keep_rows)

    def _run_step(
        self, host: ForwardBatch, *, return_logits: bool, keep_rows: bool
    ) -> tuple[RunnerOutput, SampleOutput, torch.Tensor | None, dict[str, int]]:
        assert host.sampling is not None
        t0 = time.perf_counter_ns()
        plan = self.sampler.plan(host.sampling)
        # One staged host-to-device copy for the whole step: the batch's device fields, the
        # sampling parameters and the row-table cells (ops.h2d_staging).
        cells = self.req_to_token_pool.row_cells(host)
        views = self.staging.stage(host.staged_fields() + cells.staged_fields())
        # IDLE too: it may release rows. Refuses (nothing changed) a slot a live row holds.
        write = self.req_to_token_pool.write_batch(host, cells, cells.from_views(views))
        if self.leader is not None:  # the batch was accepted here: every rank runs it
            try:
                step = self.future.resolved_for_workers(host)  # workers keep no future table
                self.leader.send(broadcast.Command(broadcast.STEP, step, keep_rows=keep_rows))
            except BaseException:
                self.req_to_token_pool.undo(write)
                raise
        future = self.future.apply(host) if keep_rows else None
        try:
            with self.device_step_guard():
                fb = host.with_device_fields(views)
                t1 = time.perf_counter_ns()
                out = self.runner.forward(fb)
                if self.faults is not None:
                    self.faults.check("forward")
                t2 = time.perf_counter_ns()
                assert fb.sampling is not None
                if self.faults is not None:
                    self.faults.check("sampler")
                sample = self.sampler.sample(
                    out.logits,
                    plan,
                    fb.sampling,
                    fb.seq_lens,
                    return_logprob=host.return_logprob,
                    top_logprobs_num=host.top_logprobs_num,
                )
                logits = to_host(out.logits, "logits") if return_logits else None
                if future is not None:  # last: nothing after it can fail the step
                    self.future.store(
                        fb.future_token_slots,
                        sample.device_token_ids,
                        host.future_token_slots,
                        sample.next_token_ids,
                    )
        except BaseException:
            self.req_to_token_pool.undo(write)
            if future is not None:
                self.future.undo(future)
            raise
        if not keep_rows:
            self.req_to_token_pool.undo(write)
        t3 = time.perf_counter_ns()
        return out, sample, logits, {"stage": t1 - t0, "forward": t2 - t1, "sample": t3 - t2}

    @on_own_device
    def run_shard(self, host: ForwardBatch, *, keep_rows: bool) -> None:
        """A worker rank: run a step rank 0 validated, completed and broadcast (row table
        write, this rank's part of the model and its collectives; rank 0 samples)."""
        cells = self.req_to_token_pool.row_cells(host)
        views = self.staging.stage(host.staged_fields() + cells.staged_fields())
        write = self.req_to_token_pool.write_batch(host, cells, cells.from_views(views))
        try:
            self.runner.forward(host.with_device_fields(views))  # references resolved by rank 0
        except BaseException:
            self.req_to_token_pool.undo(write)
            raise
        if not keep_rows:
            self.req_to_token_pool.undo(write)
        self.comm.take_allreduce_ns()

    def close(self) -> None:
        """Rank 0 of a group: stop the heartbeat and tell the workers to stop (a no-op
        otherwise). Call once no step can run any more."""
        if self.leader is not None:
            self.leader.close()
