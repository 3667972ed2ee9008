"""Each op against a plain formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ops import add_rms_norm, rms_norm, silu_and_mul, store_kv
from ops.rotary import RotaryEmbedding


def test_rms_norm_matches_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g)
    w = torch.randn(32, generator=g)
    expected = torch.stack([w * row / math.sqrt(float((row**2).mean()) + 1e-6) for row in x])
    torch.testing.assert_close(rms_norm(x, w, 1e-6), expected, rtol=1e-5, atol=1e-6)


def test_rms_norm_keeps_dtype_and_accumulates_in_float32() -> None:
    x = torch.randn(3, 16).to(torch.bfloat16)
    w = torch.ones(16, dtype=torch.bfloat16)
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), rms_norm(x.float(), w.float(), 1e-5), rtol=1e-2, atol=1e-2
    )


def test_add_rms_norm_returns_sum_as_residual() -> None:
    x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    normed, residual = add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(residual, x + r)
    torch.testing.assert_close(normed, rms_norm(x + r, w, 1e-6))
    normed, residual = add_rms_norm(x, None, w, 1e-6)
    assert residual is x


def test_silu_and_mul_matches_formula() -> None:
    gate, up = torch.randn(6, 10), torch.randn(6, 10)
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul(torch.cat([gate, up], -1)), expected)


def test_rotary_matches_complex_rotation_of_halves() -> None:
    """Rotating the pair (x[i], x[i + D/2]) by angle pos * theta^(-2i/D) is a complex multiply."""
    head_dim, theta = 16, 10000.0
    rope = RotaryEmbedding(head_dim, 64, theta)
    positions = torch.tensor([0, 1, 7, 63])
    q = torch.randn(4, 3, head_dim)
    k = torch.randn(4, 1, head_dim)
    q_rot, k_rot = rope(positions, q, k)
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    angle = positions.double()[:, None] * freqs[None, :]  # [T, D/2]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]  # [T, 1, D/2]
    for x, x_rot in ((q, q_rot), (k, k_rot)):
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot
        expected = torch.cat([z.real, z.imag], dim=-1).float()
        torch.testing.assert_close(x_rot, expected, rtol=1e-4, atol=1e-5)


def test_rotary_position_zero_is_identity() -> None:
    rope = RotaryEmbedding(8, 4, 10000.0)
    q, k = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    q_rot, k_rot = rope(torch.tensor([0]), q, k)
    torch.testing.assert_close(q_rot, q)
    torch.testing.assert_close(k_rot, k)


def test_store_kv_writes_only_the_given_slots_of_the_given_layer() -> None:
    k_pool = torch.zeros(3, 10, 2, 4)
    v_pool = torch.zeros(3, 10, 2, 4)
    loc = torch.tensor([3, 7, 1])
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    store_kv(k_pool, v_pool, 1, loc, k, v)
    torch.testing.assert_close(k_pool[1, loc], k)
    torch.testing.assert_close(v_pool[1, loc], v)
    untouched = torch.ones(3, 10, dtype=torch.bool)
    untouched[1, loc] = False
    assert bool((k_pool[untouched] == 0).all()) and bool((v_pool[untouched] == 0).all())


@pytest.mark.slow
def test_store_kv_inside_a_compiled_graph_writes_the_pool_in_place_without_copying_it() -> None:
    """Under torch.compile the write is an `index_put_` on the whole pool, which inductor
    turns into a scatter of the new rows: only the given slots of the given layer change, in
    the pool itself, and the generated code allocates nothing of the pool's size (a write
    through a layer's view made it copy the whole pool every step)."""
    from torch._inductor.utils import run_and_get_code

    pool_k, pool_v = torch.zeros(3, 1000, 2, 4), torch.zeros(3, 1000, 2, 4)
    ptr = pool_k.data_ptr()
    loc = torch.tensor([3, 7])
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)

    @torch.compile(fullgraph=True, backend="inductor")
    def write_layer_1(loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store_kv(pool_k, pool_v, 1, loc, k, v)
        return pool_k[1].sum() + pool_v[1].sum()  # read after the write, as attention does

    with torch.inference_mode():
        total, codes = run_and_get_code(write_layer_1, loc, k, v)
    assert float(total) == pytest.approx(float(k.sum() + v.sum()), rel=1e-5)
    torch.testing.assert_close(pool_k[1, loc], k)
    torch.testing.assert_close(pool_v[1, loc], v)
    assert float(pool_k.abs().sum()) == pytest.approx(float(k.abs().sum()), rel=1e-5)
    assert float(pool_v.abs().sum()) == pytest.approx(float(v.abs().sum()), rel=1e-5)
    assert pool_k.data_ptr() == ptr
    allocations = [line for code in codes for line in code.splitlines() if "empty_strided" in line]
    assert not [line for line in allocations if "1000" in line], allocations


def test_store_kv_casts_to_cache_dtype() -> None:
    k_pool = torch.zeros(1, 4, 1, 2, dtype=torch.bfloat16)
    v_pool = torch.zeros(1, 4, 1, 2, dtype=torch.bfloat16)
    store_kv(k_pool, v_pool, 0, torch.tensor([2]), torch.ones(1, 1, 2), torch.full((1, 1, 2), 2.0))
    assert k_pool[0, 2].float().eq(1).all() and v_pool[0, 2].float().eq(2).all()


def test_silu_matches_torch() -> None:
    x = torch.randn(3, 8)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :4]) * x[:, 4:])
