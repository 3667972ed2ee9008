"""Run one completed, on-device ForwardBatch: logits of each request's last token.

Dispatch: DECODE takes the full-graph path when graphs are on for it and the batch fits a
captured bucket; EXTEND takes the piecewise path likewise; everything else runs eagerly.
Eager stages the batch through an eager input registry (:mod:`executor.eager_inputs`) so
the model reads registry buffers as it does under the graph runners; `eager_input_no_copy`
skips that copy and runs on the batch's own tensors. When a graph path was wanted but the
batch ran eagerly, the output says why (`graph_fallback`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from attention.base import AttentionBackend
from executor.config import RUNTIME_GRAPH_MODES
from executor.eager_inputs import EagerInputs
from executor.forward_batch import ForwardBatch
from executor.graphs.capture import CaptureReport
from executor.graphs.decode_runner import DecodeGraphRunner
from executor.graphs.graph import GraphFactory
from executor.graphs.piecewise_runner import PiecewiseGraphRunner
from executor.models.blocks import LayerFns, compile_layer_fns
from executor.models.decoder_model import DecoderModel
from executor.runner_output import RunnerOutput
from ops.future_tokens import resolve_future_tokens
from registry import FillStats

log = structlog.get_logger(__name__)


def wants_decode_graphs(mode: str) -> bool:
    return mode in ("decode", "both")


def wants_piecewise(mode: str) -> bool:
    return mode in ("extend", "both")


@dataclass
class CapturedRunners:
    """Runners captured for a graph mode, not yet in use (`ModelRunner.install`)."""

    decode: DecodeGraphRunner | None = None
    piecewise: PiecewiseGraphRunner | None = None
    reports: list[CaptureReport] = field(default_factory=list)


@dataclass(frozen=True)
class GraphSettings:
    """Bucket lists of the two graph runners (from :mod:`executor.graphs.buckets`)."""

    decode_buckets: list[int]
    piecewise_buckets: list[int]
    max_bs: int  # the executor's max batch size (piecewise batches carry up to this many)


class ModelRunner:
    """Picks the path for a batch and runs it. Not thread-safe: one thread owns the device.

    `eager_input_no_copy` and `graph_mode` are plain attributes so runtime toggles can flip
    them between two batches; `enable_graphs` captures what a mode needs first.
    """

    def __init__(
        self,
        model: DecoderModel,
        attn_backend: AttentionBackend,
        *,
        device: torch.device,
        needs_cpu_seq_lens: bool,
        eager_input_no_copy: bool = False,
        graphs: GraphSettings | None = None,
        graph_backend: str = "standin",
        cache_dir: Path | None = None,
        stop: threading.Event | None = None,
        future_tokens: torch.Tensor | None = None,
    ) -> None:
        """`future_tokens`: the future-token table (device); every path resolves negative
        input ids from it before the model reads them (inside the graph on graph paths)."""
        self.model = model
        self.future_tokens = future_tokens
        self.attn_backend = attn_backend
        self.device = device
        self.eager_input_no_copy = eager_input_no_copy
        self.eager_inputs = EagerInputs(device, needs_cpu_seq_lens=needs_cpu_seq_lens)
        self.graph_settings = graphs
        self.graph_mode = "none"
        self.graph_factory = GraphFactory(
            device, graph_backend, cache_dir=cache_dir, compiled=self._compiled_model, stop=stop
        )
        self._compiled_fns: LayerFns | None = None
        self.decode_graphs: DecodeGraphRunner | None = None
        self.piecewise: PiecewiseGraphRunner | None = None

    # --- graphs --------------------------------------------------------------------------
    @contextmanager
    def _compiled_model(self) -> Iterator[None]:
        """The model with its layer functions compiled (the `compiled` graph backend)."""
        if self._compiled_fns is None:
            self._compiled_fns = compile_layer_fns()
        with self.model.using_compiled_fns(self._compiled_fns):
            yield

    def enable_graphs(self, mode: str, *, progress: bool = True) -> list[CaptureReport]:
        """Switch to `mode`, capturing the runners it needs that were not captured yet."""
        captured = self.capture_for(mode, progress=progress)
        self.install(mode, captured)
        return captured.reports

    def needs_capture(self, mode: str) -> bool:
        """Whether switching to `mode` captures a runner that does not exist yet."""
        return bool(self._missing(mode))

    def _missing(self, mode: str) -> list[str]:
        if mode not in RUNTIME_GRAPH_MODES:
            raise ValueError(
                f"graph_mode must be one of {', '.join(RUNTIME_GRAPH_MODES)}, got {mode!r}"
            )
        if mode != "none" and self.graph_settings is None:
            raise ValueError("this runner was built without graph settings")
        missing = []
        if (
            wants_decode_graphs(mode)
            and self.decode_graphs is None
            and self.attn_backend.graph_capture_refusal() is None
        ):
            missing.append("decode")
        if wants_piecewise(mode) and self.piecewise is None:
            missing.append("piecewise")
        return missing

    def capture_for(
        self,
        mode: str,
        *,
        progress: bool = True,
        lock: AbstractContextManager[object] | None = None,
    ) -> CapturedRunners:
        """Build and capture the runners `mode` needs that do not exist yet, without
        installing them (the current path keeps serving). With `lock`, each bucket is
        captured holding it, so the steps that take it in between never overlap a capture
        (a runtime capture on a background thread)."""
        missing = self._missing(mode)
        settings = self.graph_settings
        out = CapturedRunners()
        if "decode" in missing:
            assert settings is not None
            out.decode = DecodeGraphRunner(
                self.model,
                self.attn_backend,
                device=self.device,
                buckets=settings.decode_buckets,
                needs_cpu_seq_lens=self.eager_inputs.needs_cpu_seq_lens,
                factory=self.graph_factory,
                future_tokens=self.future_tokens,
            )
            out.reports.append(out.decode.capture(progress=progress, lock=lock))
        if "piecewise" in missing:
            assert settings is not None
            out.piecewise = PiecewiseGraphRunner(
                self.model,
                self.attn_backend,
                device=self.device,
                buckets=settings.piecewise_buckets,
                max_bs=settings.max_bs,
                factory=self.graph_factory,
                future_tokens=self.future_tokens,
            )
            out.reports.append(out.piecewise.capture(progress=progress, lock=lock))
        return out

    def install(self, mode: str, captured: CapturedRunners) -> None:
        """Use `captured` (from `capture_for`) and switch to `mode`: between two steps."""
        if captured.decode is not None:
            self.decode_graphs = captured.decode
        if captured.piecewise is not None:
            self.piecewise = captured.piecewise
        self.graph_mode = mode

    def _graph_path(self, fb: ForwardBatch) -> tuple[RunnerOutput | None, str | None]:
        """(output, None) if a graph path ran; (None, "kind:reason") if one was wanted but
        could not run; (None, None) if graphs are off for this batch's mode."""
        if fb.forward_mode.is_decode() and wants_decode_graphs(self.graph_mode):
            if self.decode_graphs is None:
                return None, "decode:backend_unsupported"
            reason = self.decode_graphs.fallback_reason(fb)
            return (
                (self.decode_graphs.replay(fb), None)
                if reason is None
                else (None, f"decode:{reason}")
            )
        if (
            fb.forward_mode.is_extend()
            and wants_piecewise(self.graph_mode)
            and self.piecewise is not None
        ):
            reason = self.piecewise.fallback_reason(fb)
            return (
                (self.piecewise.replay(fb), None)
                if reason is None
                else (None, f"piecewise:{reason}")
            )
        return None, None

    # --- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> RunnerOutput:
        """The eager paths gather future tokens only when the batch has references
        (`fb.future_refs`, counted on the host); a captured graph always runs the gather."""
        out, fallback = self._graph_path(fb)
        if out is not None:
            return out
        out = self._eager(fb)
        out.graph_fallback = fallback
        return out

    def _eager(self, fb: ForwardBatch) -> RunnerOutput:
        path = "eager_no_copy" if self.eager_input_no_copy else "eager"
        if fb.forward_mode.is_idle():
            logits = torch.empty(
                (0, self.model.config.vocab_size), dtype=torch.float32, device=fb.seq_lens.device
            )
            return RunnerOutput(logits=logits, path=path, padded_batch_size=0, padded_num_tokens=0)
        fill_registry: str | None = None
        fill_stats = FillStats()
        if self.eager_input_no_copy:
            view = dataclasses.replace(fb)  # a fresh wrapper aliasing the batch's tensors
        else:
            staged = self.eager_inputs.stage(fb)
            view, fill_registry, fill_stats = staged.fb, staged.registry, staged.stats
        # NOTE: metadata is planned from the batch the model actually reads (`view` is ours).
        view.attn_metadata = self.attn_backend.init_forward_metadata(view)
        assert view.positions is not None
        input_ids = view.input_ids
        if fb.future_refs and input_ids is not None and self.future_tokens is not None:
            input_ids = resolve_future_tokens(input_ids, self.future_tokens)
        hidden = self.model.forward(
            input_ids, view.positions, view, self.attn_backend, view.input_embeds
        )
        # The logits are fresh memory, not a registry view: they survive the next fill.
        logits = self.model.compute_logits(hidden, view)
        return RunnerOutput(
            logits=logits,
            path=path,
            padded_batch_size=view.batch_size,
            padded_num_tokens=view.num_tokens,
            fill_registry=fill_registry,
            fill_stats=fill_stats,
        )
