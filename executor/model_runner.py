"""Run one completed, on-device ForwardBatch through the model: logits of each request's last token.

This is the eager path. By default it stages the batch through an eager input registry
(:mod:`executor.eager_inputs`) so the model reads registry buffers, as it will under the
graph runners; `eager_input_no_copy` skips that copy and runs on the batch's own tensors.
Later paths (full graph, piecewise graph) plug in here behind the same `forward`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from attention.base import AttentionBackend
from executor.eager_inputs import EagerInputs
from executor.forward_batch import ForwardBatch
from executor.models.llama import LlamaForCausalLM
from registry import FillStats


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [bs, vocab] float32, on the device
    path: str  # eager | eager_no_copy | full_graph | piecewise
    padded_batch_size: int
    padded_num_tokens: int
    fill_registry: str | None = None  # eager_decode | eager_extend; None if nothing was staged
    fill_stats: FillStats = field(default_factory=FillStats)


class ModelRunner:
    """Picks the path for a batch and runs it. Not thread-safe: one thread owns the device.

    `eager_input_no_copy` is a plain attribute so a runtime toggle can flip it between
    two batches; the next batch takes the new path.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        attn_backend: AttentionBackend,
        *,
        device: torch.device,
        needs_cpu_seq_lens: bool,
        eager_input_no_copy: bool = False,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.eager_input_no_copy = eager_input_no_copy
        self.eager_inputs = EagerInputs(device, needs_cpu_seq_lens=needs_cpu_seq_lens)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> RunnerOutput:
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
        hidden = self.model.forward(
            view.input_ids, view.positions, view, self.attn_backend, view.input_embeds
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
