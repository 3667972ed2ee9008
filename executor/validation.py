"""Check a host ForwardBatch against the executor's limits before any device state changes.

One function, :func:`validate_batch`, raises :class:`BatchValidationError` (or
:class:`BatchTooLargeError` for size limits) naming the field, the first offending entry and
the rule. It reads host tensors only and writes nothing, so a refused batch leaves the KV
cache, the row table and the executor exactly as they were. The step calls it first, then
checks the batch's row-table write against the slot owners (`executor.step.step.Step.admit`).

The size rules (:func:`check_request_count`, :func:`check_token_count`) are also what the
wire codec applies to a message's size claims before it builds anything.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from executor.admission.host_checks import plain_decode_holds
from executor.batch_prep import extend_positions
from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.core.forward_batch import ForwardBatch, ForwardMode, SamplingBatch
from executor.core.limits import BatchLimits

_INT_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_request_count(field: str, n: int, limits: BatchLimits) -> None:
    """BatchTooLargeError if `n` requests exceed max_batch_size."""
    if n > limits.max_batch_size:
        raise BatchTooLargeError(
            field, f"has {n} entries; must be <= max_batch_size ({limits.max_batch_size})"
        )


def check_token_count(field: str, n: int, limits: BatchLimits) -> None:
    """BatchTooLargeError if `n` tokens exceed max_tokens_per_batch."""
    if n > limits.max_tokens_per_batch:
        raise BatchTooLargeError(
            field,
            f"has {n} tokens; must be <= max_tokens_per_batch ({limits.max_tokens_per_batch})",
        )


def _check_tensor(
    t: object, field: str, *, dtypes: tuple[torch.dtype, ...], ndim: int, length: int | None = None
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise BatchValidationError(field, f"must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise BatchValidationError(
            field, f"dtype must be {names}, got {str(t.dtype).removeprefix('torch.')}"
        )
    if t.dim() != ndim:
        raise BatchValidationError(field, f"must have rank {ndim}, got shape {list(t.shape)}")
    if t.device.type != "cpu":
        raise BatchValidationError(field, f"must be a host (CPU) tensor, got device {t.device}")
    if length is not None and t.shape[0] != length:
        raise BatchValidationError(field, f"must have {length} entries, got {t.shape[0]}")
    return t


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _host(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """A numpy view of a host tensor (the array itself when given one, to view it once)."""
    return t if isinstance(t, np.ndarray) else t.numpy()


def _check_range(t: torch.Tensor | np.ndarray, field: str, lo: int, hi: int) -> None:
    """Every entry in [lo, hi]. Checked on a numpy view: the tensors are small host ones."""
    a = _host(t)
    if a.size == 0:
        return
    if int(a.min()) >= lo and int(a.max()) <= hi:
        return
    wide = a.astype(np.int64)
    i = int(np.flatnonzero((wide < lo) | (wide > hi))[0])
    raise BatchValidationError(f"{field}[{i}]", f"must be in {lo}..{hi}, got {int(a[i])}")


def _check_unique(t: torch.Tensor | np.ndarray, field: str, what: str) -> None:
    a = _host(t)
    if a.size < 2:
        return
    ordered = np.sort(a)
    if not bool((ordered[1:] == ordered[:-1]).any()):
        return
    values, counts = np.unique(ordered, return_counts=True)
    dup = int(values[np.flatnonzero(counts > 1)[0]])
    raise BatchValidationError(
        field, f"{what} must be unique within a batch; {dup} appears {int(counts.max())} times"
    )


def validate_batch(
    fb: ForwardBatch,
    limits: BatchLimits,
    resident_lens: np.ndarray,
    *,
    allow_custom_positions: bool = False,
    future_assigned: np.ndarray | None = None,
) -> None:
    """Raise if `fb` breaks any rule; `resident_lens[row]` is how many positions `row` holds.

    `future_assigned[k]` says future slot k holds a token nobody released (the executor's
    future table); None: no slot does, so every future-token reference is refused.

    Explicit `positions` must be the ones the executor derives (each token's index in its
    request) unless `allow_custom_positions`: they decide the rotary phase of the K/V the
    step stores, so a wrong one silently changes every later token of that request.

    A DECODE batch of the usual shape is checked by the host kernel first
    (`executor.admission.host_checks`); the rules below run when it is not, or when a rule fails."""
    if plain_decode_holds(fb, limits, resident_lens, future_assigned):
        return
    if not isinstance(fb.forward_mode, ForwardMode):
        raise BatchValidationError(
            "forward_mode", f"must be EXTEND, DECODE, IDLE or VERIFY, got {fb.forward_mode!r}"
        )
    bs = fb.batch_size
    if not isinstance(bs, int) or bs < 0:
        raise BatchValidationError("batch_size", f"must be a non-negative integer, got {bs!r}")
    rows = _check_tensor(
        fb.req_pool_indices, "req_pool_indices", dtypes=_INT_DTYPES, ndim=1, length=bs
    )
    seq_lens = _check_tensor(fb.seq_lens, "seq_lens", dtypes=_INT_DTYPES, ndim=1, length=bs)
    out_loc = _check_tensor(fb.out_cache_loc, "out_cache_loc", dtypes=_INT_DTYPES, ndim=1)
    num_tokens = out_loc.shape[0]

    check_request_count("batch_size", bs, limits)
    check_token_count("out_cache_loc", num_tokens, limits)

    released = _check_released(fb, limits)
    released_future = _check_released_future(fb, limits)
    # Before the IDLE return: an IDLE step runs the sampler on no rows, and topk beyond the
    # vocabulary fails even then.
    cap = min(limits.max_top_logprobs, limits.vocab_size)
    if not isinstance(fb.top_logprobs_num, int) or not 0 <= fb.top_logprobs_num <= cap:
        raise BatchValidationError(
            "top_logprobs_num",
            f"must be in 0..{cap} (max_top_logprobs), got {fb.top_logprobs_num!r}",
        )
    if fb.sampling is not None:
        _check_sampling(fb.sampling, bs)
    if fb.forward_mode is ForwardMode.IDLE:
        if fb.future_token_slots is not None and fb.future_token_slots.numel() != 0:
            raise BatchValidationError("future_token_slots", "must be empty for IDLE")
        if bs != 0 or num_tokens != 0:
            raise BatchValidationError(
                "forward_mode",
                f"IDLE batches must be empty, got {bs} requests and {num_tokens} tokens",
            )
        return
    if bs == 0:
        raise BatchValidationError(
            "batch_size", f"must be >= 1 for {fb.forward_mode.name} (send IDLE for an empty step)"
        )

    _check_inputs(fb, limits, num_tokens)
    _check_future(fb, limits, bs, released_future, future_assigned)
    host_rows, host_out_loc = rows.numpy(), out_loc.numpy()
    _check_range(host_rows, "req_pool_indices", 1, limits.max_reqs)
    _check_unique(host_rows, "req_pool_indices", "rows")
    _check_range(host_out_loc, "out_cache_loc", 1, limits.kv_slots)
    _check_unique(host_out_loc, "out_cache_loc", "slots")
    _check_range(seq_lens, "seq_lens", 1, limits.max_context_len)
    if fb.positions is not None:
        positions = _check_tensor(
            fb.positions, "positions", dtypes=_INT_DTYPES, ndim=1, length=num_tokens
        )
        _check_range(positions, "positions", 0, limits.max_context_len - 1)

    held = resident_lens[host_rows]
    if released is not None:  # released first: such a row holds nothing for this step
        held = np.where(np.isin(host_rows, released.numpy()), 0, held)
    if fb.forward_mode.is_extend():
        _check_extend(fb, limits, num_tokens, rows, seq_lens, out_loc, held)
    else:
        _check_decode(fb, num_tokens, seq_lens, held, bs)
    if fb.positions is not None and not allow_custom_positions:
        _check_positions(fb, num_tokens)


def _check_released(fb: ForwardBatch, limits: BatchLimits) -> torch.Tensor | None:
    if fb.released_req_pool_indices is None:
        return None
    released = _check_tensor(
        fb.released_req_pool_indices, "released_req_pool_indices", dtypes=_INT_DTYPES, ndim=1
    )
    host_released = released.numpy()
    _check_range(host_released, "released_req_pool_indices", 1, limits.max_reqs)
    _check_unique(host_released, "released_req_pool_indices", "released rows")
    return released


def _check_released_future(fb: ForwardBatch, limits: BatchLimits) -> torch.Tensor | None:
    if fb.released_future_slots is None:
        return None
    released = _check_tensor(
        fb.released_future_slots, "released_future_slots", dtypes=_INT_DTYPES, ndim=1
    )
    _check_future_slots(released, "released_future_slots", limits)
    return released


def _check_future_slots(slots: torch.Tensor, field: str, limits: BatchLimits) -> None:
    """Unique future slots in 1..future_slots."""
    if slots.numel() and limits.future_slots == 0:
        raise BatchValidationError(field, "the executor takes no future tokens (future_slots = 0)")
    host_slots = slots.numpy()
    _check_range(host_slots, field, 1, limits.future_slots)
    _check_unique(host_slots, field, "future slots")


def _check_future(
    fb: ForwardBatch,
    limits: BatchLimits,
    bs: int,
    released: torch.Tensor | None,
    assigned: np.ndarray | None,
) -> None:
    """Future-token slots and references against the table's state after the releases."""
    held = np.zeros(limits.future_slots + 1, dtype=bool) if assigned is None else assigned
    if released is not None and released.numel():
        held = held.copy()  # the table's own map changes only when the step applies
        held[released.long().numpy()] = False
    if fb.future_token_slots is not None:
        slots = _check_tensor(
            fb.future_token_slots, "future_token_slots", dtypes=_INT_DTYPES, ndim=1, length=bs
        )
        _check_future_slots(slots, "future_token_slots", limits)
        busy = held[slots.long().numpy()]
        if busy.any():
            i = int(np.flatnonzero(busy)[0])
            raise BatchValidationError(
                f"future_token_slots[{i}]",
                f"future slot {int(slots[i])} still holds an unreleased token; list it in "
                "released_future_slots (this batch or an earlier one) before assigning it again",
            )
    if fb.input_ids is None or limits.future_slots == 0:
        return
    ids = fb.input_ids.numpy()  # numpy: a few microseconds on the per-step path
    refs = np.flatnonzero(ids < 0)
    if refs.size == 0:
        return
    targets = -ids[refs].astype(np.int64)
    unheld = np.flatnonzero(~held[targets])
    if unheld.size:
        i, k = int(refs[unheld[0]]), int(targets[unheld[0]])
        raise BatchValidationError(
            f"input_ids[{i}]",
            f"refers to future slot {k}, which holds no token: no earlier "
            "accepted batch assigned it (future_token_slots), or it was released since",
        )


