"""Sliding-window attention and logit soft-capping on every backend, eager and captured.

Each backend's output is compared with a plain float32 reference written from positions
(a token at position p sees keys at positions p - W + 1..p; scores * scale -> c * tanh(s / c)
-> softmax), on mixed batches: DECODE, EXTEND of fresh prompts and of chunks after a cached
prefix, windows smaller and larger than the context. A windowed layer must not read the K/V
of positions outside its window: those slots are poisoned with NaN and the output must not
change.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable, Iterator

import pytest
import torch

from attention import TorchNativeBackend, TorchPagedBackend, TritonAttnBackend
from attention.base import AttentionBackend, AttentionLayout, LayerAttention
from attention.sdpa import soft_cap
from executor.client.scheduler import generate
from executor.core.buckets import kv_bucket
from executor.core.forward_batch import ForwardBatch, ForwardMode
from executor.core.outputs import ForwardOutput
from executor.graphs.capture_rules import HostReadGuard
from executor.model_executor import ModelExecutor
from ops.device_scope import device_scope
from tests.attention_cases import Case, make_case
from tests.test_attention_backends import padded_decode_view

TOL = 2e-5
CAP = 2.0  # small enough that soft-capping changes the scores of randn q.k
MAX_CONTEXT = 256

# Triton runs on CUDA, or on CPU under its interpreter (tests/conftest.py sets it).
HAS_TRITON = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

Factory = Callable[[Case], AttentionBackend]


@pytest.fixture(autouse=True)
def _in_device_scope() -> Iterator[None]:
    """The Triton backend checks that its CUDA device is current on the calling thread (as
    the executor's device thread makes it); these tests drive backends directly, inside that
    scope. (Executors make their own scope; the CPU backends check nothing.)"""
    with device_scope(torch.device(TRITON_DEVICE)):
        yield


def _native(case: Case) -> AttentionBackend:
    return TorchNativeBackend(case.layout, case.req_to_token_pool, case.kv_pool)


def _paged(case: Case) -> AttentionBackend:
    return TorchPagedBackend(case.layout, case.req_to_token_pool, case.kv_pool)


def _triton(case: Case) -> AttentionBackend:
    # num_sms=64 makes short batches split their keys, so decode's merge really runs.
    return TritonAttnBackend(case.layout, case.req_to_token_pool, case.kv_pool, num_sms=64)


BACKENDS: dict[str, Factory] = {"torch_native": _native, "torch_paged": _paged}
if HAS_TRITON:
    BACKENDS["triton"] = _triton


def _layout(window: int | None, cap: float | None) -> AttentionLayout:
    """Layer 0 windowed and/or soft-capped, layer 1 plain (as Gemma 2 alternates them)."""
    return AttentionLayout(8, 2, 32, 0.1, layers=(LayerAttention(window, cap), LayerAttention()))


def _case(
    mode: ForwardMode,
    prefix: list[int],
    extend: list[int],
    layout: AttentionLayout,
    *,
    device: str = "cpu",
) -> Case:
    return make_case(
        mode,
        prefix,
        extend,
        layout,
        seed=sum(prefix) + len(extend),
        max_context_len=MAX_CONTEXT,
        device=device,
        num_layers=2,
    )


def reference(case: Case, layer_id: int) -> torch.Tensor:
    """Plain float32 attention from positions, over the pool with this step's K/V written."""
    spec = case.layout.layer(layer_id)
    fb = case.fb
    k_pool = case.kv_pool.k[layer_id].float().clone()
    v_pool = case.kv_pool.v[layer_id].float().clone()
    k_pool[fb.out_cache_loc] = case.k.float()
    v_pool[fb.out_cache_loc] = case.v.float()
    group = case.layout.num_heads // case.layout.num_kv_heads
    seq_lens = fb.seq_lens.tolist()
    ext = [1] * fb.batch_size if fb.extend_seq_lens is None else fb.extend_seq_lens.tolist()
    out, start = [], 0
    for i, row in enumerate(fb.req_pool_indices.tolist()):
        slots = case.req_to_token_pool.req_to_token[row, : seq_lens[i]].long()
        keys = k_pool[slots].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        values = v_pool[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        query = case.q[start : start + ext[i]].float().transpose(0, 1)  # [Hq, ext, D]
        scores = query @ keys.transpose(1, 2) * case.layout.scaling  # [Hq, ext, L]
        if spec.logit_softcap is not None:
            scores = soft_cap(scores, spec.logit_softcap)
        q_pos = torch.arange(seq_lens[i] - ext[i], seq_lens[i])[:, None]
        k_pos = torch.arange(seq_lens[i])[None, :]
        visible = k_pos <= q_pos
        if spec.sliding_window is not None:
            visible &= k_pos > q_pos - spec.sliding_window
        probs = scores.masked_fill(~visible.to(scores.device), float("-inf")).softmax(-1)
        out.append((probs @ values).transpose(0, 1))
        start += ext[i]
    return torch.cat(out)


def _eager(backend: AttentionBackend, case: Case, layer_id: int) -> torch.Tensor:
    md = backend.init_forward_metadata(case.fb)
    fb = dataclasses.replace(case.fb, attn_metadata=md)
    return backend.forward(case.q, case.k, case.v, layer_id, fb)


def _captured(backend: AttentionBackend, case: Case, layer_id: int, bucket: int) -> torch.Tensor:
    """DECODE as a graph runner runs it: capture on a batch of padded rows, replay the real
    batch padded to `bucket`, under the host-read guard (no host sync)."""
    bs = case.fb.batch_size
    backend.init_graph_state(max_bs=bucket, max_num_tokens=bucket)
    view = padded_decode_view(case.fb, bucket, backend.graph_seq_len_fill_value())
    synthetic = dataclasses.replace(
        view,
        req_pool_indices=torch.zeros_like(view.req_pool_indices),
        seq_lens=torch.ones_like(view.seq_lens),
    )
    kv = kv_bucket(case.fb.seq_len_bound, MAX_CONTEXT) if backend.graph_kv_bounded else 0
    with HostReadGuard():
        md = backend.init_forward_metadata_capture(bucket, bucket, synthetic, kv)
        backend.init_forward_metadata_replay(md, bucket, view)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((bucket - bs, *t.shape[1:]))])

    fb = dataclasses.replace(view, attn_metadata=md)
    with HostReadGuard():
        out = backend.forward(padded(case.q), padded(case.k), padded(case.v), layer_id, fb)
    return out[:bs]


