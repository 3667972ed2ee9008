"""Full-graph DECODE: the whole model body captured per batch-size bucket.

Capture and replay stage their inputs through one `build_decode_registry(...).fill_from`
call, so every slot - `num_token_non_padded` included - holds at capture exactly what a
replay of a batch of the bucket's size gives it.
A batch is padded up to its bucket: padded requests read row 0 (all slot 0) with
`seq_len_fill_value` tokens and write their one token to the reserved slot 0. The LM head
runs outside the graph on the real rows only.

With LoRA on (the model has adapter sites), every bucket is captured twice: without LoRA
(a batch of base rows replays it and runs no adapter work) and with it (the graph reads the
adapter slots' buffers and the registry's per-token `lora_slots`, padded with 0, the base).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from attention.base import AttentionBackend, GraphCaptureUnsupportedError
from executor.core.buckets import kv_bucket, kv_buckets
from executor.core.forward_batch import ForwardBatch, ForwardMode
from executor.core.names import GRAPH_DECODE
from executor.core.runner_output import RunnerOutput
from executor.graphs.bucket_runner import BucketGraphRunner
from executor.graphs.factory import GraphFactory
from executor.graphs.graph import Graph
from executor.graphs.step_graph import StepCall, StepCompiledGraph
from executor.models.decoder_model import DecoderModel
from ops.future_tokens import resolve_future_tokens
from registry import FillStats, build_decode_registry

log = structlog.get_logger(__name__)


def decode_step(
    model: DecoderModel,
    attn_backend: AttentionBackend,
    view: ForwardBatch,
    future_tokens: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """One captured DECODE step over a bucket's static buffers: the hidden states into `out`.
    A function of its inputs, so that `compiled_step` compiles it ahead of time."""
    assert view.positions is not None and view.input_ids is not None
    ids = view.input_ids
    if future_tokens is not None:  # in the graph: reads the table's buffer
        ids = resolve_future_tokens(ids, future_tokens)
    out.copy_(model.forward(ids, view.positions, view, attn_backend))


@dataclass
class _Captured:
    graph: Graph
    view: ForwardBatch  # the registry view the graph reads (static buffer slices)
    attn_metadata: object  # the backend's metadata bound to its graph buffers for this bucket


class DecodeGraphRunner(BucketGraphRunner[dict[tuple[bool, int], _Captured]]):
    """One graph per (batch-size bucket, LoRA or not, KV-length bucket); a backend that is not
    `graph_kv_bounded` has the one KV bucket 0 (its kernels follow each request's length)."""

    kind = "decode"

    def __init__(
        self,
        model: DecoderModel,
        attn_backend: AttentionBackend,
        *,
        device: torch.device,
        buckets: list[int],
        needs_cpu_seq_lens: bool,
        factory: GraphFactory,
        future_tokens: torch.Tensor | None = None,
    ) -> None:
        super().__init__(model, attn_backend, device=device, buckets=buckets, factory=factory)
        # The future-token table: the captured graph gathers referenced tokens from it.
        self.future_tokens = future_tokens
        self.max_bs = buckets[-1]
        self.max_context_len = attn_backend.req_to_token_pool.max_context_len
        self.kv_buckets = kv_buckets(self.max_context_len) if attn_backend.graph_kv_bounded else [0]
        self.fill_value = attn_backend.graph_seq_len_fill_value()
        self.lora_variants = (False, True) if model.lora is not None else (False,)
        self.registry = build_decode_registry(
            device=device,
            max_bs=self.max_bs,
            max_num_tokens=self.max_bs,
            seq_len_fill_value=self.fill_value,
            enable_num_token_non_padded=True,
            needs_cpu_seq_lens=needs_cpu_seq_lens,
            register_lora_slots=model.lora is not None,
        )
        # Whole-step graphs compiled (off the step lock) and not captured yet, by
        # (bs, lora, kv).
        self._compiled: dict[tuple[int, bool, int], Graph] = {}
        # NOTE: one output buffer for every bucket; a replay overwrites it.
        self.hidden = torch.zeros(
            self.max_bs, model.config.hidden_size, dtype=model.activation_dtype, device=device
        )

    def _prepare_capture(self) -> None:
        self.attn_backend.init_graph_state(self.max_bs, self.max_bs)

    def bucket_size(self, fb: ForwardBatch) -> int:
        return fb.batch_size

    def _synthetic_batch(self, bs: int, lora: bool) -> ForwardBatch:
        """A batch of `bs` padded requests: what capture stages through `fill_from` (`lora`:
        with base-model adapter slots, so the graph holds the adapters' work)."""
        zeros = torch.zeros(bs, dtype=torch.int64, device=self.device)
        seq_lens = torch.full((bs,), self.fill_value, dtype=torch.int64, device=self.device)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=zeros,
            req_pool_indices=zeros,
            seq_lens=seq_lens,
            out_cache_loc=zeros,
            positions=zeros,
            seq_lens_cpu=seq_lens.cpu() if self.registry.has_slot("seq_lens_cpu") else None,
            lora_slots=zeros.to(torch.int32) if lora else None,
        )

    def _stage_decode(
        self, fb: ForwardBatch, bs: int, padded: int
    ) -> tuple[ForwardBatch, FillStats]:
        """DECODE has one token per request: both axes pad from `bs` to `padded`."""
        return self._stage(
            fb, raw_bs=bs, padded_bs=padded, raw_num_tokens=bs, padded_num_tokens=padded
        )

    def _compile_one(self, bs: int) -> None:
        """Whole-step graphs (`compiled_step`): compile (or load) every (LoRA, KV) bucket of
        batch size `bs` from the bucket's buffer views, unfilled: nothing is written or run."""
        if not self.factory.whole_steps:
            super()._compile_one(bs)
            return
        keys = [(lora, kv) for lora in self.lora_variants for kv in self.kv_buckets]
        try:
            for lora, kv in keys:
                graph = self.factory.new(whole_step=True)
                graph.compile(self._bucket_call(bs, kv, lora, stage=False))
                self._compiled[(bs, lora, kv)] = graph
        except BaseException:  # all or none: the bucket runs eagerly
            for lora, kv in keys:
                self._compiled.pop((bs, lora, kv), None)
            raise
        if self.factory.store_only:
            self._check_in_worker(bs)

    def _check_in_worker(self, bs: int) -> None:
        """In the compile worker, where no step runs: each LoRA variant's smallest KV bucket,
        if compiled here, checked as a capture checks it (the eager step under the capture
        rules, the outputs compared) and so marked in the store: the server's capture of it
        then runs the eager step without the rules' slow mode, under its step lock. A failed
        check drops the saved step (the server's capture would drop it too)."""
        kv = min(self.kv_buckets)
        for lora in self.lora_variants:
            graph = self._compiled.get((bs, lora, kv))
            if isinstance(graph, StepCompiledGraph) and graph.compiled:
                try:
                    graph.capture(self._bucket_call(bs, kv, lora, stage=True))
                except Exception as e:  # any failure: the server's capture checks it again
                    log.warning("compiled step failed its check", bs=bs, kv=kv, error=str(e))

    def all_saved(self) -> bool:
        """Whether every whole step this runner compiles is saved already (a restart: the
        capture only loads them). Sets up the backend's graph buffers (as a capture does)."""
        store = self.factory.store
        if store is None or not self.factory.whole_steps:
            return False
        self._prepare_capture()
        return all(
            store.has(call.tag, call.key())
            for bs in self.buckets
            for lora in self.lora_variants
            for call in (self._bucket_call(bs, kv, lora, stage=False) for kv in self.kv_buckets)
        )

    def _capture_one(self, bs: int) -> None:
        """Every (LoRA, KV) bucket of batch size `bs`; all or none (a failure fails the
        batch-size bucket, whose batches then run eagerly). Largest first, so on CUDA the
        smaller graphs reuse its memory; where twins are free (compiled) smallest first, and the
        larger KV buckets are captured as its twins (no run at up to max_context_len keys).
        Whole compiled steps: smallest first too; the first is checked against the eager step
        (the cheapest one), the others against its output, and a step waiting for the lock
        runs between two of them."""
        graphs: dict[tuple[bool, int], _Captured] = {}
        whole = self.factory.whole_steps
        twins = self.factory.shares_twin_captures
        for lora in self.lora_variants:
            first: Graph | None = None
            reference: torch.Tensor | None = None  # a whole step's eager output, checked once
            for kv in sorted(self.kv_buckets, reverse=not (twins or whole)):
                if whole and first is not None:
                    self.let_steps_in()
                call = self._bucket_call(bs, kv, lora, stage=True)
                compiled = self._compiled.pop((bs, lora, kv), None)
                graph = compiled or self.factory.new(whole_step=True)
                if twins and first is not None:
                    graph.capture_twin(call, first)
                elif isinstance(graph, StepCompiledGraph):
                    graph.capture(call, reference)
                    reference = graph.reference
                else:
                    graph.capture(call)
                first = first or graph
                graphs[lora, kv] = _Captured(graph, call.args[2], call.args[2].attn_metadata)
        self.captured[bs] = graphs

    def _bucket_call(self, bs: int, kv: int, lora: bool, *, stage: bool) -> StepCall:
        """The step of bucket (`bs`, `kv`, with LoRA or not) over its static buffers. `stage`:
        fill them as a replay of `bs` padded requests does (the capture); off, only their views
        (the compile phase, which must not write buffers a running step reads)."""
        template = self._synthetic_batch(bs, lora)
        if stage:
            view, _ = self._stage_decode(template, bs, bs)
        else:
            view = self.registry.extract_buffer(
                padded_bs=bs, padded_num_tokens=bs, forward_batch_template=template
            )
        self.check_decode_bucket(bs, view)
        if stage:
            view.attn_metadata = self.attn_backend.init_forward_metadata_capture(bs, bs, view, kv)
        else:
            view.attn_metadata = self.attn_backend.bind_graph_metadata(bs, bs, view, kv)
        out = self.hidden[:bs]
        args = (self.model, self.attn_backend, view, self.future_tokens, out)
        tag = f"decode-bs{bs}-kv{kv}" + ("-lora" if lora else "")
        return StepCall(decode_step, args, out, tag)

    def check_decode_bucket(self, bs: int, view: ForwardBatch) -> None:
        """The precondition of a capture: a DECODE batch (one token per request) within the
        largest bucket."""
        if not view.forward_mode.is_decode() or view.num_tokens != bs:
            raise GraphCaptureUnsupportedError(
                f"DECODE graphs capture DECODE batches only "
                f"(got {view.forward_mode.name} with bs={bs}, num_tokens={view.num_tokens})"
            )
        if bs > self.max_bs:
            raise ValueError(f"bucket bs={bs} exceeds max_bs={self.max_bs}")

    def graphs_per_bucket(self) -> int:
        return len(self.kv_buckets) * len(self.lora_variants)

    def fallback_reason(self, fb: ForwardBatch) -> str | None:
        if self.attn_backend.graph_capture_refusal() is not None:
            return "backend_unsupported"
        return super().fallback_reason(fb)

    def replay(self, fb: ForwardBatch) -> RunnerOutput:
        bs = fb.batch_size
        padded = self.replay_size(fb)  # a larger bucket when the fitting one failed
        assert padded is not None and padded in self.captured
        bounded = self.attn_backend.graph_kv_bounded
        kv = kv_bucket(fb.seq_len_bound, self.max_context_len) if bounded else 0
        captured = self.captured[padded][fb.lora_slots is not None, kv]
        view, stats = self._stage_decode(fb, bs, padded)
        self.attn_backend.init_forward_metadata_replay(
            captured.attn_metadata, padded, view, seq_lens_cpu=view.seq_lens_cpu
        )
        captured.graph.replay()
        # The head runs on the real rows only; the hidden buffer is consumed right here.
        logits = self.model.compute_logits(self.hidden[:bs], fb)
        return RunnerOutput(
            logits=logits,
            path="full_graph",
            padded_batch_size=padded,
            padded_num_tokens=padded,
            fill_registry=GRAPH_DECODE,
            fill_stats=stats,
            hidden=self.hidden[:bs],
        )
