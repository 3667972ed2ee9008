"""Admitting a batch's controls: every rule checked and the step's work decided on the host.

:func:`admit_controls` reads the batch (its `row_controls`, releases, `vocab_mask`) and the
host mirror of the row state, changes nothing, and returns a :class:`ControlsStep` (or None
when no row of the batch uses any control: the step then does no control work at all).
A refusal is a BatchValidationError naming the field and the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from executor.controls.state import PREFIX, RowControlState, RowValues
from executor.core.controls_types import (
    CONTROL_ROWS,
    MASK_BITS,
    SamplingControls,
    VocabMask,
    check_id_list,
)
from executor.core.errors import BatchValidationError
from executor.core.forward_batch import ForwardBatch
from executor.core.limits import BatchLimits
from ops.h2d_staging import StagedField


@dataclass(frozen=True)
class ControlsStep:
    """What a step does for its controls: the rows it writes (`update`), and the batch
    positions whose logits the rules touch (`positions`, sorted) with the per-position
    step mask (`mask_words`, all ones where a position has none)."""

    update: RowValues | None
    positions: np.ndarray  # [c] int64
    history_len: int  # positions of history the penalties read (max seq_len among them)
    any_penalties: bool = False
    any_bias: bool = False
    any_min_tokens: bool = False
    any_token_mask: bool = False
    mask_words: np.ndarray | None = None  # [c, W] int32
    control_rows: dict[str, int] = field(default_factory=dict)
    effective: _Effective | None = None  # for a deferred mask's checks

    @property
    def acts(self) -> bool:
        return len(self.positions) > 0

    def staged_fields(self) -> list[StagedField]:
        fields = [] if self.update is None else self.update.staged_fields()
        if self.acts:
            fields.append(
                StagedField(PREFIX + "positions", torch.from_numpy(self.positions), torch.int64)
            )
        if self.mask_words is not None:
            fields.append(
                StagedField(PREFIX + "mask", torch.from_numpy(self.mask_words), torch.int32)
            )
        return fields


@dataclass(frozen=True)
class _Effective:
    """The controls each batch position runs with this step (host arrays, [bs])."""

    penalties: np.ndarray
    bias: np.ndarray
    token_mask: np.ndarray
    suppressing: np.ndarray  # min tokens not reached: EOS and stop ids off this step
    seq_lens: np.ndarray
    token_words: np.ndarray  # [bs, W]
    suppress_words: np.ndarray  # [bs, W]


def admit_controls(
    batch: ForwardBatch,
    state: RowControlState,
    limits: BatchLimits,
    eos_token_ids: tuple[int, ...],
) -> ControlsStep | None:
    asks = bool(batch.row_controls) or batch.vocab_mask is not None
    if not asks and batch.deferred_mask is None and not state.any_active:
        return None  # no row anywhere has controls: the usual step, one look
    rows = batch.req_pool_indices.numpy().astype(np.int64, copy=False)
    released = (
        batch.released_req_pool_indices.numpy().astype(np.int64, copy=False)
        if batch.released_req_pool_indices is not None
        else np.zeros(0, dtype=np.int64)
    )
    if (
        not asks
        and batch.deferred_mask is None
        and not state.active[released].any()
        and not state.active[rows].any()
    ):
        return None
    seq_lens = batch.seq_lens.numpy().astype(np.int64, copy=False)
    position_of = {int(r): i for i, r in enumerate(rows.tolist())}
    sets = _check_row_controls(batch, position_of, limits)
    set_rows = np.array(sorted(sets), dtype=np.int64)
    cleared = np.array(
        sorted(set(released[state.active[released]].tolist()) - sets.keys()), dtype=np.int64
    )
    update = _row_values(state, sets, set_rows, cleared, seq_lens, position_of, eos_token_ids)
    eff = _effective(state, rows, released, update, seq_lens)
    mask_words = None
    if batch.vocab_mask is not None:
        mask_words = check_mask(batch.vocab_mask, "vocab_mask", len(rows), state.words)
    return _plan(update, eff, mask_words, state)


def with_deferred_mask(
    step: ControlsStep | None, mask: VocabMask, batch: ForwardBatch, state: RowControlState
) -> ControlsStep:
    """The step's controls once its deferred mask arrived (checked like an inline one)."""
    words = check_mask(mask, "deferred_mask.vocab_mask", batch.batch_size, state.words)
    if step is not None and step.effective is not None:
        eff = step.effective
    else:  # no row used a control at admission: every row runs neutral
        rows = batch.req_pool_indices.numpy().astype(np.int64, copy=False)
        eff = _effective(
            state,
            rows,
            np.zeros(0, dtype=np.int64),
            None,
            batch.seq_lens.numpy().astype(np.int64, copy=False),
        )
    return _plan(None if step is None else step.update, eff, words, state)