def _poison_outside_windows(case: Case, layer_id: int) -> int:
    """NaN into the K/V slots of every position no new token's window reaches; the count."""
    window = case.layout.layer(layer_id).sliding_window
    assert window is not None
    fb: ForwardBatch = case.fb
    ext = [1] * fb.batch_size if fb.extend_seq_lens is None else fb.extend_seq_lens.tolist()
    poisoned = 0
    for i, row in enumerate(fb.req_pool_indices.tolist()):
        first_query = int(fb.seq_lens[i]) - ext[i]
        oldest_visible = max(0, first_query - window + 1)
        slots = case.req_to_token_pool.req_to_token[row, :oldest_visible].long()
        case.kv_pool.k[layer_id, slots] = float("nan")
        case.kv_pool.v[layer_id, slots] = float("nan")
        poisoned += len(slots)
    return poisoned


CASES = [
    # (mode, prefix lens, extend lens): decode at mixed lengths; fresh prompts; chunks after
    # a cached prefix (the second chunk of a prompt), and one token after a long prefix.
    (ForwardMode.DECODE, [0, 5, 40, 199], [1, 1, 1, 1]),
    (ForwardMode.EXTEND, [0, 0], [37, 9]),
    (ForwardMode.EXTEND, [20, 64, 3, 150], [12, 40, 1, 1]),
]
WINDOWS = [4, 16, 1000]  # smaller than every context, in between, larger than all


