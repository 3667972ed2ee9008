"""The extra outputs computed on the device after the forward, and their host assembly.

`compute` returns device tensors that travel in the step's one host transfer (the sampler
packs them with the tokens); `assemble` turns their host copies into Ragged results.
MEAN pooling keeps a running float32 sum per row (`PooledSums`), written after the step
succeeded, like every other last act of a step; its host counts change when the step is
staged (`executor.extras.feature`), so the next batch's admission sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.core.extras_types import ExtraOutputs, Ragged
from executor.core.runner_output import RunnerOutput
from executor.extras.plan import OutputsPlan, StagedOutputs
from executor.models.decoder_model import DecoderModel


class PooledSums:
    """Per row: the float32 sum of the hidden states MEAN pooling has added (device) and how
    many tokens it holds (host). A released row's count drops to 0; its sum restarts."""

    def __init__(self, max_reqs: int, hidden_size: int, device: torch.device) -> None:
        self.sums = torch.zeros((max_reqs + 1, hidden_size), dtype=torch.float32, device=device)
        self.counts = np.zeros(max_reqs + 1, dtype=np.int64)


@dataclass
class Computed:
    tensors: list[torch.Tensor]  # device, in `assemble`'s order
    mean_rows: torch.Tensor | None = None  # device rows whose pooled sums change
    mean_sums: torch.Tensor | None = None


def compute(
    plan: OutputsPlan,
    ran: RunnerOutput,
    model: DecoderModel,
    staged: StagedOutputs,
    input_ids: torch.Tensor | None,
    req_pool_indices: torch.Tensor,
    pooled: PooledSums,
) -> Computed:
    out: list[torch.Tensor] = []
    if len(plan.prompt_tokens):
        assert ran.hidden is not None and input_ids is not None
        at, value = _need(staged.prompt_target_at), _need(staged.prompt_target_value)
        hs = ran.hidden.index_select(0, _need(staged.prompt_tokens))
        logp = torch.log_softmax(model.logits_of(hs), dim=-1)
        targets = torch.where(value >= 0, value, input_ids.long().index_select(0, at.clamp(min=0)))
        out.append(logp.gather(1, targets.unsqueeze(1)).squeeze(1))
        if plan.top_k:
            top_vals, top_ids = logp.topk(plan.top_k, dim=-1)
            out += [top_vals, top_ids]
    if len(plan.score_ids):
        logp = torch.log_softmax(ran.logits.index_select(0, _need(staged.score_positions)), -1)
        out.append(logp.gather(1, _need(staged.score_ids).unsqueeze(1)).squeeze(1))
    computed = Computed(out)
    if plan.hidden is not None:
        _hidden(plan, ran, model.config.num_layers, staged, req_pool_indices, pooled, computed)
    if len(plan.routed_tokens):
        assert ran.routed is not None, "a batch asking routed experts runs eagerly"
        computed.tensors.append(ran.routed.index_select(0, _need(staged.routed_tokens)))
    return computed


def _need(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None, "staged with the plan"
    return t


def _hidden(
    plan: OutputsPlan,
    ran: RunnerOutput,
    num_layers: int,
    staged: StagedOutputs,
    req_pool_indices: torch.Tensor,
    pooled: PooledSums,
    computed: Computed,
) -> None:
    h = plan.hidden
    assert h is not None and ran.hidden is not None
    layers = _need(staged.hidden_layers)
    flags = _need(staged.hidden_flags)
    mean = (flags & 1).bool().unsqueeze(1)
    restart = (flags & 2).bool().unsqueeze(1)
    rows = req_pool_indices.long().index_select(0, _need(staged.hidden_positions))
    n, size = len(h.positions), ran.hidden.shape[1]
    result = torch.zeros((n, size), dtype=torch.float32, device=ran.hidden.device)
    sums = torch.zeros_like(result)
    for layer in sorted(set(h.layers)):
        src = (ran.hidden if layer == num_layers else ran.layers[layer]).float()
        last = src.index_select(0, _need(staged.last_token))
        this = (layers == layer).unsqueeze(1)
        if h.mean.any():
            acc = torch.zeros_like(result).index_add_(
                0, _need(staged.mean_of), src.index_select(0, _need(staged.mean_tokens))
            )
            sums = torch.where(this, acc, sums)
        result = torch.where(this, last, result)
    if h.mean.any():
        total = sums + torch.where(restart, 0.0, pooled.sums.index_select(0, rows))
        count = _need(staged.hidden_counts).unsqueeze(1).float()
        result = torch.where(mean, total / count, result)
        computed.mean_rows = rows
        computed.mean_sums = torch.where(mean, total, pooled.sums.index_select(0, rows))
    computed.tensors.append(result.to(torch.bfloat16) if h.bfloat16 else result)


def finish(computed: Computed, pooled: PooledSums) -> None:
    """After the step succeeded: the pooled sums of MEAN rows (their counts were set when the
    step was staged)."""
    if computed.mean_rows is not None and computed.mean_sums is not None:
        pooled.sums.index_copy_(0, computed.mean_rows, computed.mean_sums)


def assemble(plan: OutputsPlan, host: list[torch.Tensor]) -> ExtraOutputs:
    """The Ragged results from the host copies of `compute`'s tensors."""
    out = ExtraOutputs()
    it = iter(host)
    if len(plan.prompt_tokens):
        lengths = torch.from_numpy(plan.prompt_lengths)
        out.prompt_logprobs = Ragged(next(it), lengths)
        if plan.top_k:
            out.prompt_top_logprobs = Ragged(next(it), lengths)
            out.prompt_top_logprob_ids = Ragged(next(it), lengths)
    if len(plan.score_ids):
        out.token_scores = Ragged(next(it), torch.from_numpy(plan.score_lengths))
    if plan.hidden is not None:
        out.hidden_states = Ragged(next(it), torch.from_numpy(plan.hidden_lengths))
    if len(plan.routed_tokens):
        out.routed_experts = Ragged(next(it), torch.from_numpy(plan.routed_lengths))
    return out