def _plan(
    update: RowValues | None,
    eff: _Effective,
    mask_words: np.ndarray | None,
    state: RowControlState,
) -> ControlsStep:
    bs = len(eff.seq_lens)
    masked = np.zeros(bs, dtype=bool) if mask_words is None else (mask_words != -1).any(axis=1)
    touched = eff.penalties | eff.bias | eff.token_mask | eff.suppressing | masked
    positions = np.flatnonzero(touched).astype(np.int64)
    _check_not_empty(eff, mask_words, positions, state.vocab_size)
    used = (eff.penalties, eff.bias, eff.suppressing, eff.token_mask, masked)
    counts = {name: int(u.sum()) for name, u in zip(CONTROL_ROWS, used, strict=True)}
    pen_lens = eff.seq_lens[eff.penalties]
    return ControlsStep(
        update=update,
        positions=positions,
        history_len=int(pen_lens.max()) if len(pen_lens) else 0,
        any_penalties=bool(eff.penalties.any()),
        any_bias=bool(eff.bias.any()),
        any_min_tokens=bool(eff.suppressing.any()),
        any_token_mask=bool(eff.token_mask.any()),
        mask_words=None if not masked.any() or mask_words is None else mask_words[positions],
        control_rows={k: v for k, v in counts.items() if v},
        effective=eff,
    )


def _check_row_controls(
    batch: ForwardBatch, position_of: dict[int, int], limits: BatchLimits
) -> dict[int, SamplingControls]:
    sets: dict[int, SamplingControls] = {}
    for k, rc in enumerate(batch.row_controls):
        name = f"row_controls[{k}]"
        if rc.row not in position_of:
            raise BatchValidationError(
                name + ".req_pool_index", f"row {rc.row} is not a row of this batch"
            )
        if rc.row in sets:
            raise BatchValidationError(
                name + ".req_pool_index", f"row {rc.row} is set twice in one batch"
            )
        check_controls(rc.controls, name + ".controls", limits)
        sets[rc.row] = rc.controls
    return sets


def check_controls(c: SamplingControls, name: str, limits: BatchLimits) -> None:
    """Every value rule of one request's controls (the proto's)."""
    rp = c.repetition_penalty
    if not (math.isfinite(rp) and 0 < rp <= 100):
        raise BatchValidationError(name + ".repetition_penalty", f"must be in (0, 100], got {rp}")
    for attr in ("frequency_penalty", "presence_penalty"):
        v = getattr(c, attr)
        if not (math.isfinite(v) and -2 <= v <= 2):
            raise BatchValidationError(f"{name}.{attr}", f"must be in [-2, 2], got {v}")
    vocab = limits.vocab_size
    if len(c.logit_bias) > limits.max_logit_bias:
        raise BatchValidationError(
            name + ".logit_bias",
            f"has {len(c.logit_bias)} entries; must be <= max_logit_bias ({limits.max_logit_bias})",
        )
    seen: set[int] = set()
    for token, bias in c.logit_bias:
        if not 0 <= token < vocab:
            raise BatchValidationError(
                name + ".logit_bias", f"token id {token} is not in 0..{vocab - 1}"
            )
        if token in seen:
            raise BatchValidationError(name + ".logit_bias", f"token id {token} is given twice")
        seen.add(token)
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise BatchValidationError(
                name + ".logit_bias", f"bias of token {token} must be in [-100, 100], got {bias}"
            )
    for attr in ("min_tokens", "prompt_len"):
        v = getattr(c, attr)
        if not 0 <= v <= limits.max_context_len:
            raise BatchValidationError(
                f"{name}.{attr}",
                f"must be in 0..max_context_len ({limits.max_context_len}), got {v}",
            )
    for attr in ("stop_token_ids", "banned_token_ids", "allowed_token_ids"):
        check_id_list(f"{name}.{attr}", getattr(c, attr), vocab, limits.max_control_token_ids)