def _eager_grid() -> list[tuple[str, ForwardMode, list[int], list[int], int, float | None]]:
    """Every case x window x cap, except under Triton's interpreter (seconds a case): there a
    covering set, each case with each window once, and every case and every window both with
    and without the cap."""
    interpreted = TRITON_DEVICE == "cpu"
    grid = []
    for backend in BACKENDS:
        for i, (mode, prefix, extend) in enumerate(CASES):
            for j, window in enumerate(WINDOWS):
                for k, cap in enumerate((None, CAP)):
                    if backend != "triton" or not interpreted or (i + j) % 2 == k:
                        grid.append((backend, mode, prefix, extend, window, cap))
    return grid


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "mode", "prefix", "extend", "window", "cap"), _eager_grid())
def test_eager_matches_the_float32_reference(
    backend: str,
    mode: ForwardMode,
    prefix: list[int],
    extend: list[int],
    window: int,
    cap: float | None,
) -> None:
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    case = _case(mode, prefix, extend, _layout(window, cap), device=device)
    impl = BACKENDS[backend](case)
    for layer_id in (0, 1):
        ref = reference(case, layer_id)
        out = _eager(impl, case, layer_id)
        torch.testing.assert_close(out.float(), ref, atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch_native"])
@pytest.mark.parametrize("window", [4, 1000])
def test_captured_decode_matches_the_reference(backend: str, window: int) -> None:
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    case = _case(ForwardMode.DECODE, [0, 30, 199], [1, 1, 1], _layout(window, CAP), device=device)
    impl = BACKENDS[backend](case)
    for layer_id in (0, 1):
        ref = reference(case, layer_id)
        out = _captured(impl, case, layer_id, bucket=4)
        torch.testing.assert_close(out.float(), ref, atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize(("mode", "prefix", "extend"), [CASES[0], CASES[2]])  # cached prefixes
def test_a_windowed_layer_never_reads_keys_outside_its_window(
    backend: str, mode: ForwardMode, prefix: list[int], extend: list[int]
) -> None:
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    case = _case(mode, prefix, extend, _layout(8, CAP), device=device)
    impl = BACKENDS[backend](case)
    before = _eager(impl, case, 0)
    assert _poison_outside_windows(case, 0) > 0
    after = _eager(impl, case, 0)
    assert not after.isnan().any()
    assert torch.equal(after, before)
    if mode is ForwardMode.DECODE and impl.supports_graph_capture:
        captured = _captured(impl, case, 0, bucket=4)
        torch.testing.assert_close(captured, before, atol=TOL, rtol=0)


def test_plain_layouts_build_no_window_metadata() -> None:
    """A model without windows pays nothing: no per-window metadata, no extra gathers."""
    case = _case(ForwardMode.DECODE, [3, 9], [1, 1], AttentionLayout(8, 2, 32, 0.1))
    paged = _paged(case)
    assert paged.init_forward_metadata(case.fb).windows == {}
    paged.init_graph_state(max_bs=2, max_num_tokens=2)
    view = padded_decode_view(case.fb, 2, 1)
    assert paged.init_forward_metadata_capture(2, 2, view, 256).windows == {}


@pytest.mark.slow
def test_the_compiled_step_decode_path_matches_the_reference(graph_compiler: str) -> None:
    """`compiled_step` traces torch_paged's DECODE as indexing, products and sums."""
    case = _case(ForwardMode.DECODE, [0, 30, 199], [1, 1, 1], _layout(8, CAP))
    paged = TorchPagedBackend(case.layout, case.req_to_token_pool, case.kv_pool)
    md = paged.init_forward_metadata(case.fb)
    fb = dataclasses.replace(case.fb, attn_metadata=md)
    refs = [reference(case, layer_id) for layer_id in (0, 1)]
    step = torch.compile(
        lambda layer_id: paged.forward(case.q, case.k, case.v, layer_id, fb),
        fullgraph=True,
        dynamic=False,
        backend=graph_compiler,
    )
    for layer_id in (0, 1):
        torch.testing.assert_close(step(layer_id), refs[layer_id], atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("graph_backend", ["compiled", "compiled_step"])
def test_windowed_model_decodes_alike_on_the_compiled_graph_backends(
    make_executor: Callable[..., ModelExecutor], graph_backend: str, graph_compiler: str
) -> None:
    """tiny-random-gemma2 (windows of 8 on layers 0 and 2, soft-caps): captured DECODE through
    a compiled graph gives the eager path's tokens, past the window."""
    prompts = [list(range(3, 23)), [7, 9, 11]]
    settings = {"model": "tiny-random-gemma2", "max_context_len": 256}
    eager = make_executor(**settings)
    graph = make_executor(
        **settings, graph_mode="decode", graph_backend=graph_backend, graph_batch_sizes="2"
    )
    paths: list[str] = []

    def forward(fb: ForwardBatch, **kwargs: object) -> ForwardOutput:
        out = graph.forward(fb, **kwargs)  # type: ignore[arg-type]
        paths.append(out.stats.path)
        return out

    want = generate(eager.forward, eager.limits, prompts, max_new_tokens=12, ignore_eos=True)
    got = generate(forward, graph.limits, prompts, max_new_tokens=12, ignore_eos=True)
    assert got == want
    assert "full_graph" in paths, paths
