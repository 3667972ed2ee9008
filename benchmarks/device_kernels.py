"""The GPU check's kernel stages.

`attention`: the Triton and torch_paged backends against a float64 reference (torch_native on
a float64 copy of the same case: pool, row table, q/k/v), on SmolLM2's head geometry (9/3/64)
and a larger one (32/8/128), DECODE at batch 1/16/64 x context 128/1024/4096 and EXTEND after
a cached prefix and of one long fresh prompt, in float32 and bfloat16. Metric: the relative
error |out - ref| / |ref| (Frobenius); limits: float32 1e-5 (the kernels' dots are IEEE),
bfloat16 1e-2, never a NaN.

`kernels`: one bs-1 DECODE step of the SmolLM2-shaped model under the profiler, three ways
(eager with the small ops as torch ops, eager with the fused Triton kernels, the full graph):
GPU kernels, launch calls (a graph launch counts one), memory copies each way, and blocking
synchronizations, plus the step's own transfer counts.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch

from attention import TorchNativeBackend, TorchPagedBackend, TritonAttnBackend
from attention.base import AttentionBackend
from benchmarks.device_common import Context, StageResult, build, markdown_table
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.core.forward_batch import ForwardMode
from executor.kv_cache import KVPool
from ops.device_scope import device_scope
from tests.attention_cases import Case, make_case, make_layout, run

LIMITS = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def attention_cases(
    dry_run: bool,
) -> list[tuple[str, tuple[int, int, int], ForwardMode, list[int], list[int]]]:
    """(label, (heads, kv heads, head dim), mode, prefix lengths, extend lengths)."""
    if dry_run:
        geometries, decodes = [(4, 2, 16)], [(1, 64), (4, 16)]
        extends = [([8, 3], [8, 5])]
    else:
        geometries = [(9, 3, 64), (32, 8, 128)]
        decodes = [(1, 128), (1, 4096), (16, 1024), (64, 128), (64, 1024)]
        extends = [([512] * 4, [512] * 4), ([0], [2048])]
    out = []
    for geo in geometries:
        for bs, ctx_len in decodes:
            label = f"decode bs {bs} ctx {ctx_len}"
            out.append((label, geo, ForwardMode.DECODE, [ctx_len - 1] * bs, [1] * bs))
        for prefix, extend in extends:
            label = f"extend {len(prefix)}x(+{extend[0]} after {prefix[0]})"
            out.append((label, geo, ForwardMode.EXTEND, prefix, extend))
    return out


def float64_copy(case: Case) -> Case:
    kv = case.kv_pool
    pool = KVPool(
        kv.num_slots, kv.num_layers, kv.num_kv_heads, kv.head_dim, torch.float64, kv.device
    )
    pool.k.copy_(kv.k)
    pool.v.copy_(kv.v)
    return dataclasses.replace(
        case, kv_pool=pool, q=case.q.double(), k=case.k.double(), v=case.v.double()
    )


def _backends(ctx: Context, case: Case) -> dict[str, AttentionBackend]:
    out: dict[str, AttentionBackend] = {
        "torch_paged": TorchPagedBackend(case.layout, case.req_to_token_pool, case.kv_pool)
    }
    if ctx.cuda:
        out["triton"] = TritonAttnBackend(case.layout, case.req_to_token_pool, case.kv_pool)
    return out


def attention_stage(ctx: Context) -> StageResult:
    rows: list[list[Any]] = []
    failures: list[str] = []
    worst: dict[str, float] = {}
    with device_scope(ctx.device):
        for label, geo, mode, prefix, extend in attention_cases(ctx.dry_run):
            for dtype in (torch.float32, torch.bfloat16):
                seed = len(rows)
                case = make_case(
                    mode,
                    prefix,
                    extend,
                    make_layout(*geo),
                    seed=seed,
                    dtype=dtype,
                    device=ctx.device,
                    max_context_len=max(p + e for p, e in zip(prefix, extend, strict=True)) + 8,
                    max_reqs=max(16, len(prefix)),
                )
                exact = float64_copy(case)
                ref = run(
                    TorchNativeBackend(exact.layout, exact.req_to_token_pool, exact.kv_pool), exact
                )
                for name, backend in _backends(ctx, case).items():
                    out = run(backend, case).double()
                    err = float((out - ref).norm() / ref.norm())
                    bad = bool(out.isnan().any()) or not err <= LIMITS[dtype]
                    key = f"{name} {str(dtype).removeprefix('torch.')}"
                    worst[key] = max(worst.get(key, 0.0), err)
                    if bad:
                        failures.append(f"{name} {geo} {label} {dtype}: rel err {err:.2e}")
                    rows.append(
                        [
                            name,
                            "/".join(map(str, geo)),
                            label,
                            str(dtype).removeprefix("torch."),
                            f"{err:.2e}",
                            "FAIL" if bad else "ok",
                        ]
                    )
                del case, exact
    lines = markdown_table(
        ["backend", "heads", "case", "dtype", "rel err vs float64", "verdict"], rows
    )
    lines += [f"- {f}" for f in failures]
    figures = "max rel err: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items()))
    figures += f"; {len(rows) - len(failures)}/{len(rows)} within limits"
    return StageResult("FAIL" if failures else "PASS", figures, lines, {"worst": worst})


# --- kernels and syncs per decode step ----------------------------------------------------
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
GRAPH_LAUNCH = "cudaGraphLaunch"
# Blocking calls the step makes (the profile's own closing cudaDeviceSynchronize is not one).
BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def count_events(events: list[Any], on_cuda: bool) -> dict[str, int]:
    """Kernels, launch calls, copies and blocking syncs in one profiled step."""
    from torch.autograd import DeviceType

    c: Counter[str] = Counter()
    attached = 0  # kernels hung on their launching CPU events (where none are listed apart)
    for e in events:
        attached += len(getattr(e, "kernels", []) or [])
        name = e.name
        if on_cuda and e.device_type == DeviceType.CUDA:
            if name.startswith("Memcpy HtoD"):
                c["h2d copies"] += 1
            elif name.startswith("Memcpy DtoH"):
                c["d2h copies"] += 1
            elif not name.startswith(("Memcpy", "Memset")):
                c["kernels"] += 1
        elif name in LAUNCHES:
            c["launches"] += 1
        elif name == GRAPH_LAUNCH:
            c["graph launches"] += 1
        elif name in BLOCKING:
            c["blocking syncs"] += 1
        elif not on_cuda and name.startswith("aten::"):
            c["aten ops"] += 1
    if on_cuda and not c["kernels"] and attached:
        c["kernels"] = attached
    return dict(c)


def profile_step(ex: Any, row: int, base: int) -> tuple[dict[str, int], Any]:
    """Prefill 8 tokens in `row`, one warm DECODE step, then one profiled DECODE step."""
    from torch.profiler import ProfilerActivity, profile

    slots = list(range(base, base + 10))
    prompt = list(range(3, 11))
    ex.forward(
        make_extend_batch(input_ids=[prompt], req_pool_indices=[row], out_cache_loc=[slots[:8]])
    )

    def step(n: int) -> Any:
        batch = make_decode_batch(
            input_ids=[5], req_pool_indices=[row], seq_lens=[n + 1], out_cache_loc=[slots[n]]
        )
        return ex.forward(batch)

    step(8)
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if ex.device.type == "cuda" else []
    )
    with profile(activities=activities) as prof:
        out = step(9)
        if ex.device.type == "cuda":
            torch.cuda.synchronize()
    return count_events(list(prof.events()), ex.device.type == "cuda"), out.stats


def kernels_stage(ctx: Context) -> StageResult:
    from benchmarks import kernel_count

    ex = build(ctx, ctx.main_model, "bfloat16", graph_batch_sizes="1", piecewise_token_sizes="16")
    variants: list[tuple[str, bool | None, str]] = [
        ("eager, torch ops", False, "none"),
        ("eager, fused Triton", True, "none"),
        ("full_graph", None, "decode"),
    ]
    rows: list[list[Any]] = []
    details: dict[str, Any] = {}
    failures: list[str] = []
    import ops.activation
    import ops.rmsnorm
    import ops.rotary

    mods = (ops.rmsnorm, ops.rotary, ops.activation)
    saved = [m.use_triton for m in mods]
    for i, (name, fused, mode) in enumerate(variants):
        ex.control.set_graph_mode(mode)
        if fused is not None and ctx.cuda:  # the CPU runs the torch ops (no Triton there)
            for m in mods:
                m.use_triton = (lambda t: True) if fused else (lambda t: False)  # type: ignore[assignment]
        try:
            counts, stats = profile_step(ex, row=i + 1, base=1 + 16 * i)
        finally:
            for m, use in zip(mods, saved, strict=True):
                m.use_triton = use  # type: ignore[method-assign]
        details[name] = {
            "counts": counts,
            "path": stats.path,
            "d2h": stats.d2h_syncs,
            "h2d_syncs": stats.h2d_syncs,
            "h2d_copies": stats.h2d_copies,
        }
        rows.append(
            [
                name,
                stats.path,
                counts.get("kernels", "-"),
                counts.get("launches", 0),
                counts.get("graph launches", 0),
                counts.get("h2d copies", "-"),
                counts.get("d2h copies", "-"),
                counts.get("blocking syncs", 0),
                f"{stats.d2h_syncs}/{stats.h2d_syncs}/{stats.h2d_copies}",
            ]
        )
        if mode == "decode" and stats.path != "full_graph":
            failures.append(f"the full-graph step ran {stats.path} ({stats.graph_fallback})")
        if mode == "decode" and ctx.cuda and counts.get("graph launches", 0) != 1:
            failures.append(
                f"the full-graph step launched {counts.get('graph launches', 0)} graphs"
            )
    lines = markdown_table(
        [
            "variant",
            "path",
            "GPU kernels",
            "launch calls",
            "graph launches",
            "H2D copies",
            "D2H copies",
            "blocking syncs",
            "step d2h/h2d-sync/h2d-copy",
        ],
        rows,
    )
    if ctx.cuda:  # the per-layer split of benchmarks/kernel_count.py (Triton attention)
        kc = kernel_count.build(ctx.main_model, "cuda", str(ctx.cache_dir))
        per_layer = [
            ("torch ops", kernel_count.measure(kc, fused=False, row=1)),
            ("fused (Triton)", kernel_count.measure(kc, fused=True, row=2)),
        ]
        lines += ["", "Kernels per decoder layer (a middle layer):", kernel_count.table(per_layer)]
        details["per_layer"] = {n: c.total for n, c in per_layer}
    eager = details["eager, fused Triton"]["counts"]
    graph = details["full_graph"]["counts"]
    figures = (
        f"bs-1 decode step: eager fused {eager.get('kernels', eager.get('aten ops', 0))} "
        f"{'kernels' if ctx.cuda else 'aten ops'} / {eager.get('launches', 0)} launches / "
        f"{eager.get('blocking syncs', 0)} syncs; full_graph {graph.get('graph launches', 0)} "
        f"graph launch + {graph.get('launches', 0)} launches / {graph.get('blocking syncs', 0)} syncs"
    )
    if "per_layer" in details:
        figures += "; per layer " + ", ".join(f"{k} {v}" for k, v in details["per_layer"].items())
    lines += [f"- {f}" for f in failures]
    return StageResult("FAIL" if failures else "PASS", figures, lines, details)
