"""`batch_invariant` on the Triton attention kernels: a request's output is bitwise the same
alone, in a batch of 8 and of 32 (decode: its keys split by its own length, not the batch's
size), and however its prompt was chunked (extend: keys summed in blocks at absolute
positions). On CUDA where it exists, else under triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), small cases as in tests/test_triton_kernels.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest
import torch

from attention.base import AttentionLayout, LayerAttention
from attention.triton import launch
from attention.triton.backend import TritonAttnBackend
from executor.batch_prep import complete_batch, make_decode_batch, make_extend_batch
from executor.core.forward_batch import ForwardMode
from ops.device_scope import device_scope
from tests.attention_cases import Case, make_case, make_layout, random_lengths, run

pytest.importorskip("triton", reason="triton is not installed: its kernels cannot run here")

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip("no CUDA, and TRITON_INTERPRET is not 1", allow_module_level=True)

# Few SMs: without batch_invariant a lone request then splits its keys up to 8 ways, one in
# a batch of 8 up to 2, and one in a batch of 32 not at all.
NUM_SMS = 16


@pytest.fixture(autouse=True)
def _in_device_scope() -> Iterator[None]:
    with device_scope(torch.device(DEVICE)):
        yield


def _backend(case: Case, invariant: bool) -> TritonAttnBackend:
    backend = TritonAttnBackend(case.layout, case.req_to_token_pool, case.kv_pool, num_sms=NUM_SMS)
    backend.batch_invariant = invariant
    return backend


def _token_spans(case: Case) -> list[tuple[int, int]]:
    lens = case.fb.extend_seq_lens
    sizes = [1] * case.fb.batch_size if lens is None else lens.tolist()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def _sub_case(case: Case, i: int, prefix: int | None = None) -> Case:
    """Request `i` of `case` alone, on the same pools (its row, slots and K/V), with its new
    tokens from `prefix` on (default: as in `case`): a chunk split elsewhere."""
    fb = case.fb
    row = int(fb.req_pool_indices[i])
    seq_len = int(fb.seq_lens[i])
    slots = case.req_to_token_pool.req_to_token[row, :seq_len].tolist()
    lo, hi = _token_spans(case)[i]
    if fb.forward_mode is ForwardMode.DECODE:
        sub = make_decode_batch(
            input_ids=[0], req_pool_indices=[row], seq_lens=[seq_len], out_cache_loc=[slots[-1]]
        )
    else:
        old_prefix = seq_len - (hi - lo)
        prefix = old_prefix if prefix is None else prefix
        lo += prefix - old_prefix
        sub = make_extend_batch(
            input_ids=[[0] * (seq_len - prefix)],
            req_pool_indices=[row],
            out_cache_loc=[slots[prefix:]],
            prefix_lens=[prefix],
        )
    max_context_len = case.req_to_token_pool.max_context_len
    sub = complete_batch(sub, needs_cpu_seq_lens=True, max_context_len=max_context_len)
    return dataclasses.replace(
        case, fb=sub.to(case.q.device), q=case.q[lo:hi], k=case.k[lo:hi], v=case.v[lo:hi]
    )


def _outputs(case: Case, invariant: bool) -> list[torch.Tensor]:
    out = run(_backend(case, invariant), case)
    return [out[lo:hi] for lo, hi in _token_spans(case)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "bs"), [(ForwardMode.DECODE, 8), (ForwardMode.DECODE, 32), (ForwardMode.EXTEND, 8)]
)
def test_a_requests_attention_is_bitwise_the_same_alone_and_in_a_batch(
    mode: ForwardMode, bs: int
) -> None:
    g = torch.Generator().manual_seed(bs)
    prefix, extend = random_lengths(g, bs, mode, 260 if mode is ForwardMode.DECODE else 80)
    layout = make_layout(4, 2, 16)
    case = make_case(mode, prefix, extend, layout, seed=bs, device=DEVICE, max_reqs=bs)
    batched = _outputs(case, invariant=True)
    for i in (0, bs // 2, bs - 1):
        alone = _outputs(_sub_case(case, i), invariant=True)[0]
        assert torch.equal(alone, batched[i]), f"request {i} of {bs}"


def test_without_it_decode_splits_follow_the_batch_size() -> None:
    """What the flag changes: the split cap, a function of the batch size without it."""
    caps = {bs: launch.split_cap(bs, 2, 8, NUM_SMS) for bs in (1, 32)}
    assert caps[1] > caps[32]
    assert {launch.split_cap(bs, 2, 8, NUM_SMS, batch_invariant=True) for bs in (1, 32)} == {8}


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 40])
def test_a_prompt_chunked_differently_attends_bitwise_the_same(window: int | None) -> None:
    layout: AttentionLayout = make_layout(4, 2, 16)
    if window is not None:
        layout = dataclasses.replace(layout, layers=(LayerAttention(window, None),))
    case = make_case(ForwardMode.EXTEND, [0, 5], [150, 20], layout, seed=3, device=DEVICE)
    whole = _outputs(case, invariant=True)[0]  # the prompt in one chunk
    for split in (70, 129):  # neither on a block boundary
        rest = _outputs(_sub_case(case, 0, prefix=split), invariant=True)[0]
        assert torch.equal(rest, whole[split:]), f"chunked at {split}"
    reference = _outputs(case, invariant=False)[0]  # the kernel's usual path agrees closely
    assert torch.allclose(whole, reference, atol=1e-5, rtol=1e-5)
