"""Admitting a batch's extra-output asks: every rule and byte cap, and the step's work, on the
host. :func:`plan_outputs` changes nothing; None when no row asks anything."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.core.extras_types import Pooling, RowOutputs
from executor.core.forward_batch import ForwardBatch
from executor.core.limits import BatchLimits, routed_expert_bytes_per_token
from ops.h2d_staging import StagedField

PREFIX = "extras."  # a label of the staged layout (ops.h2d_staging)


@dataclass(frozen=True)
class HiddenPlan:
    """One hidden-state output per asking row, in batch order."""

    positions: np.ndarray  # [h] batch positions
    layers: tuple[int, ...]  # [h] output_hidden_states index (num_layers: the final)
    last_token: np.ndarray  # [h] token index of the row's last token (LAST)
    mean: np.ndarray  # [h] bool
    restart: np.ndarray  # [h] bool: MEAN from this batch's tokens only (nothing pooled yet)
    mean_tokens: np.ndarray  # [p] token indices pooled this step
    mean_of: np.ndarray  # [p] which output (0..h-1) each belongs to
    new_counts: np.ndarray  # [h] tokens pooled after this step (MEAN)
    bfloat16: bool  # every asking row wants bfloat16


@dataclass(frozen=True)
class OutputsPlan:
    prompt_tokens: np.ndarray  # [n] token index whose logits score a prompt token
    prompt_target_at: np.ndarray  # [n] index of the scored token in the batch, or -1
    prompt_target_value: np.ndarray  # [n] the scored token when it is next_prompt_token, or -1
    prompt_lengths: np.ndarray  # [bs] int32
    top_k: int
    score_positions: np.ndarray  # [m] batch positions (their sampled logits)
    score_ids: np.ndarray  # [m]
    score_lengths: np.ndarray  # [bs] int32
    hidden: HiddenPlan | None
    hidden_lengths: np.ndarray  # [bs] int32
    rows: np.ndarray  # [bs] the batch's rows (for the pooled counts)
    routed_tokens: np.ndarray  # [r] token indices whose routed experts come back
    routed_lengths: np.ndarray  # [bs] int32

    def staged_arrays(self) -> list[tuple[str, np.ndarray]]:
        """The int64 host arrays the step stages, each by its `StagedOutputs` field name, in
        a fixed order; empty ones are left out."""
        arrays = [
            ("prompt_tokens", self.prompt_tokens),
            ("prompt_target_at", self.prompt_target_at),
            ("prompt_target_value", self.prompt_target_value),
            ("score_positions", self.score_positions),
            ("score_ids", self.score_ids),
            ("routed_tokens", self.routed_tokens),
        ]
        if self.hidden is not None:
            h = self.hidden
            arrays += [
                ("hidden_positions", h.positions),
                ("last_token", h.last_token),
                ("mean_tokens", h.mean_tokens),
                ("mean_of", h.mean_of),
                ("hidden_layers", np.asarray(h.layers, dtype=np.int64)),
                ("hidden_flags", h.mean.astype(np.int64) | (h.restart.astype(np.int64) << 1)),
                ("hidden_counts", np.maximum(h.new_counts, 1)),
            ]
        return [(name, value) for name, value in arrays if len(value)]

    def staged_fields(self) -> list[StagedField]:
        return [
            StagedField(PREFIX + name, torch.from_numpy(value), torch.int64)
            for name, value in self.staged_arrays()
        ]


@dataclass(frozen=True)
class StagedOutputs:
    """The device copies of an `OutputsPlan`'s staged arrays (None: empty, not staged)."""

    prompt_tokens: torch.Tensor | None = None
    prompt_target_at: torch.Tensor | None = None
    prompt_target_value: torch.Tensor | None = None
    score_positions: torch.Tensor | None = None
    score_ids: torch.Tensor | None = None
    routed_tokens: torch.Tensor | None = None
    hidden_positions: torch.Tensor | None = None
    last_token: torch.Tensor | None = None
    mean_tokens: torch.Tensor | None = None
    mean_of: torch.Tensor | None = None
    hidden_layers: torch.Tensor | None = None
    hidden_flags: torch.Tensor | None = None
    hidden_counts: torch.Tensor | None = None

    @classmethod
    def of(cls, plan: OutputsPlan, staged: Sequence[torch.Tensor]) -> StagedOutputs:
        names = [name for name, _ in plan.staged_arrays()]
        return cls(**dict(zip(names, staged, strict=True)))


