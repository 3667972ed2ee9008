"""The fused Triton kernels of `ops/triton_fused.py` against their torch references.

On CUDA where it exists, else on CPU under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1; the interpreter runs each program with numpy, so shapes stay small).
float32 results equal the reference to float32 rounding; bfloat16 and float16 ones are within
one step of their dtype (the kernels round once where torch rounds after every op).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ops.activation import silu_and_mul_reference
from ops.rmsnorm import add_rms_norm_reference
from ops.rotary import RotaryEmbedding, apply_rotary

pytest.importorskip(
    "triton",
    reason="triton is not installed; its kernels are checked on CUDA, or on CPU under "
    "TRITON_INTERPRET=1 (set by tests/conftest.py when triton is importable)",
)

if torch.cuda.is_available():
    DEVICE = torch.device("cuda")
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
else:
    pytest.skip(
        "no CUDA, and TRITON_INTERPRET is not 1: triton kernels cannot run here",
        allow_module_level=True,
    )

from ops import triton_fused  # after the interpreter check: the kernels decorate at import

# Per dtype: (rtol, atol) against the reference.
TOL = {
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (2e-3, 1e-3),
}
DTYPES = list(TOL)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "hidden", "residual"), [(1, 64, True), (5, 96, True), (3, 48, False)]
)
def test_add_rms_norm_equals_the_reference(
    dtype: torch.dtype, rows: int, hidden: int, residual: bool
) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype)
    res = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype) if residual else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    got, got_sum = triton_fused.add_rms_norm(x, res, w, 1e-6)
    want, want_sum = add_rms_norm_reference(x, res, w, 1e-6)
    _close(got, want, dtype)
    if dtype is torch.float32:
        assert torch.equal(got_sum, want_sum)  # the residual stream is exactly torch's sum
    else:  # one rounding step (the interpreter's downcast truncates; CUDA's rounds to nearest)
        _close(got_sum, want_sum, dtype)
    if not residual:
        assert got_sum is x


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_over_heads_of_a_strided_view(dtype: torch.dtype) -> None:
    """q/k norm: a [T, H, D] view into the fused QKV output (row stride > H * D)."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(4, 3 * 32 + 16, generator=g).to(DEVICE, dtype)
    q = qkv[:, : 3 * 32].view(4, 3, 32)
    w = torch.rand(32, generator=g).to(DEVICE, dtype)
    got, _ = triton_fused.add_rms_norm(q, None, w, 1e-5)
    want, _ = add_rms_norm_reference(q, None, w, 1e-5)
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "q_heads", "k_heads", "head_dim"), [(1, 4, 2, 16), (6, 3, 1, 64)]
)
def test_rotary_equals_the_reference(
    dtype: torch.dtype, tokens: int, q_heads: int, k_heads: int, head_dim: int
) -> None:
    rope = RotaryEmbedding(head_dim, 512, 10000.0, device=DEVICE)
    g = torch.Generator().manual_seed(tokens)
    # q, k as the attention's split of the fused projection: strided rows.
    width = (q_heads + 2 * k_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=g).to(DEVICE, dtype)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + k_heads) * head_dim].view(tokens, k_heads, head_dim)
    positions = torch.randint(0, 512, (tokens,), generator=g).to(DEVICE)
    got_q, got_k = triton_fused.rotary(positions, q, k, rope.cos_cache, rope.sin_cache)
    want_q, want_k = apply_rotary(q, k, rope.cos_cache[positions], rope.sin_cache[positions])
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 64), (3, 1536 + 24)])
def test_silu_and_mul_equals_the_reference(dtype: torch.dtype, tokens: int, inter: int) -> None:
    g = torch.Generator().manual_seed(inter)
    gate_up = (3 * torch.randn(tokens, 2 * inter, generator=g)).to(DEVICE, dtype)
    _close(triton_fused.silu_and_mul(gate_up), silu_and_mul_reference(gate_up), dtype)


def test_empty_batches_launch_nothing() -> None:
    x = torch.empty(0, 32, device=DEVICE)
    out, summed = triton_fused.add_rms_norm(x, x, torch.ones(32, device=DEVICE), 1e-6)
    assert out.shape == summed.shape == (0, 32)
    assert triton_fused.silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)


def test_the_torch_reference_runs_on_cpu_tensors() -> None:
    """The dispatch: CPU tensors take the reference (the fused kernels are the CUDA path)."""
    from ops.fused_dispatch import use_triton

    assert not use_triton(torch.ones(2))
    if torch.cuda.is_available():
        assert use_triton(torch.ones(2, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_on_cuda_runs_the_fused_kernels_and_matches_the_torch_ops(
    make_executor: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """tiny-random on CUDA, eager: logits with the fused kernels (the default there) equal
    those with the torch references; the profiler sees the fused kernels launched."""
    import ops.activation
    import ops.rmsnorm
    import ops.rotary
    from executor.batch_prep import make_extend_batch

    def logits(ex: Any) -> torch.Tensor:
        batch = make_extend_batch(
            input_ids=[[5, 9, 200, 31, 7]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3, 4, 5]]
        )
        out = ex.forward(batch, return_logits=True).logits
        assert out is not None
        return out.float().cpu()

    config = {"device": "cuda", "dtype": dtype, "graph_mode": "none"}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fused = logits(make_executor(**config))
    names = " ".join(e.name for e in prof.events())
    for kernel in ("_add_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"):
        assert kernel in names
    for mod in (ops.rmsnorm, ops.rotary, ops.activation):
        monkeypatch.setattr(mod, "use_triton", lambda t: False)
    reference = logits(make_executor(**config))
    if dtype == "float32":
        torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
        return
    # bfloat16: the fused kernels keep the residual sum in float32 where the torch ops round it,
    # so the two differ by bfloat16 rounding that grows through the layers. The check: against
    # the float32 model's logits, the fused run is no further off than the torch ops' run.
    exact = logits(make_executor(**{**config, "dtype": "float32"}))
    fused_err = (fused - exact).abs().max().item()
    torch_err = (reference - exact).abs().max().item()
    assert fused_err <= 2 * torch_err + 1e-3, (fused_err, torch_err)