INPUT_EMBEDS_OFF = (
    "is off on this executor (start it with allow_input_embeds to accept client embeddings)"
)


def _check_inputs(fb: ForwardBatch, limits: BatchLimits, num_tokens: int) -> None:
    if fb.input_embeds is not None and not limits.allow_input_embeds:
        raise BatchValidationError("input_embeds", INPUT_EMBEDS_OFF)
    if (fb.input_ids is None) == (fb.input_embeds is None):
        raise BatchValidationError(
            "input_ids", "exactly one of input_ids and input_embeds must be given"
        )
    if fb.input_ids is not None:
        ids = _check_tensor(
            fb.input_ids, "input_ids", dtypes=_INT_DTYPES, ndim=1, length=num_tokens
        )
        if limits.future_slots == 0:
            _check_range(ids, "input_ids", 0, limits.vocab_size - 1)
        elif ids.numel():
            a = ids.numpy()
            if int(a.min()) < -limits.future_slots or int(a.max()) > limits.vocab_size - 1:
                wide = a.astype(np.int64)
                bad = (wide < -limits.future_slots) | (wide > limits.vocab_size - 1)
                i = int(np.flatnonzero(bad)[0])
                raise BatchValidationError(
                    f"input_ids[{i}]",
                    f"must be a token id in 0..{limits.vocab_size - 1} or a future-token "
                    f"reference in -{limits.future_slots}..-1, got {int(ids[i])}",
                )
    else:
        embeds = _check_tensor(
            fb.input_embeds, "input_embeds", dtypes=_FLOAT_DTYPES, ndim=2, length=num_tokens
        )
        if embeds.shape[1] != limits.hidden_size:
            raise BatchValidationError(
                "input_embeds", f"must have hidden size {limits.hidden_size}, got {embeds.shape[1]}"
            )
        if not bool(torch.isfinite(embeds).all()):
            raise BatchValidationError("input_embeds", "must be finite (no NaN or inf)")