def plan_outputs(
    fb: ForwardBatch,
    limits: BatchLimits,
    *,
    num_layers: int,
    pooled: np.ndarray,
    tp_size: int,
) -> OutputsPlan | None:
    """`fb` validated and completed; `pooled[row]` the tokens MEAN pooling has summed at each
    row (releases of this batch not applied yet)."""
    if not fb.row_outputs:
        if fb.prompt_top_logprobs_num:
            _check_top(fb, limits)
        return None
    if fb.forward_mode.is_verify() or fb.forward_mode.is_idle():
        raise BatchValidationError("row_outputs", "is for EXTEND and DECODE batches only")
    _check_top(fb, limits)
    bs = fb.batch_size
    rows = fb.req_pool_indices.numpy().astype(np.int64)
    position_of = {int(r): i for i, r in enumerate(rows.tolist())}
    extend = fb.forward_mode.is_extend()
    if extend:
        assert fb.extend_prefix_lens_cpu is not None and fb.extend_seq_lens_cpu is not None
        prefix = np.asarray(fb.extend_prefix_lens_cpu, dtype=np.int64)
        lens = np.asarray(fb.extend_seq_lens_cpu, dtype=np.int64)
    else:
        prefix = fb.seq_lens.numpy().astype(np.int64) - 1
        lens = np.ones(bs, dtype=np.int64)
    start = np.cumsum(lens) - lens
    released = (
        fb.released_req_pool_indices.numpy().astype(np.int64)
        if fb.released_req_pool_indices is not None
        else np.zeros(0, dtype=np.int64)
    )
    vocab = limits.vocab_size
    seen: set[int] = set()
    prompt_tokens: list[np.ndarray] = []
    target_at: list[np.ndarray] = []
    target_value: list[np.ndarray] = []
    prompt_lengths = np.zeros(bs, dtype=np.int32)
    score_pos: list[int] = []
    score_ids: list[int] = []
    score_lengths = np.zeros(bs, dtype=np.int32)
    hidden_asks: list[tuple[int, RowOutputs]] = []
    routed_tokens: list[np.ndarray] = []
    routed_lengths = np.zeros(bs, dtype=np.int32)
    for k, ask in enumerate(fb.row_outputs):
        name = f"row_outputs[{k}]"
        i = position_of.get(ask.row)
        if i is None:
            raise BatchValidationError(
                name + ".req_pool_index", f"row {ask.row} is not a row of this batch"
            )
        if ask.row in seen:
            raise BatchValidationError(name + ".req_pool_index", f"row {ask.row} is asked twice")
        seen.add(ask.row)
        if ask.prompt_logprobs:
            if not extend:
                raise BatchValidationError(name + ".prompt_logprobs", "is for EXTEND batches only")
            if tp_size > 1:
                raise BatchValidationError(name + ".prompt_logprobs", "needs tp_size 1")
            nxt = ask.next_prompt_token
            if nxt is not None and not 0 <= nxt < vocab:
                raise BatchValidationError(
                    name + ".next_prompt_token", f"must be in 0..{vocab - 1}, got {nxt}"
                )
            first = max(ask.logprob_start_len, 1) - 1  # the first position whose logits count
            end = int(prefix[i] + lens[i]) - (1 if nxt is None else 0)
            pos = np.arange(max(int(prefix[i]), first), end, dtype=np.int64)
            t = start[i] + pos - prefix[i]
            last = pos == prefix[i] + lens[i] - 1
            prompt_tokens.append(t)
            target_at.append(np.where(last, -1, t + 1))
            target_value.append(np.where(last, -1 if nxt is None else nxt, -1))
            prompt_lengths[i] = len(pos)
        if ask.score_token_ids:
            ids = ask.score_token_ids
            if len(ids) > limits.max_score_token_ids:
                raise BatchTooLargeError(
                    name + ".score_token_ids",
                    f"has {len(ids)} entries; must be <= max_score_token_ids ({limits.max_score_token_ids})",
                )
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise BatchValidationError(
                    name + ".score_token_ids", f"token id {bad[0]} is not in 0..{vocab - 1}"
                )
            score_pos.extend([i] * len(ids))
            score_ids.extend(ids)
            score_lengths[i] = len(ids)
        if ask.hidden is not None:
            layer = ask.hidden.layer
            if layer is not None and not 0 <= layer <= num_layers:
                raise BatchValidationError(
                    name + ".hidden.layer", f"must be in 0..{num_layers}, got {layer}"
                )
            hidden_asks.append((i, ask))
        if ask.routed_experts:
            if not limits.routed_expert_layers:
                raise BatchValidationError(
                    name + ".routed_experts", "the model has no mixture-of-experts layers"
                )
            routed_tokens.append(np.arange(start[i], start[i] + lens[i], dtype=np.int64))
            routed_lengths[i] = lens[i]
    hidden = _hidden_plan(hidden_asks, rows, prefix, lens, start, released, pooled, num_layers)
    hidden_lengths = np.zeros(bs, dtype=np.int32)
    if hidden is not None:
        hidden_lengths[hidden.positions] = 1
    top = fb.prompt_top_logprobs_num
    prompt_bytes = int(prompt_lengths.sum()) * (4 + 12 * top)
    hidden_bytes = (
        0
        if hidden is None
        else len(hidden.positions) * limits.hidden_size * (2 if hidden.bfloat16 else 4)
    )
    _cap(
        "row_outputs.prompt_logprobs",
        prompt_bytes,
        limits.max_prompt_logprob_bytes,
        "max_prompt_logprob_bytes",
    )
    _cap("row_outputs.hidden", hidden_bytes, limits.max_hidden_bytes, "max_hidden_bytes")
    routed_bytes = int(routed_lengths.sum()) * routed_expert_bytes_per_token(limits)
    _cap(
        "row_outputs.routed_experts",
        routed_bytes,
        limits.max_routed_expert_bytes,
        "max_routed_expert_bytes",
    )
    total = prompt_bytes + hidden_bytes + routed_bytes + 4 * len(score_ids)
    _cap("row_outputs", total, limits.max_output_bytes, "max_output_bytes")
    i64 = np.int64

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(i64) if parts else np.zeros(0, dtype=i64)

    return OutputsPlan(
        prompt_tokens=cat(prompt_tokens),
        prompt_target_at=cat(target_at),
        prompt_target_value=cat(target_value),
        prompt_lengths=prompt_lengths,
        top_k=top,
        score_positions=np.asarray(score_pos, dtype=i64),
        score_ids=np.asarray(score_ids, dtype=i64),
        score_lengths=score_lengths,
        hidden=hidden,
        hidden_lengths=hidden_lengths,
        rows=rows,
        routed_tokens=cat(routed_tokens),
        routed_lengths=routed_lengths,
    )