def _bits(ids: tuple[int, ...], words: int) -> np.ndarray:
    out = np.zeros(words, dtype=np.uint32)
    if ids:
        a = np.asarray(ids, dtype=np.int64)
        np.bitwise_or.at(out, a // MASK_BITS, (np.uint32(1) << (a % MASK_BITS).astype(np.uint32)))
    return out.view(np.int32)


def _row_values(
    state: RowControlState,
    sets: dict[int, SamplingControls],
    set_rows: np.ndarray,
    cleared: np.ndarray,
    seq_lens: np.ndarray,
    position_of: dict[int, int],
    eos_token_ids: tuple[int, ...],
) -> RowValues | None:
    rows = np.concatenate([set_rows, cleared])
    if len(rows) == 0:
        return None
    v = state.neutral(rows)
    for i, row in enumerate(set_rows.tolist()):
        c = sets[row]
        prompt_len = c.prompt_len or int(seq_lens[position_of[row]])
        v.repetition[i] = c.repetition_penalty
        v.frequency[i] = c.frequency_penalty
        v.presence[i] = c.presence_penalty
        v.prompt_len[i] = prompt_len
        v.has_penalties[i] = c.uses_penalties
        if c.min_tokens > 0:
            v.min_len[i] = prompt_len + c.min_tokens
            eos = tuple(t for t in eos_token_ids if 0 <= t < state.vocab_size)
            v.suppress_words[i] = _bits(eos + c.stop_token_ids, state.words)
        if c.logit_bias:
            ids, values = zip(*c.logit_bias, strict=True)
            v.bias_ids[i, : len(ids)] = ids
            v.bias_values[i, : len(ids)] = values
            v.has_bias[i] = True
        if c.uses_token_mask:
            allowed = (
                _bits(c.allowed_token_ids, state.words)
                if c.allowed_token_ids
                else np.full(state.words, -1, dtype=np.int32)
            )
            v.token_words[i] = allowed & ~_bits(c.banned_token_ids, state.words)
            v.has_token_mask[i] = True
    return v


def _effective(
    state: RowControlState,
    rows: np.ndarray,
    released: np.ndarray,
    update: RowValues | None,
    seq_lens: np.ndarray,
) -> _Effective:
    h = state.host
    pen = h["has_penalties"][rows].copy()
    bias = h["has_bias"][rows].copy()
    tok = h["has_token_mask"][rows].copy()
    min_len = h["min_len"][rows].copy()
    token_words = h["token_words"][rows].copy()
    suppress_words = h["suppress_words"][rows].copy()
    reused = np.isin(rows, released)  # a released row reused by a new request: neutral
    if reused.any():
        pen[reused] = bias[reused] = tok[reused] = False
        min_len[reused] = 0
        token_words[reused] = -1
        suppress_words[reused] = 0
    if update is not None:
        at = {int(r): i for i, r in enumerate(rows.tolist())}
        for j, r in enumerate(update.rows.tolist()):
            i = at.get(r)
            if i is None:
                continue
            pen[i], bias[i], tok[i] = (
                update.has_penalties[j],
                update.has_bias[j],
                update.has_token_mask[j],
            )
            min_len[i] = update.min_len[j]
            token_words[i] = update.token_words[j]
            suppress_words[i] = update.suppress_words[j]
    return _Effective(
        penalties=pen,
        bias=bias,
        token_mask=tok,
        suppressing=(min_len > 0) & (seq_lens < min_len),
        seq_lens=seq_lens,
        token_words=token_words,
        suppress_words=suppress_words,
    )


def check_mask(mask: VocabMask, name: str, bs: int, words: int) -> np.ndarray:
    """The mask as [bs, W] int32 (all ones for rows it leaves out); refuses bad shapes."""
    w = mask.words
    if not isinstance(w, torch.Tensor) or w.dtype != torch.int32 or w.dim() != 2:
        raise BatchValidationError(name, "must be an int32 tensor of rank 2")
    if w.shape[1] != words:
        raise BatchValidationError(
            name, f"must have vocab_mask_words ({words}) words per row, got {w.shape[1]}"
        )
    m = int(w.shape[0])
    if mask.rows is None:
        if m != bs:
            raise BatchValidationError(name, f"must have one row per request ({bs}), got {m}")
        return w.numpy().astype(np.int32, copy=True)
    r = mask.rows
    rows_name = name + "_rows"
    if r.dtype not in (torch.int32, torch.int64) or r.dim() != 1 or r.shape[0] != m:
        raise BatchValidationError(
            rows_name, f"must be an int tensor of {m} entries (one per mask row)"
        )
    pos = r.numpy().astype(np.int64)
    if len(pos) and (pos.min() < 0 or pos.max() >= bs):
        raise BatchValidationError(rows_name, f"positions must be in 0..{bs - 1}")
    if len(np.unique(pos)) != len(pos):
        raise BatchValidationError(rows_name, "positions must be unique")
    out = np.full((bs, words), -1, dtype=np.int32)
    out[pos] = w.numpy()
    return out


def _check_not_empty(
    eff: _Effective, mask_words: np.ndarray | None, positions: np.ndarray, vocab: int
) -> None:
    """Refuse a row whose masks leave it no token (its logits would all be -inf)."""
    check = positions[eff.token_mask[positions] | eff.suppressing[positions]]
    if mask_words is not None:
        check = positions
    if len(check) == 0:
        return
    allowed = eff.token_words[check].copy()
    sup = eff.suppressing[check]
    allowed[sup] &= ~eff.suppress_words[check][sup]
    if mask_words is not None:
        allowed &= mask_words[check]
    words = allowed.shape[1]
    tail = vocab - (words - 1) * MASK_BITS  # valid bits of the last word
    if tail < MASK_BITS:
        allowed[:, -1] &= np.int32((1 << tail) - 1)
    empty = ~(allowed != 0).any(axis=1)
    if empty.any():
        i = int(check[np.flatnonzero(empty)[0]])
        field = "vocab_mask" if mask_words is not None else "row_controls"
        raise BatchValidationError(
            field, f"batch position {i} allows no token (its masks exclude the whole vocabulary)"
        )