def _check_extend(
    fb: ForwardBatch,
    limits: BatchLimits,
    num_tokens: int,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    out_loc: torch.Tensor,
    held: np.ndarray,
) -> None:
    bs = fb.batch_size
    if fb.extend_prefix_lens is None or fb.extend_seq_lens is None:
        raise BatchValidationError(
            "extend_seq_lens", "EXTEND needs extend_prefix_lens and extend_seq_lens"
        )
    prefix = _check_tensor(
        fb.extend_prefix_lens, "extend_prefix_lens", dtypes=_INT_DTYPES, ndim=1, length=bs
    )
    extend = _check_tensor(
        fb.extend_seq_lens, "extend_seq_lens", dtypes=_INT_DTYPES, ndim=1, length=bs
    )
    _check_range(extend, "extend_seq_lens", 1, limits.max_context_len)
    _check_range(prefix, "extend_prefix_lens", 0, limits.max_context_len - 1)
    mismatch = seq_lens != prefix + extend
    if bool(mismatch.any()):
        i = _first(mismatch)
        raise BatchValidationError(
            f"seq_lens[{i}]",
            f"must equal extend_prefix_lens + extend_seq_lens ({int(prefix[i])} + {int(extend[i])}), got {int(seq_lens[i])}",
        )
    if int(extend.sum()) != num_tokens:
        raise BatchValidationError(
            "extend_seq_lens",
            f"must sum to the number of tokens ({num_tokens}), got {int(extend.sum())}",
        )
    if fb.prefix_cache_loc is not None:
        n_prefix = int(prefix.sum())
        pcl = _check_tensor(
            fb.prefix_cache_loc, "prefix_cache_loc", dtypes=_INT_DTYPES, ndim=1, length=n_prefix
        )
        _check_range(pcl, "prefix_cache_loc", 1, limits.kv_slots)
        overlap = torch.isin(out_loc, pcl)
        if bool(overlap.any()):
            i = _first(overlap)
            raise BatchValidationError(
                f"out_cache_loc[{i}]",
                f"slot {int(out_loc[i])} is also in prefix_cache_loc; new tokens need fresh slots",
            )
    else:
        missing = np.flatnonzero(prefix.numpy() > held)
        if missing.size:
            i = int(missing[0])
            raise BatchValidationError(
                f"extend_prefix_lens[{i}]",
                f"row {int(rows[i])} holds {int(held[i])} tokens but the prefix is {int(prefix[i])}; "
                "send prefix_cache_loc with the prefix's slots or extend the row first",
            )


