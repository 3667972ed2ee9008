"""Run one completed, on-device ForwardBatch: logits of each request's last token.

Dispatch: DECODE takes the full-graph path when graphs are on for it and the batch fits a
captured bucket; EXTEND takes the piecewise path likewise; everything else runs eagerly.
Eager runs the model on the eager input registry's buffers, filled from the step's staged
upload (:mod:`executor.eager_inputs`), or with `eager_input_no_copy` on the staged upload
itself. When a graph path was wanted but the batch ran eagerly, the output says why
(`graph_fallback`).
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import structlog
import torch

from attention.base import AttentionBackend
from executor.core.extras_types import asks_routed_experts, hidden_layers
from executor.core.forward_batch import ForwardBatch
from executor.core.names import INDUCTOR, GraphMode, Path
from executor.core.runner_output import GraphFallback, RunnerOutput
from executor.core.toggles import Toggles
from executor.eager_inputs import EagerInputs
from executor.graphs.capture import CaptureReport
from executor.graphs.compile_pause import CompilePause
from executor.graphs.decode_runner import DecodeGraphRunner
from executor.graphs.factory import GraphFactory
from executor.graphs.idle_gate import IdleGate
from executor.graphs.piecewise_runner import PiecewiseGraphRunner
from executor.graphs.settings import GraphSettings
from executor.graphs.step_threads import StepThreads
from executor.models.blocks import LayerFns, compile_layer_fns
from executor.models.decoder_model import DecoderModel
from executor.models.moe import attach_route_recorder
from executor.models.standin import StandIn
from ops.future_tokens import resolve_future_tokens
from registry import FillStats

log = structlog.get_logger(__name__)


@dataclass
class CapturedRunners:
    """Runners captured for a graph mode, not yet in use (`ModelRunner.install`)."""

    decode: DecodeGraphRunner | None = None
    piecewise: PiecewiseGraphRunner | None = None
    reports: list[CaptureReport] = field(default_factory=list)


class ModelRunner:
    """Picks the path for a batch and runs it. Not thread-safe: one thread owns the device.

    It reads `graph_mode`, `eager_input_no_copy` and `needs_cpu_seq_lens` from `toggles`
    (changed between two batches by :class:`executor.step.graph_control.GraphControl`);
    `enable_graphs` captures what a mode needs first.
    """

    def __init__(
        self,
        model: DecoderModel,
        attn_backend: AttentionBackend,
        *,
        device: torch.device,
        toggles: Toggles,
        graphs: GraphSettings | None = None,
        graph_backend: str = "standin",
        cache_dir: pathlib.Path | None = None,
        stop: threading.Event | None = None,
        future_tokens: torch.Tensor | None = None,
        standin: StandIn | None = None,
    ) -> None:
        """`future_tokens`: the future-token table (device); every path resolves negative
        input ids from it before the model reads them (inside the graph on graph paths).
        `standin`: the stand-in accelerator's model, run instead of every path."""
        self.model = model
        self.route_recorder = attach_route_recorder(model)  # None: a dense model
        self.standin = standin
        self.future_tokens = future_tokens
        self.attn_backend = attn_backend
        self.device = device
        self.toggles = toggles
        self.eager_inputs = EagerInputs(
            device, seq_len_fill_value=attn_backend.graph_seq_len_fill_value()
        )
        self.graph_settings = graphs
        self.graph_factory = GraphFactory(
            device,
            graph_backend,
            cache_dir=cache_dir,
            compiled=self._compiled_model,
            compile_halves=self._compile_halves,
            stop=stop,
            compiler=graphs.compiler if graphs is not None else INDUCTOR,
        )
        # One intra-op thread fewer while this process compiles beside its steps (CPU).
        self.step_threads = StepThreads()
        self.compile_pause = CompilePause()  # a compile worker stopped while a batch is in
        self.idle_gate = IdleGate()  # the capture thread's own load waits for the steps
        self.idle_gate.guard(self.compile_pause.lock)  # the capture thread ticks under it
        self._compiled_fns: LayerFns | None = None
        self._fns_lock = threading.Lock()  # the capture thread and the step thread make them
        self.decode_graphs: DecodeGraphRunner | None = None
        self.piecewise: PiecewiseGraphRunner | None = None

    def step_started(self) -> None:
        """Before a step's device work: the background work yields to it, on a CPU (the
        compile worker's processes stop, the capture thread's own load waits)."""
        self.compile_pause.pause()
        self.idle_gate.step_started()

    def step_ended(self) -> None:
        """Once the step is read (or failed): the background work may go on after a linger."""
        self.compile_pause.resume()
        self.idle_gate.step_ended()

    def batch_arrived(self) -> bool:
        """An RPC thread, as a batch arrives: the background work yields from then on, so the
        batch's RPC path, admission and staging run without it too, until `batch_left` (called
        only when this returned True). Off a CPU nothing yields: the compile and the load
        share no core with the steps, and the batch holds nothing."""
        if self.device.type != "cpu":
            return False
        self.compile_pause.batch_arrived()
        self.idle_gate.batch_arrived()
        return True

    def batch_left(self) -> None:
        """The batch answered or refused (its job's end)."""
        self.compile_pause.batch_left()
        self.idle_gate.batch_left()

    # --- graphs --------------------------------------------------------------------------
    def _layer_fns(self) -> LayerFns:
        """The compiled layer functions, made once (their compiled code is cached in them)."""
        with self._fns_lock:
            if self._compiled_fns is None:
                self._compiled_fns = compile_layer_fns(self.graph_factory.compiler)
            return self._compiled_fns

    @contextmanager
    def _compiled_model(self) -> Iterator[None]:
        """The model with its layer functions compiled (the `compiled` graph backend)."""
        with self.model.using_compiled_fns(self._layer_fns()):
            yield

    def _compile_halves(self, tokens: int, kind: str) -> None:
        """Compile the layer functions for `tokens` rows on private inputs, as the `kind`
        runner (decode | piecewise) calls them (a capture's compile phase: off the step
        lock, nothing shared is read or written)."""
        positions = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        bufs = self.model.piece_buffers(tokens, self.device)
        fns = self._layer_fns()
        with torch.inference_mode():  # as captures and replays run them
            self.model.compile_halves(fns, positions, bufs, pieces=kind == "piecewise")

    def enable_graphs(self, mode: GraphMode, *, progress: bool = True) -> list[CaptureReport]:
        """Capture and install the runners `mode` needs that were not captured yet (the
        caller switches `toggles.graph_mode`)."""
        captured = self.capture_for(mode, progress=progress)
        self.install(captured)
        return captured.reports

    def drop_graphs(self) -> None:
        """Forget every captured graph (the memory they captured is going away); the next
        capture starts a new graph pool (`GraphFactory.new_round`)."""
        self.decode_graphs = self.piecewise = None
        self.graph_factory.new_round()

    def needs_capture(self, mode: GraphMode) -> bool:
        """Whether switching to `mode` captures a runner that does not exist yet."""
        return bool(self._missing(mode))

    def _missing(self, mode: GraphMode) -> list[str]:
        if mode is not GraphMode.NONE and self.graph_settings is None:
            raise ValueError("this runner was built without graph settings")
        missing = []
        if (
            mode.decode_graphs
            and self.decode_graphs is None
            and self.attn_backend.graph_capture_refusal() is None
        ):
            missing.append("decode")
        if mode.piecewise and self.piecewise is None:
            missing.append("piecewise")
        return missing

    def capture_for(
        self,
        mode: GraphMode,
        *,
        progress: bool = True,
        lock: AbstractContextManager[object] | None = None,
    ) -> CapturedRunners:
        """Build and capture the runners `mode` needs that do not exist yet, without
        installing them (the current path keeps serving). With `lock`, each bucket's capture
        holds it, so the steps that take it never overlap a capture's runs, while its compile
        phase runs without it (a runtime capture on a background thread)."""
        missing = self._missing(mode)
        out = CapturedRunners()
        # The runners' registries are built holding `lock` too: building one writes its pooled
        # buffers (e.g. `seq_lens`' fill value), which a live eager step may be reading.
        held = lock or nullcontext()
        if "decode" in missing:
            with held:
                out.decode = self._decode_runner(self.toggles.needs_cpu_seq_lens)
            out.reports.append(out.decode.capture(progress=progress, lock=lock))
        if "piecewise" in missing:
            with held:
                out.piecewise = self._piecewise_runner()
            out.reports.append(out.piecewise.capture(progress=progress, lock=lock))
        return out

    def _decode_runner(self, needs_cpu_seq_lens: bool) -> DecodeGraphRunner:
        assert self.graph_settings is not None
        return DecodeGraphRunner(
            self.model,
            self.attn_backend,
            device=self.device,
            buckets=self.graph_settings.decode_buckets,
            needs_cpu_seq_lens=needs_cpu_seq_lens,
            factory=self.graph_factory,
            future_tokens=self.future_tokens,
        )

    def _piecewise_runner(self) -> PiecewiseGraphRunner:
        settings = self.graph_settings
        assert settings is not None
        return PiecewiseGraphRunner(
            self.model,
            self.attn_backend,
            device=self.device,
            buckets=settings.piecewise_buckets,
            max_bs=settings.max_bs,
            factory=self.graph_factory,
            future_tokens=self.future_tokens,
        )

    def missing_runners(self, mode: GraphMode) -> tuple[str, ...]:
        """The runners (decode, piecewise) switching to `mode` captures."""
        return tuple(self._missing(mode))

    def all_saved(self, runners: tuple[str, ...], lock: AbstractContextManager[object]) -> bool:
        """Whether what capturing `runners` compiles is all saved whole steps already (then
        no compile worker is needed). Builds a throwaway decode runner holding `lock` (its
        registry writes pooled buffers a step reads)."""
        if runners != ("decode",) or not self.graph_factory.whole_steps:
            return False
        with lock:
            decode = self._decode_runner(self.toggles.needs_cpu_seq_lens)
        return decode.all_saved()

    def compile_only(
        self, runners: tuple[str, ...], *, needs_cpu_seq_lens: bool
    ) -> dict[str, dict[int, str]]:
        """The compile phase of every bucket of `runners`, nothing captured (the compile
        worker warms the caches for another process's capture; `needs_cpu_seq_lens` as that
        process's). The failed buckets by runner kind."""
        failed: dict[str, dict[int, str]] = {}
        if "decode" in runners:
            failed["decode"] = self._decode_runner(needs_cpu_seq_lens).compile_only()
        if "piecewise" in runners:
            failed["piecewise"] = self._piecewise_runner().compile_only()
        return failed

    def install(self, captured: CapturedRunners) -> None:
        """Use `captured` (from `capture_for`): between two steps."""
        if captured.decode is not None:
            self.decode_graphs = captured.decode
        if captured.piecewise is not None:
            self.piecewise = captured.piecewise

    def _graph_path(self, fb: ForwardBatch) -> tuple[RunnerOutput | None, GraphFallback | None]:
        """(output, None) if a graph path ran; (None, why) if one was wanted but could not
        run; (None, None) if graphs are off for this batch's mode."""
        mode = self.toggles.graph_mode
        if fb.forward_mode.is_decode() and mode.decode_graphs:
            if self.decode_graphs is None:
                return None, GraphFallback("decode", "backend_unsupported")
            reason = self.decode_graphs.fallback_reason(fb)
            if reason is not None:
                return None, GraphFallback("decode", reason)
            return self.decode_graphs.replay(fb), None
        if fb.forward_mode.is_extend() and mode.piecewise and self.piecewise is not None:
            reason = self.piecewise.fallback_reason(fb)
            if reason is not None:
                return None, GraphFallback("piecewise", reason)
            return self.piecewise.replay(fb), None
        return None, None

    # --- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> RunnerOutput:
        """The eager paths gather future tokens only when the batch has references
        (`fb.future_refs`, counted on the host); a captured graph always runs the gather."""
        layers = hidden_layers(fb.row_outputs, self.model.config.num_layers)
        if self.device.type == "cpu":
            self.step_threads.apply()
        if self.standin is not None:
            return self.standin.forward(fb, layers)
        routed = self.route_recorder is not None and asks_routed_experts(fb.row_outputs)
        eager_only = "hidden_layers" if layers else "routed_experts" if routed else ""
        out, fallback = self._graph_path(fb) if not eager_only else (None, None)
        if out is not None:
            return out
        if eager_only:  # named layers' streams and routed experts: recorded eagerly only
            mode = self.toggles.graph_mode
            if fb.forward_mode.is_decode() and mode.decode_graphs:
                fallback = GraphFallback("decode", eager_only)
            elif fb.forward_mode.is_extend() and mode.piecewise:
                fallback = GraphFallback("piecewise", eager_only)
        out = self._eager(fb, layers, routed)
        out.graph_fallback = fallback
        return out

    def _eager(
        self, fb: ForwardBatch, layers: tuple[int, ...] = (), routed: bool = False
    ) -> RunnerOutput:
        no_copy = self.toggles.eager_input_no_copy
        path = Path.EAGER_NO_COPY if no_copy else Path.EAGER
        if fb.forward_mode.is_idle():
            logits = torch.empty(
                (0, self.model.config.vocab_size), dtype=torch.float32, device=fb.seq_lens.device
            )
            return RunnerOutput(logits=logits, path=path, padded_batch_size=0, padded_num_tokens=0)
        # NOTE: no-copy reads the step's staged views themselves; the registry path reads
        # its own buffers, filled from them. Neither mutates `fb`.
        filled = None if no_copy else self.eager_inputs.fill(fb)
        inputs = fb if filled is None else filled.batch
        run = inputs.replace(attn_metadata=self.attn_backend.init_forward_metadata(inputs))
        assert run.positions is not None
        input_ids = run.input_ids
        if fb.future_refs and input_ids is not None and self.future_tokens is not None:
            input_ids = resolve_future_tokens(input_ids, self.future_tokens)
        keep = {i: torch.empty(0) for i in layers} if layers else None
        recorder = self.route_recorder if routed else None
        if recorder is not None:
            recorder.start(fb.num_tokens, run.positions.device)
        try:
            hidden = self.model.forward(
                input_ids, run.positions, run, self.attn_backend, run.input_embeds, keep
            )
        finally:
            ids = None if recorder is None else recorder.take()
        logits = self.model.compute_logits(hidden, run)
        return RunnerOutput(
            logits,
            path,
            fb.batch_size,
            fb.num_tokens,
            fill_registry=None if filled is None else filled.registry,
            fill_stats=FillStats() if filled is None else filled.stats,
            hidden=hidden,
            layers=keep or {},
            routed=ids,
        )
