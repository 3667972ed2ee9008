"""torch_paged against the torch_native reference, its capture/replay contract, and selection."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from attention import (
    BACKEND_NAMES,
    GraphCaptureUnsupportedError,
    TorchNativeBackend,
    TorchPagedBackend,
    TorchPagedMetadata,
    TritonAttnBackend,
    backend_class,
    create_backend,
)
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.scheduler import generate
from executor.core.buckets import length_bound
from executor.core.forward_batch import ForwardBatch, ForwardMode
from executor.graphs.capture_rules import ForbiddenValue, HostReadGuard
from executor.model_executor import ModelExecutor
from tests.attention_cases import Case, make_case, make_layout, random_lengths, run

MakeExecutor = Callable[..., ModelExecutor]
TOL = 1e-5
GEOMETRIES = [(4, 4, 32), (8, 2, 64), (6, 1, 16), (9, 3, 64)]  # (Hq, Hk, D): MHA, GQA, MQA


def _compare(case: Case) -> float:
    native = TorchNativeBackend(case.layout, case.req_to_token_pool, case.kv_pool)
    paged = TorchPagedBackend(case.layout, case.req_to_token_pool, case.kv_pool)
    ref, out = run(native, case), run(paged, case)
    assert out.shape == ref.shape
    return float((out - ref).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_paged_equals_native_on_random_batches(
    geometry: tuple[int, int, int], mode: ForwardMode
) -> None:
    layout = make_layout(*geometry)
    g = torch.Generator().manual_seed(hash(geometry) % 1000 + int(mode))
    for seed in range(3):
        prefix, extend = random_lengths(g, 5, mode, max_len=2048)
        case = make_case(mode, prefix, extend, layout, seed=seed)
        assert _compare(case) <= TOL, (prefix, extend)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "prefix", "extend"),
    [
        (ForwardMode.DECODE, [0], [1]),  # a single token, no history
        (ForwardMode.DECODE, [0, 2047, 1, 511], [1, 1, 1, 1]),  # 1..2048 in one batch
        (ForwardMode.EXTEND, [0], [1]),
        (ForwardMode.EXTEND, [0, 0, 0], [1, 2048, 3]),  # fresh prompts, one at the limit
        (ForwardMode.EXTEND, [2047, 1000, 0], [1, 1048, 7]),  # prefixes up to the limit
        (ForwardMode.EXTEND, [5, 64, 1], [1, 1, 1]),  # extend of one token after a prefix
    ],
)
def test_paged_equals_native_at_the_edges(
    mode: ForwardMode, prefix: list[int], extend: list[int]
) -> None:
    case = make_case(mode, prefix, extend, make_layout(8, 2, 64), seed=7)
    assert _compare(case) <= TOL


def test_paged_masks_stale_slots_past_each_length() -> None:
    """Keys past seq_len (the row's stale slots) must not change the output."""
    layout = make_layout(4, 2, 32)
    case = make_case(ForwardMode.DECODE, [10, 300], [1, 1], layout, seed=3)
    paged = TorchPagedBackend(layout, case.req_to_token_pool, case.kv_pool)
    before = run(paged, case)
    table = case.req_to_token_pool.req_to_token
    rows = case.fb.req_pool_indices.tolist()
    used = set(table[rows[0], :11].tolist()) | set(table[rows[1], :301].tolist())
    unused = next(s for s in range(1, case.kv_pool.num_slots + 1) if s not in used)
    table[rows[0], 11:] = unused  # every stale entry now points at one unused slot
    table[rows[1], 301:] = unused
    case.kv_pool.k[:, unused] = 1e4  # which would dominate if it were ever read
    assert torch.equal(run(paged, case), before)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_chunked_attention_equals_one_batch_wide_call(
    mode: ForwardMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    import attention.torch_paged as torch_paged_module

    g = torch.Generator().manual_seed(11)
    prefix, extend = random_lengths(g, 7, mode, max_len=1500)
    case = make_case(mode, prefix, extend, make_layout(8, 2, 64), seed=11)
    paged = TorchPagedBackend(case.layout, case.req_to_token_pool, case.kv_pool)
    assert paged.chunk_rows(7, 2048, 4) == 3  # 2 MiB of K+V per request, 6 MiB per chunk
    chunked = run(paged, case)
    monkeypatch.setattr(torch_paged_module, "CPU_GATHER_BYTES", 1 << 40)
    assert paged.chunk_rows(7, 2048, 4) == 7
    torch.testing.assert_close(run(paged, case), chunked, atol=1e-6, rtol=0)


def test_eager_shapes_follow_the_batch_bounds() -> None:
    layout = make_layout(4, 2, 32)
    case = make_case(ForwardMode.EXTEND, [100, 3], [20, 70], layout)
    # Longest request 120 tokens, longest extend 70: bounds in steps of 8 between 64 and 128.
    assert case.fb.seq_len_bound == 120 and case.fb.extend_len_bound == 72
    md = TorchPagedBackend(layout, case.req_to_token_pool, case.kv_pool).init_forward_metadata(
        case.fb
    )
    assert md.kv_bound == 120 and md.q_bound == 72
    no_bounds = dataclasses.replace(case.fb, seq_len_bound=None, extend_len_bound=None)
    paged = TorchPagedBackend(layout, case.req_to_token_pool, case.kv_pool)
    md = paged.init_forward_metadata(no_bounds)  # falls back to the static maximum
    assert md.kv_bound == 2048 and md.q_bound == case.fb.num_tokens
    torch.testing.assert_close(run(paged, case, no_bounds), run(paged, case), atol=TOL, rtol=0)


# --- capture / replay --------------------------------------------------------------------


def padded_decode_view(fb: ForwardBatch, bucket: int, fill: int) -> ForwardBatch:
    """What a graph runner hands the backend: the batch padded to its bucket (row 0, slot 0,
    `fill` tokens), with no host mirrors and no eager bound."""
    pad = bucket - fb.batch_size

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((pad,), value, dtype=t.dtype, device=t.device)])

    return dataclasses.replace(
        fb,
        batch_size=bucket,
        input_ids=padded(fb.input_ids, 0) if fb.input_ids is not None else None,
        req_pool_indices=padded(fb.req_pool_indices, 0),
        seq_lens=padded(fb.seq_lens, fill),
        out_cache_loc=padded(fb.out_cache_loc, 0),
        positions=padded(fb.positions, 0) if fb.positions is not None else None,
        seq_lens_cpu=ForbiddenValue("seq_lens_cpu"),  # type: ignore[arg-type]
        seq_lens_sum=ForbiddenValue("seq_lens_sum"),  # type: ignore[arg-type]
        seq_len_bound=None,
    )