def _check_positions(fb: ForwardBatch, num_tokens: int) -> None:
    assert fb.positions is not None
    if fb.forward_mode.is_extend():
        assert fb.extend_prefix_lens is not None and fb.extend_seq_lens is not None
        prefix, extend = fb.extend_prefix_lens.long(), fb.extend_seq_lens.long()
        start = torch.cumsum(extend, 0) - extend
        derived = extend_positions(prefix, extend, start, num_tokens)
    else:
        derived = fb.seq_lens.long() - 1
    wrong = fb.positions.long() != derived
    if bool(wrong.any()):
        i = _first(wrong)
        raise BatchValidationError(
            f"positions[{i}]",
            f"must be {int(derived[i])} (the token's index in its request), got "
            f"{int(fb.positions[i])}; leave positions out, or start the executor with "
            "allow_custom_positions",
        )


def _check_decode(
    fb: ForwardBatch, num_tokens: int, seq_lens: torch.Tensor, held: np.ndarray, bs: int
) -> None:
    if num_tokens != bs:
        raise BatchValidationError(
            "out_cache_loc", f"DECODE takes one token per request ({bs}), got {num_tokens}"
        )
    for name in ("extend_prefix_lens", "extend_seq_lens", "prefix_cache_loc"):
        if getattr(fb, name) is not None:
            raise BatchValidationError(name, "must be empty for DECODE")
    missing = np.flatnonzero(seq_lens.numpy().astype(np.int64) - 1 > held)
    if missing.size:
        i = int(missing[0])
        raise BatchValidationError(
            f"seq_lens[{i}]",
            f"DECODE to length {int(seq_lens[i])} needs {int(seq_lens[i]) - 1} cached tokens, "
            f"row {int(fb.req_pool_indices[i])} holds {int(held[i])}",
        )


def _check_sampling(s: SamplingBatch, bs: int) -> None:
    for f in dataclasses.fields(s):
        name = f.name
        t = getattr(s, name)
        if t.dim() != 1 or t.shape[0] != bs:
            raise BatchValidationError(
                f"sampling_params.{name}",
                f"must have batch_size ({bs}) entries (one sampling_params entry per request, "
                f"or 1 for all), got shape {list(t.shape)}",
            )
    rules = (
        (
            "temperature",
            s.temperatures,
            ~(torch.isfinite(s.temperatures) & (s.temperatures >= 0)),
            "must be finite and >= 0",
        ),
        ("top_p", s.top_ps, ~((s.top_ps > 0) & (s.top_ps <= 1)), "must be in (0, 1]"),
        ("top_k", s.top_ks, s.top_ks < 0, "must be >= 0 (0 disables it)"),
        ("min_p", s.min_ps, ~((s.min_ps >= 0) & (s.min_ps <= 1)), "must be in [0, 1]"),
    )
    for name, values, bad, rule in rules:
        if bool(bad.any()):
            i = _first(bad)
            raise BatchValidationError(
                f"sampling_params[{i}].{name}", f"{rule}, got {values[i].item()}"
            )
