"""Run one completed, on-device ForwardBatch through the model: logits of each request's last token.

This is the eager path. Later paths (registry-staged eager, full graph, piecewise graph)
plug in here behind the same `forward` so the executor never knows which one ran.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attention.base import AttentionBackend
from executor.forward_batch import ForwardBatch
from executor.models.llama import LlamaForCausalLM


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [bs, vocab] float32, on the device
    path: str  # eager | eager_no_copy | full_graph | piecewise
    padded_batch_size: int
    padded_num_tokens: int


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, attn_backend: AttentionBackend) -> None:
        self.model = model
        self.attn_backend = attn_backend

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> RunnerOutput:
        if fb.forward_mode.is_idle():
            logits = torch.empty(
                (0, self.model.config.vocab_size), dtype=torch.float32, device=fb.seq_lens.device
            )
            return RunnerOutput(
                logits=logits, path="eager", padded_batch_size=0, padded_num_tokens=0
            )
        fb = dataclasses.replace(fb, attn_metadata=self.attn_backend.init_forward_metadata(fb))
        assert fb.positions is not None
        hidden = self.model.forward(
            fb.input_ids, fb.positions, fb, self.attn_backend, fb.input_embeds
        )
        logits = self.model.compute_logits(hidden, fb)
        return RunnerOutput(
            logits=logits,
            path="eager",
            padded_batch_size=fb.batch_size,
            padded_num_tokens=fb.num_tokens,
        )
