"""`DecoderModel`: the seam between a model family and everything that runs or loads it.

The runners, the graph code and the loaders type against this class; a family subclasses
it, builds its layers (`make_layer`) and carries its checkpoint-name tables beside it:

- `FUSED_LINEARS`: each fused linear of a layer (its module path) and the Hugging Face
  projections concatenated into it, in order. Every other parameter loads from the
  checkpoint tensor of its own name (`model.` + its path; `lm_head.weight`), and a module
  with a `checkpoint_targets` method lists its own tensors (grouped expert weights).
- `TP_SPLITS`: Hugging Face name patterns (fnmatch) -> (axis, range) for tensor
  parallelism (`ShardPlan`); a tensor no pattern names is replicated on every rank.
- `GGUF_NAMES`: GGUF layer tensor names -> Hugging Face layer tensor names (`{e}` in the
  value: a stacked expert tensor, one per expert along its first axis);
  `GGUF_PERMUTED_QK`: llama.cpp's converter interleaved the rotary halves of Q and K.

`forward` (the eager and full-graph paths) and `pieces` (the piecewise graph runner) are
both written over the layers' `pre_attention` / `post_attention`, so a family defines its
layer once. Under tensor parallelism (a `ShardPlan` of size > 1) the embedding and LM head
are vocab-parallel; the layers' collectives live in `blocks.DecoderLayer`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from executor.core.forward_batch import ForwardMode
from executor.models.blocks import DecoderLayer, LayerBuild, LayerFns
from executor.models.config import ModelConfig
from executor.models.layers import Embedding, Linear, RMSNorm
from executor.models.lora_layers import LoraBatch
from executor.models.sharding import ShardPlan, SplitRows
from executor.parallel.comm import TpComm
from ops.batch_invariant import tiled_linear
from ops.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from attention.base import AttentionBackend
    from executor.core.forward_batch import ForwardBatch


@dataclass
class PieceBuffers:
    """The static activations the piecewise pieces read and write, at the largest bucket's
    size; a bucket of n tokens uses the first n rows."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hk, D]
    v: torch.Tensor  # [T, Hk, D]
    residual: torch.Tensor  # [T, hidden]
    attn_out: torch.Tensor  # [T, Hq, D], written by eager attention between pieces
    hidden: torch.Tensor  # [T, hidden], the final-normed output


