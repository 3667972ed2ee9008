"""The host kernel's pass over a usual batch (`ops/host_kernels.py`): True means every rule holds.

`executor/validation.py` asks `plain_decode_holds` first: for a DECODE batch of the usual
shape (token ids; no positions, releases, future slots or embeddings) one kernel call checks
every value rule of `validate_batch` (ranges, duplicates, the rows' resident lengths, future
references) and `sampling_holds` the sampling parameters. True skips the Python rules; False
(no kernel, another shape, or a rule that fails) runs them, and they name what is wrong. So a
batch refused is refused by the Python rules, with their messages, and one accepted here is
one they accept (tests/test_host_kernels.py runs both on the same batches, one for every rule).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from executor.core.forward_batch import ForwardBatch, ForwardMode, SamplingBatch
from executor.core.limits import BatchLimits
from ops import host_kernels
from ops.sampling import GREEDY_BELOW_TEMPERATURE

_INT_DTYPES = (torch.int32, torch.int64)


def _host_vector(t: object, n: int, dtypes: tuple[torch.dtype, ...] = _INT_DTYPES) -> bool:
    """A contiguous 1-D host tensor of `n` entries in one of `dtypes` (what the kernel reads)."""
    return (
        isinstance(t, torch.Tensor)
        and t.dtype in dtypes
        and t.dim() == 1
        and t.is_cpu
        and t.numel() == n
        and t.is_contiguous()
    )


def plain_decode_holds(
    fb: ForwardBatch,
    limits: BatchLimits,
    resident_lens: np.ndarray,
    future_assigned: np.ndarray | None,
) -> bool:
    """True when `fb` is a DECODE batch of the usual shape (token ids; no positions, row
    releases or embeddings; future slots assigned and released, as an overlapping scheduler
    sends them) and the host kernel finds every rule of `validate_batch` holds for it; False
    sends it through the rules below, which name what is wrong (or accept it)."""
    k = host_kernels.loaded()
    if k is None or fb.forward_mode is not ForwardMode.DECODE:
        return False
    bs = fb.batch_size
    if (
        type(bs) is not int
        or not 0 < bs <= limits.max_batch_size
        or bs > limits.max_tokens_per_batch
        or fb.positions is not None
        or fb.input_embeds is not None
        or fb.released_req_pool_indices is not None
        or fb.extend_prefix_lens is not None
        or fb.extend_seq_lens is not None
        or fb.prefix_cache_loc is not None
        or type(fb.top_logprobs_num) is not int
        or not 0 <= fb.top_logprobs_num <= min(limits.max_top_logprobs, limits.vocab_size)
    ):
        return False
    ids, rows, seq_lens, out_loc = fb.input_ids, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc
    if not (
        _host_vector(ids, bs)
        and _host_vector(rows, bs)
        and _host_vector(seq_lens, bs)
        and _host_vector(out_loc, bs)
    ):
        return False
    assert ids is not None
    if fb.sampling is not None and not sampling_holds(fb.sampling, bs):
        return False
    if (
        resident_lens.dtype != np.int64
        or not resident_lens.flags.c_contiguous
        or len(resident_lens) <= limits.max_reqs
    ):
        return False
    assigned = None
    if limits.future_slots and future_assigned is not None:
        if future_assigned.dtype != np.bool_ or len(future_assigned) != limits.future_slots + 1:
            return False
        held = _future_held(fb, bs, limits.future_slots, future_assigned)
        if held is None:
            return False
        assigned = host_kernels.address(held)
    elif fb.released_future_slots is not None or fb.future_token_slots is not None:
        return False
    stats = (ctypes.c_int64 * 3)()
    return not k.check_decode(
        bs,
        ids.data_ptr(), host_kernels.element_size(ids), -limits.future_slots, limits.vocab_size - 1,
        assigned,
        rows.data_ptr(), host_kernels.element_size(rows), limits.max_reqs,
        out_loc.data_ptr(), host_kernels.element_size(out_loc), limits.kv_slots,
        seq_lens.data_ptr(), host_kernels.element_size(seq_lens), limits.max_context_len,
        host_kernels.address(resident_lens), stats,
    )  # fmt: skip


def _future_held(
    fb: ForwardBatch, bs: int, future_slots: int, assigned: np.ndarray
) -> np.ndarray | None:
    """The future slots that hold a token once `fb`'s releases apply (what its references
    may name), when its releases and its own slots keep `_check_future`'s rules: unique slots
    in 1..future_slots, one per request, none still held; None to let those rules speak."""
    held = assigned
    released = fb.released_future_slots
    if released is not None:
        if not (isinstance(released, torch.Tensor) and _host_vector(released, released.numel())):
            return None
        if released.numel():
            freed = released.tolist()
            if not _slots(freed, future_slots):
                return None
            held = assigned.copy()  # the table's own map changes only when the step applies
            held[freed] = False
    slots = fb.future_token_slots
    if slots is not None:
        if not _host_vector(slots, bs):
            return None
        mine = slots.tolist()
        if not _slots(mine, future_slots) or any(held[k] for k in mine):
            return None
    return held


def _slots(slots: list[int], future_slots: int) -> bool:
    """Unique slots in 1..future_slots (a step's few slots, as a list)."""
    return min(slots) >= 1 and max(slots) <= future_slots and len(set(slots)) == len(slots)


_SAMPLING_DTYPES = (
    ("temperatures", torch.float32),
    ("top_ps", torch.float32),
    ("top_ks", torch.int64),
    ("min_ps", torch.float32),
    ("seeds", torch.int64),
    ("has_seed", torch.bool),
    ("processed", torch.bool),
)
PLAN_SIZE = 9  # `hk_sampling`'s plan: see ops/host_kernels.c


def sampling_holds(
    s: SamplingBatch, bs: int, plan: ctypes.Array[ctypes.c_int64] | None = None
) -> bool:
    """True when the host kernel finds every sampling rule holds for `bs` requests (and
    fills `plan`, when given, with `hk_sampling`'s plan); False: no kernel, an unusual
    layout, or a rule to look at closer (`_check_sampling`)."""
    k = host_kernels.loaded()
    if k is None:
        return False
    if not all(_host_vector(getattr(s, name), bs, (dtype,)) for name, dtype in _SAMPLING_DTYPES):
        return False
    out = plan if plan is not None else (ctypes.c_int64 * PLAN_SIZE)()
    return not k.sampling(
        bs,
        s.temperatures.data_ptr(), s.top_ps.data_ptr(), s.top_ks.data_ptr(),
        s.min_ps.data_ptr(), s.has_seed.data_ptr(), s.processed.data_ptr(),
        GREEDY_BELOW_TEMPERATURE, out,
    )  # fmt: skip