def assert_same_metadata(captured: TorchPagedMetadata, eager: TorchPagedMetadata) -> None:
    """Equal wherever eager has data; beyond eager's bound the captured mask hides all."""
    bound = eager.kv_bound
    assert captured.kv_slots.shape[0] == eager.kv_slots.shape[0]
    assert torch.equal(captured.kv_slots[:, :bound], eager.kv_slots)
    assert torch.equal(captured.mask[..., :bound], eager.mask)
    assert not bool(captured.mask[..., bound:].any())


def _decode_case(bs: int, seed: int) -> tuple[int, Case]:
    g = torch.Generator().manual_seed(seed)
    prefix, extend = random_lengths(g, bs, ForwardMode.DECODE, max_len=700)
    return bs, make_case(
        ForwardMode.DECODE, prefix, extend, make_layout(8, 2, 32), seed=seed, max_context_len=1024
    )


def test_capture_then_replay_equals_eager_for_every_bucket() -> None:
    _, first = _decode_case(8, seed=0)
    layout, pool, kv = first.layout, first.req_to_token_pool, first.kv_pool
    paged = TorchPagedBackend(layout, pool, kv)
    paged.init_graph_state(max_bs=8, max_num_tokens=8)
    fill = paged.graph_seq_len_fill_value()
    assert fill == 1
    for bucket in (8, 4, 2, 1):  # largest first, as runners capture
        fb = dataclasses.replace(
            first.fb,
            batch_size=bucket,
            input_ids=first.fb.input_ids[:bucket],
            req_pool_indices=first.fb.req_pool_indices[:bucket],
            seq_lens=first.fb.seq_lens[:bucket],
            out_cache_loc=first.fb.out_cache_loc[:bucket],
            positions=first.fb.positions[:bucket],
        )
        real = max(1, bucket - 1)  # one padded row where the bucket allows it
        fb_real = dataclasses.replace(
            fb,
            batch_size=real,
            input_ids=fb.input_ids[:real],
            req_pool_indices=fb.req_pool_indices[:real],
            seq_lens=fb.seq_lens[:real],
            out_cache_loc=fb.out_cache_loc[:real],
            positions=fb.positions[:real],
        )
        view = padded_decode_view(fb_real, bucket, fill)
        with HostReadGuard():
            captured = paged.init_forward_metadata_capture(bucket, bucket, view)
        bound = length_bound(int(view.seq_lens.max()), 1024)
        eager = paged.init_forward_metadata(dataclasses.replace(view, seq_len_bound=bound))
        assert_same_metadata(captured, eager)
        # The padded row reads row 0 -> slot 0 only.
        if real < bucket:
            assert int(captured.kv_slots[real, 0]) == 0
            assert captured.mask[real, 0, 0].nonzero().flatten().tolist() == [0]