class DecoderModel(nn.Module, ABC):
    """Token ids (or embeddings) in, final hidden states out; `compute_logits` for the head."""

    model_type: ClassVar[str]  # Hugging Face's `model_type`; also `ModelConfig.architecture`
    gguf_architecture: ClassVar[str | None] = None  # GGUF `general.architecture`, if defined
    default_attention_bias: ClassVar[bool] = False  # when config.json does not say
    FUSED_LINEARS: ClassVar[dict[str, tuple[str, ...]]]
    TP_SPLITS: ClassVar[SplitRows]
    GGUF_NAMES: ClassVar[dict[str, str]]
    GGUF_PERMUTED_QK: ClassVar[bool] = False
    # llama.cpp's converter stored every `*norm.weight` plus this (Gemma: 1); the loader
    # subtracts it.
    GGUF_NORM_SHIFT: ClassVar[float] = 0.0
    # A family's hooks around the shared body.
    NORM_CLASS: ClassVar[type[RMSNorm]] = RMSNorm  # the final norm's
    SCALE_EMBEDDINGS: ClassVar[bool] = False  # embeddings times sqrt(hidden_size) (Gemma)

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        plan: ShardPlan | None = None,
        comm: TpComm | None = None,
    ) -> None:
        """Parameters are allocated uninitialized; a loader fills every one of them. With a
        `plan` of size > 1 this is one rank's shard and `comm` its group."""
        super().__init__()
        dd: dict[str, Any] = {"device": device, "dtype": dtype}
        self.config = config
        self.plan = plan or ShardPlan.single(config)
        self.comm = comm or TpComm()
        if self.plan.size != self.comm.size:
            raise ValueError(
                f"shard plan of size {self.plan.size} with a group of size {self.comm.size}"
            )
        self.max_positions = max_positions
        self.activation_dtype = dtype  # of the residual stream, attention and the KV cache
        vocab_rows = self.plan.vocab_per_rank
        # A loader may install a quantized embedding (any module with Embedding's interface).
        self.embed_tokens: nn.Module = Embedding(vocab_rows, config.hidden_size, **dd)
        build = LayerBuild(config, self.plan, self.comm, device, dtype)
        self.layers = nn.ModuleList(self.make_layer(i, build) for i in range(config.num_layers))
        self.norm = self.NORM_CLASS(config.hidden_size, config.rms_norm_eps, **dd)
        # None when tied to the embedding; a loader may install a quantized or packed head
        # (any module with Linear's interface; a packed one also when tied).
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, vocab_rows, False, **dd)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, device=device
        )
        # LoRA (executor.lora attaches the layers' sites): every forward and piece sets the
        # mask of its tokens' adapters first (None: the sites do nothing).
        self.lora: LoraBatch | None = None
        # The dtype the head's matmul runs in (`lm_head_dtype`); None: the activations'.
        self.head_dtype: torch.dtype | None = None
        # batch_invariant: the head's product a fixed number of rows per GEMM call.
        self.tiled_head = False

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Refuse hyper-parameters this family's code does not implement (ValueError); the
        registry asks when a loader builds a config, so a model is refused at start-up."""

    @classmethod
    def hf_config_defaults(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """config.json with what this family defaults when the file leaves it out (a new dict;
        the registry parses the result)."""
        return cfg

    @classmethod
    def gguf_config_defaults(cls, config: ModelConfig) -> ModelConfig:
        """A config read from GGUF metadata, completed with what this family's GGUF files do
        not say (as llama.cpp completes it)."""
        return config

    @abstractmethod
    def make_layer(self, layer_id: int, build: LayerBuild) -> DecoderLayer:
        """Layer `layer_id` of this family, holding this rank's part (`build.plan`)."""

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    @contextmanager
    def using_compiled_fns(self, fns: LayerFns) -> Iterator[None]:
        """Run every layer's halves through `fns` (e.g. compiled) inside the block."""
        previous = [layer.compiled_fns for layer in self.decoder_layers]
        for layer in self.decoder_layers:
            layer.compiled_fns = fns
        try:
            yield
        finally:
            for layer, old in zip(self.decoder_layers, previous, strict=True):
                layer.compiled_fns = old

    def compile_halves(
        self, fns: LayerFns, positions: torch.Tensor, bufs: PieceBuffers, *, pieces: bool
    ) -> None:
        """Call every layer's halves through `fns` once, as `forward` (`pieces` off) or
        `pieces` calls them, on private activations of `positions`' length: compiled
        functions compile (or load their caches) for that shape without reading or writing
        any buffer a step uses (the KV cache, the static graph buffers). Call it inside
        inference mode with `positions` and `bufs` made outside it, as the registry's and
        the pieces' buffers are: dynamo's guards tell the two kinds of tensor apart. The
        model's own functions stay as they are."""
        hidden = torch.zeros_like(bufs.hidden)  # as an embedding's output
        residual: torch.Tensor | None = None
        for layer in self.decoder_layers:
            _, _, _, residual = fns.pre(layer, positions, hidden, residual, self.rotary)
            attn_out, res = (
                (bufs.attn_out, bufs.residual)
                if pieces
                else (torch.zeros_like(bufs.attn_out), residual)
            )
            if self.comm.enabled:  # the two pieces around the all-reduces
                fns.mlp(layer, fns.attn_proj(layer, attn_out), res)
            else:
                fns.post(layer, attn_out, res)

    # --- the body -------------------------------------------------------------------------
    def embed(
        self, input_ids: torch.Tensor | None, input_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        if input_embeds is not None:
            hidden = input_embeds.to(self.activation_dtype)
        else:
            assert input_ids is not None
            hidden = self._embed_ids(input_ids)
        if self.SCALE_EMBEDDINGS:
            scale = self.config.hidden_size**0.5
            hidden = hidden * torch.tensor(scale, dtype=hidden.dtype)
        return hidden

    def _embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.comm.enabled:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: rows outside this rank's range read row 0 and are zeroed, then the
        # ranks' partial embeddings are summed (exactly one rank holds each id).
        local = input_ids - self.plan.vocab_start
        mine = (local >= 0) & (local < self.plan.vocab_per_rank)
        hidden = self.embed_tokens(local * mine) * mine.unsqueeze(-1).to(self.activation_dtype)
        return self.comm.all_reduce_(hidden)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden, residual)[0]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        fb: ForwardBatch,
        attn: AttentionBackend,
        input_embeds: torch.Tensor | None = None,
        keep: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden] for every token of the batch. `keep`:
        its keys are hidden states to record, numbered as transformers' output_hidden_states
        (0 the embeddings, i the residual stream after layer i); filled in place. The
        adapter of each token is `fb.lora_slots`' (None: no LoRA)."""
        if self.lora is not None:
            self.lora.set(fb.lora_slots)
        hidden = self.embed(input_ids, input_embeds)
        if keep is not None and 0 in keep:
            keep[0] = hidden
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.decoder_layers):
            q, k, v, residual = layer.pre_attention(positions, hidden, residual, self.rotary)
            attn_out = attn.forward(q, k, v, layer.layer_id, fb)
            hidden, residual = layer.post_attention(attn_out, residual)
            if keep is not None and i + 1 in keep:
                keep[i + 1] = hidden + residual
        assert residual is not None
        return self.final_norm(hidden, residual)

    def piece_buffers(self, max_tokens: int, device: torch.device) -> PieceBuffers:
        """Zeroed buffers for `pieces`, `max_tokens` rows (this rank's heads)."""
        d, h = self.config.head_dim, self.config.hidden_size
        hq, hk = self.plan.num_heads, self.plan.num_kv_heads
        dd: dict[str, Any] = {"dtype": self.activation_dtype, "device": device}
        return PieceBuffers(
            q=torch.zeros(max_tokens, hq, d, **dd),
            k=torch.zeros(max_tokens, hk, d, **dd),
            v=torch.zeros(max_tokens, hk, d, **dd),
            residual=torch.zeros(max_tokens, h, **dd),
            attn_out=torch.zeros(max_tokens, hq, d, **dd),
            hidden=torch.zeros(max_tokens, h, **dd),
        )

    def pieces(
        self,
        n: int,
        input_ids: Callable[[], torch.Tensor],
        positions: torch.Tensor,
        bufs: PieceBuffers,
        lora_slots: torch.Tensor | None = None,
    ) -> list[Callable[[], None]]:
        """The L + 1 pieces of `forward` for an `n`-token bucket, over `bufs`: piece 0 embeds
        `input_ids()` and runs layer 0's pre half into q/k/v/residual; piece i (1..L-1) runs
        layer i-1's post half on `attn_out` and layer i's pre half; piece L the last post
        half and the final norm into `hidden`. The caller runs attention between pieces.
        `lora_slots`: the tokens' adapter slots (a static buffer), None: no LoRA."""
        layers = self.decoder_layers
        lora = self.lora
        q, k, v = bufs.q[:n], bufs.k[:n], bufs.v[:n]
        residual, attn_out = bufs.residual[:n], bufs.attn_out[:n]

        def write_qkv(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
            q.copy_(out[0])
            k.copy_(out[1])
            v.copy_(out[2])
            residual.copy_(out[3])

        def first() -> None:
            if lora is not None:
                lora.set(lora_slots)
            hidden = self.embed(input_ids(), None)
            write_qkv(layers[0].pre_attention(positions, hidden, None, self.rotary))

        def middle(i: int) -> Callable[[], None]:
            def run() -> None:
                if lora is not None:
                    lora.set(lora_slots)
                hidden, res = layers[i - 1].post_attention(attn_out, residual)
                write_qkv(layers[i].pre_attention(positions, hidden, res, self.rotary))

            return run

        def last() -> None:
            if lora is not None:
                lora.set(lora_slots)
            hidden, res = layers[-1].post_attention(attn_out, residual)
            bufs.hidden[:n].copy_(self.final_norm(hidden, res))

        return [first, *(middle(i) for i in range(1, len(layers))), last]

    def compute_logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Logits of each request's last token, [bs, vocab] float32; VERIFY: of every token,
        [num_tokens, vocab]."""
        if fb.forward_mode is ForwardMode.EXTEND:
            assert fb.extend_start_loc is not None and fb.extend_seq_lens is not None
            hidden = hidden[fb.extend_start_loc + fb.extend_seq_lens - 1]
        return self.logits_of(hidden)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head on final-normed hidden states [n, hidden] -> [n, vocab] float32 (every
        rank of a tensor-parallel group must call it: the vocabulary is gathered)."""
        head = self.head_dtype
        if head is not None and head != hidden.dtype:
            hidden = hidden.to(head)  # the head in `head_dtype`: weights cast as they are read
        linear = tiled_linear if self.tiled_head else F.linear
        if self.lm_head is None:  # tied to a float embedding
            assert isinstance(self.embed_tokens, Embedding)
            logits = linear(hidden, self.embed_tokens.weight.to(hidden.dtype)).float()
        elif isinstance(self.lm_head, Linear):
            w, b = self.lm_head.weight, self.lm_head.bias
            dt = hidden.dtype
            logits = linear(hidden, w.to(dt), None if b is None else b.to(dt)).float()
        else:  # quantized or packed: the module's kernel, float32 hidden states in
            logits = self.lm_head(hidden).float()
        if self.comm.enabled:
            # Vocab-parallel head: every rank's columns, in rank order, minus the padding.
            logits = self.comm.all_gather_last(logits)[:, : self.config.vocab_size]
        attention = self.config.attention
        if attention is not None and attention.final_logit_softcapping is not None:
            cap = attention.final_logit_softcapping
            logits = cap * torch.tanh(logits / cap)
        return logits
