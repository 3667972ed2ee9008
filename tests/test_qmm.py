"""The CPU group-quantized matmul (`ops/qmm.py`, `ops/qmm_kernel.c`): its vector and scalar code
against a float64 reference of the same arithmetic, the layer that runs it, and its op inside
a compiled graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.models.quant_formats import GroupQuant, quantize_int4
from executor.models.quantized import GroupQmmLinear, Int4Linear
from ops import qmm

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> qmm.QmmKernel:
    try:
        return qmm.load(tmp_path_factory.mktemp("qmm"))
    except qmm.QmmUnavailable as e:
        pytest.skip(f"no qmm kernel on this machine: {e}")


def reference(x: torch.Tensor, w: GroupQuant) -> torch.Tensor:
    """What the kernel computes, in float64: x quantized to int8 per half group of 16 (scale
    max|x| / 127, round half to even), times the stored values, scaled, plus the mins times
    the groups' exact sums."""
    m, k = x.shape
    xh = x.reshape(m, k // 16, 16)
    amax = xh.abs().amax(-1)  # float32, as in C
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    qx = torch.round(xh * inv[..., None]).double()
    dx = (amax / 127).double()
    q = w.q.double().reshape(w.shape[0], k // 16, 16)
    scale, mn = (t.double() for t in halves(w))  # what the kernel stores
    dots = torch.einsum("mhi,nhi->mnh", qx, q) * dx[:, None]  # [m, n, halves]
    per_group = dots.reshape(m, w.shape[0], k // 32, 2).sum(-1)
    sums = x.double().reshape(m, k // 32, 32).sum(-1)
    return (scale[None] * per_group).sum(-1) + sums @ mn.T


def halves(w: GroupQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales and mins as the kernel takes them: IEEE halves."""
    return w.scale.half().contiguous(), (w.zero - w.offset * w.scale).half().contiguous()


def eight_bit(n: int, k: int) -> GroupQuant:
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int16)
    scale = torch.rand(n, k // 32, generator=g) * 0.01
    return GroupQuant(q, scale, torch.zeros_like(scale), bits=8, source="Q8_0")


@pytest.mark.parametrize("m", [1, 3, 4, 5, 70])  # one row, the 4-row tile, its tail, two blocks
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_computes_the_reference(kernel: qmm.QmmKernel, m: int, bits: int) -> None:
    n, k = 48, 96
    torch.manual_seed(m)
    w = quantize_int4(torch.randn(n, k)) if bits == 4 else eight_bit(n, k)
    x = torch.randn(m, k)
    x[0, :32] = 0  # an all-zero group: scale 0, no division by zero
    y = kernel.matmul(x, qmm.pack_groups(w.q, bits), *halves(w), bits)
    torch.testing.assert_close(y.double(), reference(x, w), rtol=1e-4, atol=1e-4)


def test_the_scalar_build_computes_the_same(tmp_path: Path, kernel: qmm.QmmKernel) -> None:
    """The portable code (what a CPU without AVX2 would build) against the vector code."""
    flags = tuple(f for f in qmm.CFLAGS if f != "-march=native") + ("-march=x86-64",)
    scalar = qmm.open_library(qmm.build(tmp_path, flags))
    assert scalar.isa == "scalar" and kernel.isa.startswith("avx2")
    for bits in (4, 8):
        w = quantize_int4(torch.randn(40, 64)) if bits == 4 else eight_bit(40, 64)
        args = (qmm.pack_groups(w.q, bits), *halves(w), bits)
        x = torch.randn(6, 64)
        torch.testing.assert_close(scalar.matmul(x, *args), kernel.matmul(x, *args))


def test_a_cpu_without_avx2_gets_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(qmm, "CFLAGS", (*qmm.CFLAGS, "-mno-avx2"))
    with pytest.raises(qmm.QmmUnavailable, match="no AVX2"):
        qmm.load(tmp_path)


def test_the_layer_matches_the_torch_int4_layer(kernel: qmm.QmmKernel) -> None:
    torch.manual_seed(0)
    w = quantize_int4(torch.randn(64, 128) * 0.05)
    bias = torch.randn(64)
    ours, theirs = GroupQmmLinear(w, bias, device=CPU), Int4Linear(w, bias, device=CPU)
    x = torch.randn(2, 3, 128)
    exact = x @ w.dequantize().T + bias
    assert ours(x).shape == (2, 3, 64)
    # Both quantize activations (int8 here, bfloat16 there): a percent of the exact product.
    for out in (ours(x), theirs(x)):
        assert (out - exact).norm() / exact.norm() < 0.02


@pytest.mark.slow
def test_a_compiled_graph_calls_the_kernel_as_an_op(kernel: qmm.QmmKernel) -> None:
    torch.manual_seed(1)
    layer = GroupQmmLinear(quantize_int4(torch.randn(32, 64)), None, device=CPU)
    x = torch.randn(4, 64)
    compiled = torch.compile(lambda t: torch.relu(layer(t)) * 2, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), torch.relu(layer(x)) * 2)


def test_without_a_compiler_the_portable_prebuilt_kernel_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: qmm.QmmKernel
) -> None:
    """The runtime image has no compiler: the build stage's portable library is used instead
    (only on a CPU with what it was compiled for), and computes what the native build does."""
    portable = qmm.build(tmp_path / "build", qmm.PORTABLE_CFLAGS)
    monkeypatch.setattr(qmm.native_build.shutil, "which", lambda _: None)
    monkeypatch.setattr(qmm, "PREBUILT", tmp_path / "missing.so")
    with pytest.raises(qmm.QmmUnavailable, match="no C compiler"):
        qmm.load(tmp_path / "cache")
    monkeypatch.setattr(qmm, "PREBUILT", portable)
    monkeypatch.setattr(qmm, "_OP_KERNEL", [])
    loaded = qmm.load(tmp_path / "cache")
    assert loaded.path == portable and loaded.isa == "avx2"
    w = quantize_int4(torch.randn(32, 64))
    args = (qmm.pack_groups(w.q, 4), *halves(w), 4)
    x = torch.randn(3, 64)
    torch.testing.assert_close(loaded.matmul(x, *args), kernel.matmul(x, *args))
    monkeypatch.setattr(qmm, "_cpu_signature", lambda: "flags : sse2 avx")
    monkeypatch.setattr(qmm, "_LOADED", {})
    with pytest.raises(qmm.QmmUnavailable, match="prebuilt kernel needs avx2"):
        qmm.load(tmp_path / "cache")
