"""The Triton kernels against the torch_native reference.

They run on CUDA where it exists, and on CPU under triton's interpreter when triton is
installed (tests/conftest.py sets TRITON_INTERPRET=1 for the session; the interpreter
executes each program with numpy, so the cases here are kept small). Without triton the
module is skipped with that reason. `gpu` tests add sizes and dtypes only a GPU runs fast.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from attention import TorchNativeBackend, TritonAttnBackend
from attention.base import AttentionLayout
from attention.triton.backend import TritonDecodeMetadata
from executor.client.scheduler import generate
from executor.core.buckets import length_bound
from executor.core.forward_batch import ForwardBatch, ForwardMode
from executor.model_executor import ModelExecutor
from ops.device_scope import device_scope
from tests.attention_cases import Case, make_case, make_layout, run
from tests.test_attention_backends import padded_decode_view

pytest.importorskip(
    "triton",
    reason="triton is not installed; its kernels are checked on CUDA, or on CPU under "
    "TRITON_INTERPRET=1 (set by tests/conftest.py when triton is importable)",
)

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip(
        "no CUDA, and TRITON_INTERPRET is not 1: triton kernels cannot run here",
        allow_module_level=True,
    )

MakeExecutor = Callable[..., ModelExecutor]
TOL = 1e-5


@pytest.fixture(autouse=True)
def _in_device_scope() -> Iterator[None]:
    """The backend checks that its device is current on the calling thread (as the executor's
    device thread makes it): every test here drives it directly, inside that scope."""
    with device_scope(torch.device(DEVICE)):
        yield


# num_sms=64 makes short batches split their keys, so both decode stages really merge.
SPLITTING = 64


def _compare(case: Case, **backend_kwargs: int) -> tuple[float, TritonAttnBackend]:
    native = TorchNativeBackend(case.layout, case.req_to_token_pool, case.kv_pool)
    triton_backend = TritonAttnBackend(
        case.layout, case.req_to_token_pool, case.kv_pool, **backend_kwargs
    )
    ref, out = run(native, case), run(triton_backend, case)
    assert out.shape == ref.shape
    return float((out.float() - ref.float()).abs().max()), triton_backend


def test_kv_indices_are_built_on_device_from_the_row_table() -> None:
    g = torch.Generator().manual_seed(0)
    table = torch.randint(1, 10_000, (8, 2048), generator=g, dtype=torch.int32)
    rows = torch.tensor([3, 0, 7, 1, 5, 2])
    lens = torch.tensor([0, 1, 511, 512, 513, 1500])  # across the copy block of 512
    indptr = torch.zeros(7, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    out = torch.full((int(lens.sum()) + 5,), -1, dtype=torch.int64, device=DEVICE)
    from attention.triton.kv_indices import create_kv_indices

    create_kv_indices(table.to(DEVICE), rows.to(DEVICE), lens.to(DEVICE), indptr.to(DEVICE), out)
    expected = torch.cat([table[r, :n] for r, n in zip(rows.tolist(), lens.tolist(), strict=True)])
    assert torch.equal(out[: expected.numel()].cpu(), expected.long())
    assert out[expected.numel() :].tolist() == [-1] * 5  # nothing past the end


@pytest.mark.slow
@pytest.mark.parametrize("geometry", [(8, 2, 64), (4, 4, 32), (16, 1, 48)])
def test_split_kv_decode_matches_native(geometry: tuple[int, int, int]) -> None:
    # Lengths around the block (32/64) and split (128) sizes; 1025 leaves its last split empty.
    prefix = [0, 31, 32, 64, 128, 600, 1024, 2047]
    case = make_case(
        ForwardMode.DECODE, prefix, [1] * len(prefix), make_layout(*geometry), seed=1, device=DEVICE
    )
    diff, backend = _compare(case, num_sms=SPLITTING)
    md = backend.init_forward_metadata(case.fb)
    assert isinstance(md, TritonDecodeMetadata)
    assert md.num_kv_splits.max() > 1  # really split
    assert diff <= TOL


def test_decode_with_a_single_split_matches_native() -> None:
    prefix = [5, 300, 129]
    case = make_case(
        ForwardMode.DECODE, prefix, [1] * 3, make_layout(8, 2, 64), seed=2, device=DEVICE
    )
    diff, backend = _compare(case, num_sms=1)
    md = backend.init_forward_metadata(case.fb)
    assert isinstance(md, TritonDecodeMetadata) and md.num_kv_splits.tolist() == [1, 1, 1]
    assert diff <= TOL


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prefix", "extend"),
    [
        ([0], [1]),
        ([0, 0], [33, 70]),  # fresh prompts across the query (32) and key (64) blocks
        ([300, 0, 64, 2], [45, 100, 1, 31]),  # cached prefixes of mixed lengths
    ],
)
@pytest.mark.parametrize("geometry", [(8, 2, 64), (4, 4, 32)])
def test_extend_matches_native(
    prefix: list[int], extend: list[int], geometry: tuple[int, int, int]
) -> None:
    case = make_case(
        ForwardMode.EXTEND, prefix, extend, make_layout(*geometry), seed=3, device=DEVICE
    )
    diff, _ = _compare(case)
    assert diff <= TOL


@pytest.mark.slow
def test_capture_then_replay_equals_eager_and_leaves_nothing_stale() -> None:
    layout = make_layout(8, 2, 32)
    a = make_case(
        ForwardMode.DECODE,
        [10, 200, 0],
        [1] * 3,
        layout,
        seed=4,
        device=DEVICE,
        max_context_len=512,
    )
    backend = TritonAttnBackend(layout, a.req_to_token_pool, a.kv_pool, num_sms=SPLITTING)
    backend.init_graph_state(max_bs=4, max_num_tokens=4)
    bucket = 4
    view_a = padded_decode_view(a.fb, bucket, 1)
    captured = backend.init_forward_metadata_capture(bucket, bucket, _to(view_a))
    _assert_same(captured, backend.init_forward_metadata(_eager(view_a)))

    b_fb = dataclasses.replace(
        a.fb,
        req_pool_indices=a.fb.req_pool_indices.flip(0),
        seq_lens=torch.tensor([300, 1, 57], device=DEVICE),
    )
    view_b = padded_decode_view(b_fb, bucket, 1)
    captured.kv_indptr.fill_(-5)  # poison everything the graph reads
    captured.kv_indices.fill_(-1)
    captured.num_kv_splits.fill_(99)
    backend.init_forward_metadata_replay(captured, bucket, _to(view_b))
    eager = backend.init_forward_metadata(_eager(view_b))
    _assert_same(captured, eager)
    # Attention over the captured metadata equals eager attention for that padded batch.
    q = torch.randn(bucket, layout.num_heads, layout.head_dim, device=DEVICE)
    k = torch.randn(bucket, layout.num_kv_heads, layout.head_dim, device=DEVICE)
    out_graph = backend.forward(
        q, k, k, 0, dataclasses.replace(_to(view_b), attn_metadata=captured)
    )
    out_eager = backend.forward(q, k, k, 0, dataclasses.replace(_to(view_b), attn_metadata=eager))
    torch.testing.assert_close(out_graph, out_eager, atol=1e-6, rtol=0)


def _to(fb: ForwardBatch) -> ForwardBatch:
    return fb.to(torch.device(DEVICE))


def _eager(view: ForwardBatch) -> ForwardBatch:
    return _to(dataclasses.replace(view, seq_len_bound=length_bound(int(view.seq_lens.max()), 512)))


def _assert_same(captured: TritonDecodeMetadata, eager: TritonDecodeMetadata) -> None:
    total = int(eager.kv_indptr[-1])
    assert torch.equal(captured.kv_indptr, eager.kv_indptr)
    assert torch.equal(captured.kv_indices[:total], eager.kv_indices[:total])
    assert torch.equal(captured.num_kv_splits, eager.num_kv_splits)
    assert captured.launch == eager.launch


def _triton_executor(make_executor: MakeExecutor) -> ModelExecutor:
    if DEVICE == "cuda":
        return make_executor(attention_backend="triton", device="cuda", dtype="float32")
    # On CPU create_backend refuses triton, so put an interpreted backend in by hand.
    ex = make_executor()
    backend = TritonAttnBackend(ex.attn_backend.layout, ex.req_to_token_pool, ex.kv_pool)
    ex.attn_backend = ex.runner.attn_backend = backend
    return ex


@pytest.mark.slow
def test_greedy_generation_through_the_executor_matches_native(make_executor: MakeExecutor) -> None:
    prompts = [[5, 17, 33, 2, 400, 12], [9], list(range(100, 140))]
    ex = _triton_executor(make_executor)
    ours = generate(ex.forward, ex.limits, prompts, max_new_tokens=6, ignore_eos=True)
    ref_ex = make_executor(attention_backend="torch_native", device=DEVICE, dtype="float32")
    ref = generate(ref_ex.forward, ref_ex.limits, prompts, max_new_tokens=6, ignore_eos=True)
    assert ours == ref


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, pytest.param(90, marks=pytest.mark.long)])
def test_kernels_compile_for_gpu_targets(tmp_path: Path, arch: int) -> None:
    """Lower every kernel to cubin for a GPU target (no GPU needed): catches what the
    lenient interpreter would let through, and shared-memory overruns (`--quick`: the
    geometries that bound it; the script alone runs every one on both targets)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [
            sys.executable,
            str(root / "tests" / "triton_compile_check.py"),
            "--quick",
            "--arch",
            str(arch),
        ],
        cwd=root,
        env={**env, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
    )
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout + result.stderr


# --- GPU only: sizes and dtypes the interpreter is too slow for ---------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_large_random_batches_match_native_on_gpu(mode: ForwardMode) -> None:
    from tests.attention_cases import random_lengths

    g = torch.Generator().manual_seed(5)
    layout = make_layout(32, 8, 128)
    for seed in range(3):
        prefix, extend = random_lengths(g, 32, mode, max_len=4096)
        case = make_case(
            mode,
            prefix,
            extend,
            layout,
            seed=seed,
            device="cuda",
            max_context_len=4096,
            max_reqs=64,
        )
        diff, _ = _compare(case)
        assert diff <= TOL, (prefix, extend)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_bfloat16_matches_native_on_gpu(mode: ForwardMode) -> None:
    prefix = [0, 100, 1000, 3000]
    extend = [1] * 4 if mode is ForwardMode.DECODE else [17, 64, 1, 200]
    layout = AttentionLayout(16, 4, 64, 64**-0.5)
    case = make_case(
        mode,
        prefix,
        extend,
        layout,
        seed=6,
        device="cuda",
        dtype=torch.bfloat16,
        max_context_len=4096,
    )
    diff, _ = _compare(case)
    assert diff <= 2e-2
