"""Piecewise-graph EXTEND: the model body captured in pieces, attention run eagerly between them.

Piece 0 is the embedding and layer 0's pre-attention half; piece i (1..L-1) is layer i-1's
post-attention half and layer i's pre-attention half; piece L is the last post-attention
half and the final norm. Each piece is captured per token-count bucket; between pieces the
attention backend runs eagerly on the real (unpadded) tokens with metadata from the real
batch, so padded tokens never reach the KV cache. The token fields are padded through
`build_prefill_registry` (all ZERO: a padded token is token 0 at position 0), and the LM
head runs outside on each request's last real token.

Every bucket shares one set of maximum-size activation buffers (q, k, v, residual, attention
output, hidden): replays run one at a time and each piece finishes with the buffers it
consumed before writing them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attention.base import AttentionBackend
from executor.forward_batch import ForwardBatch, ForwardMode
from executor.graphs.bucket_runner import BucketGraphRunner
from executor.graphs.graph import Graph, GraphFactory
from executor.models.llama import LlamaForCausalLM
from executor.runner_output import RunnerOutput
from ops.future_tokens import resolve_future_tokens
from registry import FillStats, build_prefill_registry

GRAPH_EXTEND = "graph_extend"  # the registry's name in fill metrics


@dataclass
class _Activations:
    """The static buffers the pieces read and write, at the largest bucket's size."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hk, D]
    v: torch.Tensor  # [T, Hk, D]
    residual: torch.Tensor  # [T, hidden]
    attn_out: torch.Tensor  # [T, Hq, D], written by eager attention between pieces
    hidden: torch.Tensor  # [T, hidden], the final-normed output


class PiecewiseGraphRunner(BucketGraphRunner[list[Graph]]):
    kind = "piecewise"

    def __init__(
        self,
        model: LlamaForCausalLM,
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
        self.registry = build_prefill_registry(
            device=device,
            max_bs=max_bs,
            max_num_tokens=self.max_tokens,
            enable_num_token_non_padded=True,
        )
        cfg, plan = model.config, model.plan  # this rank's heads under tensor parallelism
        dd: dict[str, Any] = {"dtype": model.activation_dtype, "device": device}
        t = self.max_tokens
        self.acts = _Activations(
            q=torch.zeros(t, plan.num_heads, cfg.head_dim, **dd),
            k=torch.zeros(t, plan.num_kv_heads, cfg.head_dim, **dd),
            v=torch.zeros(t, plan.num_kv_heads, cfg.head_dim, **dd),
            residual=torch.zeros(t, cfg.hidden_size, **dd),
            attn_out=torch.zeros(t, plan.num_heads, cfg.head_dim, **dd),
            hidden=torch.zeros(t, cfg.hidden_size, **dd),
        )

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
        """The L + 1 captured callables of an `n`-token bucket, over the static buffers."""
        m, a = self.model, self.acts
        layers = m.decoder_layers
        input_ids, positions = view.input_ids, view.positions
        assert positions is not None
        q, k, v, residual, attn_out = a.q[:n], a.k[:n], a.v[:n], a.residual[:n], a.attn_out[:n]

        def write_qkv(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
            q.copy_(out[0])
            k.copy_(out[1])
            v.copy_(out[2])
            residual.copy_(out[3])

        def first() -> None:
            assert input_ids is not None
            ids = input_ids
            if self.future_tokens is not None:  # in piece 0: reads the table's buffer
                ids = resolve_future_tokens(ids, self.future_tokens)
            write_qkv(layers[0].pre_attention(positions, m.embed(ids, None), None, m.rotary))

        def middle(i: int) -> Callable[[], None]:
            def run() -> None:
                hidden, res = layers[i - 1].post_attention(attn_out, residual)
                write_qkv(layers[i].pre_attention(positions, hidden, res, m.rotary))

            return run

        def last() -> None:
            hidden, res = layers[-1].post_attention(attn_out, residual)
            a.hidden[:n].copy_(m.norm(hidden, res)[0])

        return [first, *(middle(i) for i in range(1, len(layers))), last]

    def _synthetic_batch(self, n: int) -> ForwardBatch:
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
        )

    def graphs_per_bucket(self) -> int:
        return len(self.model.decoder_layers) + 1

    def _capture_one(self, n: int) -> None:
        view, _ = self._stage_tokens(self._synthetic_batch(n), n, n)
        graphs = []
        for piece in self._pieces(n, view):
            graph = self.factory.new()
            graph.capture(piece)
            graphs.append(graph)
        self.captured[n] = graphs

    def replay(self, fb: ForwardBatch) -> RunnerOutput:
        n = fb.num_tokens
        padded = self.replay_size(fb)  # a larger bucket when the fitting one failed
        assert padded is not None and padded in self.captured
        _, stats = self._stage_tokens(fb, n, padded)
        # Attention plans and runs on the real batch: real shapes, real slots only.
        real = dataclasses.replace(fb, attn_metadata=self.attn_backend.init_forward_metadata(fb))
        graphs, a = self.captured[padded], self.acts
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
        )
