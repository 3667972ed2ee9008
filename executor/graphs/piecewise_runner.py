"""Piecewise-graph EXTEND: the model body captured in pieces, attention run eagerly between them.

The model builds its own pieces (`DecoderModel.pieces`: piece 0 is the embedding and layer
0's pre-attention half, piece i layer i-1's post half and layer i's pre half, piece L the
last post half and the final norm). Each piece is captured per token-count bucket; between pieces the
attention backend runs eagerly on the real (unpadded) tokens with metadata from the real
batch, so padded tokens never reach the KV cache. The token fields are padded through
`build_prefill_registry` (all ZERO: a padded token is token 0 at position 0), and the LM
head runs outside on each request's last real token.

With LoRA on, each bucket's pieces are captured twice: without LoRA (base rows only) and
with the adapters (reading the registry's per-token `lora_slots`, padded with 0, the base).

Every bucket shares one set of maximum-size activation buffers (q, k, v, residual, attention
output, hidden): replays run one at a time and each piece finishes with the buffers it
consumed before writing them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from attention.base import AttentionBackend
from executor.core.forward_batch import ForwardBatch, ForwardMode
from executor.core.names import GRAPH_EXTEND
from executor.core.runner_output import RunnerOutput
from executor.graphs.bucket_runner import BucketGraphRunner
from executor.graphs.factory import GraphFactory
from executor.graphs.graph import Graph
from executor.models.decoder_model import DecoderModel, PieceBuffers
from ops.future_tokens import resolve_future_tokens
from registry import FillStats, build_prefill_registry


class PiecewiseGraphRunner(BucketGraphRunner[dict[bool, list[Graph]]]):
    kind = "piecewise"

    def __init__(
        self,
        model: DecoderModel,
        attn_backend: AttentionBackend,
        *,
        device: torch.device,
        buckets: list[int],
        max_bs: int,
        factory: GraphFactory,
        future_tokens: torch.Tensor | None = None,
    ) -> None:
        super().__init__(model, attn_backend, device=device, buckets=buckets, factory=factory)
        # The future-token table: piece 0 gathers referenced tokens from it.
        self.future_tokens = future_tokens
        self.max_tokens = buckets[-1]
        self.lora_variants = (False, True) if model.lora is not None else (False,)
        self.registry = build_prefill_registry(
            device=device,
            max_bs=max_bs,
            max_num_tokens=self.max_tokens,
            enable_num_token_non_padded=True,
            register_lora_slots=model.lora is not None,
        )
        self.acts: PieceBuffers = model.piece_buffers(self.max_tokens, device)

    def bucket_size(self, fb: ForwardBatch) -> int:
        return fb.num_tokens

    def _stage_tokens(
        self, fb: ForwardBatch, num_tokens: int, padded: int
    ) -> tuple[ForwardBatch, FillStats]:
        """EXTEND pads the token axis only; the requests stay as they are."""
        return self._stage(
            fb,
            raw_bs=fb.batch_size,
            padded_bs=fb.batch_size,
            raw_num_tokens=num_tokens,
            padded_num_tokens=padded,
        )

    def _pieces(self, n: int, view: ForwardBatch) -> list[Callable[[], None]]:
        """The model's L + 1 pieces of an `n`-token bucket over the static buffers."""
        input_ids, positions = view.input_ids, view.positions
        assert input_ids is not None and positions is not None

        def ids() -> torch.Tensor:
            if self.future_tokens is None:
                return input_ids
            return resolve_future_tokens(input_ids, self.future_tokens)  # in piece 0

        return self.model.pieces(n, ids, positions, self.acts, view.lora_slots)

    def _synthetic_batch(self, n: int, lora: bool) -> ForwardBatch:
        zeros = torch.zeros(n, dtype=torch.int64, device=self.device)
        one = torch.ones(1, dtype=torch.int64, device=self.device)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=zeros,
            req_pool_indices=torch.zeros(1, dtype=torch.int64, device=self.device),
            seq_lens=one * n,
            out_cache_loc=zeros,
            positions=zeros,
            extend_prefix_lens=one * 0,
            extend_seq_lens=one * n,
            extend_start_loc=one * 0,
            lora_slots=zeros.to(torch.int32) if lora else None,
        )

    def graphs_per_bucket(self) -> int:
        return (len(self.model.decoder_layers) + 1) * len(self.lora_variants)

    def _capture_one(self, n: int) -> None:
        variants: dict[bool, list[Graph]] = {}
        for lora in self.lora_variants:
            view, _ = self._stage_tokens(self._synthetic_batch(n, lora), n, n)
            graphs = []
            for piece in self._pieces(n, view):
                graph = self.factory.new()
                graph.capture(piece)
                graphs.append(graph)
            variants[lora] = graphs
        self.captured[n] = variants

    def replay(self, fb: ForwardBatch) -> RunnerOutput:
        n = fb.num_tokens
        padded = self.replay_size(fb)  # a larger bucket when the fitting one failed
        assert padded is not None and padded in self.captured
        _, stats = self._stage_tokens(fb, n, padded)
        # Attention plans and runs on the real batch: real shapes, real slots only.
        real = dataclasses.replace(fb, attn_metadata=self.attn_backend.init_forward_metadata(fb))
        graphs, a = self.captured[padded][fb.lora_slots is not None], self.acts
        graphs[0].replay()
        for layer_id, graph in enumerate(graphs[1:]):
            out = self.attn_backend.forward(a.q[:n], a.k[:n], a.v[:n], layer_id, real)
            # The padded tail keeps finite values (zeros, or an earlier step's); every op in a
            # piece is row-wise, so padded rows never influence real ones.
            a.attn_out[:n].copy_(out)
            graph.replay()
        logits = self.model.compute_logits(a.hidden[:n], fb)
        return RunnerOutput(
            logits=logits,
            path="piecewise",
            padded_batch_size=fb.batch_size,
            padded_num_tokens=padded,
            fill_registry=GRAPH_EXTEND,
            fill_stats=stats,
            hidden=a.hidden[:n],
        )