def test_replay_after_another_batch_leaves_nothing_stale() -> None:
    bs, a = _decode_case(4, seed=1)
    paged = TorchPagedBackend(a.layout, a.req_to_token_pool, a.kv_pool)
    paged.init_graph_state(max_bs=4, max_num_tokens=4)
    captured = paged.init_forward_metadata_capture(bs, bs, padded_decode_view(a.fb, bs, 1))
    # A second batch on the same cache: other rows, other (shorter and longer) lengths.
    b_fb = dataclasses.replace(
        a.fb,
        req_pool_indices=a.fb.req_pool_indices.flip(0),
        seq_lens=torch.tensor([1, 300, 33, 2]),
    )
    b_view = padded_decode_view(b_fb, bs, 1)
    captured.kv_slots.fill_(7)  # poison every buffer the graph reads
    captured.mask.fill_(True)
    with HostReadGuard():
        paged.init_forward_metadata_replay(captured, bs, b_view)
    eager = paged.init_forward_metadata(dataclasses.replace(b_view, seq_len_bound=512))
    assert_same_metadata(captured, eager)
    # And attention over the captured metadata equals eager attention for that batch.
    out_graph = paged.forward(a.q, a.k, a.v, 0, dataclasses.replace(b_view, attn_metadata=captured))
    out_eager = paged.forward(a.q, a.k, a.v, 0, dataclasses.replace(b_view, attn_metadata=eager))
    torch.testing.assert_close(out_graph, out_eager, atol=1e-6, rtol=0)


def test_capture_needs_graph_state_and_a_bucket_within_it() -> None:
    _, case = _decode_case(4, seed=2)
    paged = TorchPagedBackend(case.layout, case.req_to_token_pool, case.kv_pool)
    view = padded_decode_view(case.fb, 4, 1)
    with pytest.raises(RuntimeError, match="init_graph_state"):
        paged.init_forward_metadata_capture(4, 4, view)
    paged.init_graph_state(max_bs=2, max_num_tokens=2)
    with pytest.raises(ValueError, match="bs=4 exceeds max_bs=2"):
        paged.init_forward_metadata_capture(4, 4, view)


def test_native_refuses_graph_capture() -> None:
    case = make_case(ForwardMode.DECODE, [3], [1], make_layout(4, 2, 32))
    native = TorchNativeBackend(case.layout, case.req_to_token_pool, case.kv_pool)
    assert not native.supports_graph_capture and native.needs_cpu_seq_lens
    assert native.graph_capture_refusal() == (
        "attention backend 'torch_native' does not support graph capture"
    )
    with pytest.raises(GraphCaptureUnsupportedError):
        native.init_graph_state(4, 4)


# --- through the executor ----------------------------------------------------------------

PROMPTS = [[5, 17, 33, 2, 400, 12], [9], list(range(100, 140)), [7, 7, 7]]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-qwen2"])
def test_greedy_generation_is_identical_with_either_backend(
    make_executor: MakeExecutor, model: str
) -> None:
    outputs = {}
    for name in ("torch_native", "torch_paged"):
        ex = make_executor(model=model, attention_backend=name)
        assert ex.attn_backend.name == name
        outputs[name] = generate(ex.forward, ex.limits, PROMPTS, max_new_tokens=16, ignore_eos=True)
    assert outputs["torch_paged"] == outputs["torch_native"]


def test_step_logits_agree_between_backends(make_executor: MakeExecutor) -> None:
    logits = {}
    for name in ("torch_native", "torch_paged"):
        ex = make_executor(attention_backend=name)
        prefill = make_extend_batch(
            input_ids=[PROMPTS[0], PROMPTS[2]],
            req_pool_indices=[3, 5],
            out_cache_loc=[list(range(1, 7)), list(range(100, 140))],
        )
        first = ex.forward(prefill, return_logits=True).logits
        decode = make_decode_batch(
            input_ids=[1, 2], req_pool_indices=[3, 5], seq_lens=[7, 41], out_cache_loc=[7, 140]
        )
        second = ex.forward(decode, return_logits=True).logits
        assert first is not None and second is not None
        logits[name] = torch.cat([first, second])
    torch.testing.assert_close(logits["torch_paged"], logits["torch_native"], atol=TOL, rtol=0)


# --- selection -----------------------------------------------------------------------------


def test_auto_is_torch_paged_on_cpu(make_executor: MakeExecutor) -> None:
    assert backend_class("auto", torch.device("cpu")) is TorchPagedBackend
    ex = make_executor()
    assert ex.attn_backend.name == "torch_paged" and ex.info.attention_backend == "torch_paged"
    assert ex.toggles.needs_cpu_seq_lens is False


def test_auto_is_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TritonAttnBackend, "check_available", staticmethod(lambda device: None))
    assert backend_class("auto", torch.device("cuda")) is TritonAttnBackend


def test_backends_by_name_and_clear_errors() -> None:
    cpu = torch.device("cpu")
    assert set(BACKEND_NAMES) == {"auto", "torch_native", "torch_paged", "triton"}
    assert backend_class("torch_native", cpu) is TorchNativeBackend
    assert backend_class("torch_paged", cpu) is TorchPagedBackend
    with pytest.raises(ValueError, match=r"'flash' is unknown \(choose from auto, torch_native"):
        backend_class("flash", cpu)
    case = make_case(ForwardMode.DECODE, [1], [1], make_layout(4, 2, 32))
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        create_backend(
            "triton",
            layout=case.layout,
            req_to_token_pool=case.req_to_token_pool,
            kv_pool=case.kv_pool,
            device=cpu,
        )