def _check_top(fb: ForwardBatch, limits: BatchLimits) -> None:
    k = fb.prompt_top_logprobs_num
    if not 0 <= k <= limits.max_top_logprobs:
        raise BatchValidationError(
            "prompt_top_logprobs_num",
            f"must be in 0..max_top_logprobs ({limits.max_top_logprobs}), got {k}",
        )


def _cap(field: str, size: int, cap: int, name: str) -> None:
    if size > cap:
        raise BatchTooLargeError(field, f"would return {size} bytes; must be <= {name} ({cap})")


def _hidden_plan(
    asks: list[tuple[int, RowOutputs]],
    rows: np.ndarray,
    prefix: np.ndarray,
    lens: np.ndarray,
    start: np.ndarray,
    released: np.ndarray,
    pooled: np.ndarray,
    num_layers: int,
) -> HiddenPlan | None:
    if not asks:
        return None
    positions, layers, last, mean, restart, counts = [], [], [], [], [], []
    mean_tokens: list[int] = []
    mean_of: list[int] = []
    for j, (i, ask) in enumerate(asks):
        assert ask.hidden is not None
        positions.append(i)
        layers.append(num_layers if ask.hidden.layer is None else ask.hidden.layer)
        last.append(int(start[i] + lens[i] - 1))
        is_mean = ask.hidden.pooling is Pooling.MEAN
        mean.append(is_mean)
        held = 0 if int(rows[i]) in released else int(pooled[rows[i]])
        if is_mean:
            if held != prefix[i]:
                raise BatchValidationError(
                    f"row_outputs[{j}].hidden.pooling",
                    f"MEAN pools every token of the request: row {int(rows[i])} has {held} pooled "
                    f"but its prefix is {int(prefix[i])} (ask MEAN in every batch of the request)",
                )
            mean_tokens.extend(range(int(start[i]), int(start[i] + lens[i])))
            mean_of.extend([j] * int(lens[i]))
        restart.append(held == 0)
        counts.append(int(prefix[i] + lens[i]))
    return HiddenPlan(
        positions=np.asarray(positions, dtype=np.int64),
        layers=tuple(layers),
        last_token=np.asarray(last, dtype=np.int64),
        mean=np.asarray(mean, dtype=bool),
        restart=np.asarray(restart, dtype=bool),
        mean_tokens=np.asarray(mean_tokens, dtype=np.int64),
        mean_of=np.asarray(mean_of, dtype=np.int64),
        new_counts=np.asarray(counts, dtype=np.int64),
        bfloat16=all(a.hidden is not None and a.hidden.bfloat16 for _, a in asks),
    )
