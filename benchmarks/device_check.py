"""One stage of the GPU check; `benchmarks/device_check.sh` runs them in priority order, each
in its own process under its own time cap.

    python3 benchmarks/device_check.py STAGE [--dry-run] [--out DIR] [--figures FILE]

Stages: preflight, gpu_tests, paths (device_paths.py), attention and kernels
(device_kernels.py), latency, occupancy and graph_memory (device_timing.py), nccl. Each
prints its table, writes its one-line key figures to `--figures` (the driver's summary
line), appends its details as one JSON line to `OUT/details.jsonl`, and exits 0 (PASS),
1 (FAIL) or 3 (SKIP). `--dry-run` runs the same code on the CPU: tiny-random for the
SmolLM2-shaped model, the capture-checked stand-in for CUDA graphs, gloo for NCCL.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "proto"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.device_common import Context, StageResult, register_models  # noqa: E402

EXIT = {"PASS": 0, "FAIL": 1, "SKIP": 3}
# The `gpu`-marked tests' files (the only ones whose imports the carried wheels cover).
GPU_TEST_FILES = [
    "tests/test_step_clock.py",
    "tests/test_future_tokens.py",
    "tests/test_registry.py",
    "tests/test_tensor_parallel.py",
    "tests/test_host_reads.py",
    "tests/test_gpu_readiness.py",
    "tests/test_triton_fused.py",
    "tests/test_quantized.py",
    "tests/test_graphs.py",
    "tests/test_triton_kernels.py",
    "tests/test_memory_release.py",
    "tests/test_weight_updates.py",
    "tests/test_batch_invariant.py",
]
# Unmarked tests that run their Triton cases on CUDA where it exists.
TRITON_TEST_ARGS = [
    "tests/test_sliding_window.py",
    "tests/test_triton_fused.py",
    "tests/test_triton_kernels.py",
    "tests/test_triton_batch_invariant.py",
    "-m",
    "not gpu",
    "-k",  # inductor's CPU compiles and the no-GPU compile check: CI runs those
    "not compile_for_gpu_targets and not compiled",
]
IMPORTS = [
    "structlog",
    "gguf",
    "grpc",
    "model_executor.v1.executor_pb2_grpc",
    "executor.model_executor",
    "executor.service.server",
    "tests.server_util",
]


def _version(name: str) -> str:
    try:
        return str(importlib.import_module(name).__version__)
    except Exception as e:  # reported, not fatal: the imports below decide
        return f"missing ({type(e).__name__})"


def preflight(ctx: Context) -> StageResult:
    versions = {
        "python": platform.python_version(),
        **{
            n: _version(n)
            for n in (
                "torch",
                "triton",
                "numpy",
                "grpc",
                "google.protobuf",
                "pytest",
                "transformers",
            )
        },
        "cuda": str(torch.version.cuda),
    }
    lines = [f"- {k}: {v}" for k, v in versions.items()]
    if not ctx.cuda and not ctx.dry_run:
        return StageResult(
            "FAIL",
            "no CUDA device (torch sees none); --dry-run checks the plumbing on the CPU",
            lines,
        )
    failures = []
    for name in IMPORTS + (
        ["ops.triton_fused", "attention.triton.decode_attention"] if ctx.cuda else []
    ):
        try:
            importlib.import_module(name)
        except Exception as e:
            failures.append(f"import {name}: {type(e).__name__}: {e}")
    n, dtype = (8192, torch.bfloat16) if ctx.cuda else (256, torch.float32)
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    a @ a  # warm
    ctx.sync()
    t0 = time.perf_counter()
    c = a @ a
    ctx.sync()
    gflops = 2 * n**3 / (time.perf_counter() - t0) / 1e9
    if not torch.isfinite(c).all():
        failures.append("the matmul gave non-finite values")
    device = ctx.describe()
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        device += f", {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB"
    lines += [f"- device: {device}", f"- {n}^3 {str(dtype)[6:]} matmul: {gflops:,.3g} GFLOP/s"]
    lines += [f"- {f}" for f in failures]
    figures = f"{device}; triton {versions['triton']}; {n}^3 matmul {gflops:,.3g} GFLOP/s"
    if failures:
        figures += f"; {failures[0]}"
    return StageResult("FAIL" if failures else "PASS", figures, lines, versions)


def _pytest(args: list[str], xml: Path, timeout_s: float) -> tuple[dict[str, int], list[str]]:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-v",  # each test named as it ends: a run that aborts still says which ran
        "-rfEs",
        "-o",
        "timeout=120",
        f"--junitxml={xml}",
        *args,
    ]
    print("$ " + " ".join(command[1:]), flush=True)
    try:
        done = subprocess.run(
            command, cwd=ROOT, timeout=timeout_s, check=False, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        print((out or "")[-6000:], flush=True)
        counts = {"tests": 0, "failures": 0, "errors": 1, "skipped": 0, "passed": 0}
        return counts, [f"ERROR: timed out after {timeout_s:.0f} s"]
    print(done.stdout[-6000:] + done.stderr[-2000:], flush=True)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    tail = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        counts = {k: int(suite.get(k, 0)) for k in counts}
    elif done.returncode != 0:  # pytest died (a crash leaves no XML): keep all it printed
        counts["errors"] = 1
        log = xml.with_suffix(".log")
        log.write_text(done.stdout + done.stderr)
        fatal = done.stderr.find("Fatal Python error")
        print(done.stderr[max(fatal, 0) : max(fatal, 0) + 4000], flush=True)
        tail.append(
            f"ERROR: pytest exited with {done.returncode}, no report ({log.name} has it all)"
        )
    counts["passed"] = max(
        0, counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    )
    return counts, tail


def gpu_tests(ctx: Context, out: Path) -> StageResult:
    budget = float(os.environ.get("DEVICE_CHECK_STAGE_S", "150")) - 5
    runs = [("gpu-marked", ["-m", "gpu", *GPU_TEST_FILES], out / "pytest-gpu.xml")]
    if ctx.cuda:  # the unmarked tests whose Triton cases run on CUDA here
        runs.append(("triton on CUDA", TRITON_TEST_ARGS, out / "pytest-triton.xml"))
    parts, failed, lines = [], [], []
    t0 = time.perf_counter()
    for label, args, xml in runs:
        left = budget - (time.perf_counter() - t0)
        if left < 10:
            parts.append(f"{label}: not run (no time left)")
            continue
        counts, tail = _pytest(args, xml, left)
        parts.append(
            f"{label}: {counts['passed']} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
        )
        lines += [f"- {parts[-1]}", *(f"  - {t}" for t in tail[:20])]
        if counts["failures"] or counts["errors"] or (ctx.cuda and not counts["passed"]):
            failed.append(label)
    figures = "; ".join(parts)
    if not ctx.cuda:
        figures += " (no CUDA: the gpu tests skip; collected with the runtime wheels only)"
    return StageResult("FAIL" if failed else "PASS", figures, lines)


def nccl(ctx: Context) -> StageResult:
    import torch.distributed as dist

    backend = "nccl" if ctx.cuda else "gloo"
    if not dist.is_available() or (ctx.cuda and not dist.is_nccl_available()):
        return StageResult("FAIL", f"torch.distributed has no {backend}")
    untested = "tp 2 untested: NCCL needs one GPU per rank and this machine has one"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            x = torch.arange(1024, dtype=torch.float32, device=ctx.device)
            dist.all_reduce(x)
            ok = bool(torch.equal(x, torch.arange(1024, dtype=torch.float32, device=ctx.device)))
            captured = "not on CPU"
            if ctx.cuda:
                buf = torch.ones(1024, device=ctx.device)
                side = torch.cuda.Stream(ctx.device)
                side.wait_stream(torch.cuda.current_stream(ctx.device))
                with torch.cuda.stream(side):
                    dist.all_reduce(buf)  # warm on the capture stream
                torch.cuda.current_stream(ctx.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    dist.all_reduce(buf)
                buf.fill_(3.0)
                graph.replay()
                torch.cuda.synchronize(ctx.device)
                good = bool((buf == 3.0).all())
                captured = "ok" if good else "WRONG"
                ok = ok and good
            v = torch.cuda.nccl.version() if ctx.cuda else "-"
            version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        finally:
            dist.destroy_process_group()
    figures = f"{backend} {version}, 1 rank: all_reduce eager {'ok' if ok else 'WRONG'}, in a CUDA graph {captured}; {untested}"
    return StageResult("PASS" if ok else "FAIL", figures, [f"- {figures}"])


def stages(out: Path) -> dict[str, Callable[[Context], StageResult]]:
    from benchmarks import device_kernels, device_memory, device_paths, device_timing

    return {
        "preflight": preflight,
        "gpu_tests": lambda ctx: gpu_tests(ctx, out),
        "paths": device_paths.stage,
        "attention": device_kernels.attention_stage,
        "latency": device_timing.latency_stage,
        "occupancy": device_timing.occupancy_stage,
        "kernels": device_kernels.kernels_stage,
        "graph_memory": device_timing.graph_memory_stage,
        "nccl": nccl,
        "memory_release": device_memory.stage,
        "host_phases": device_timing.host_phases_stage,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny models")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--figures", type=Path, default=None)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    register_models()
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="device-check-cache-"))
    ctx = Context(device, args.dry_run, cache)
    table = stages(args.out)
    if args.stage not in table:
        parser.error(f"stage must be one of {', '.join(table)}")
    t0 = time.perf_counter()
    try:
        result = table[args.stage](ctx)
    except Exception as e:
        traceback.print_exc()
        result = StageResult("FAIL", f"{type(e).__name__}: {str(e)[:300]}")
    seconds = time.perf_counter() - t0
    print("\n".join(result.lines), flush=True)
    print(f"{args.stage}: {result.status} in {seconds:.1f} s: {result.figures}", flush=True)
    if args.figures is not None:
        args.figures.write_text(" ".join(result.figures.split()).replace("|", "/"))
    record = {
        "stage": args.stage,
        "status": result.status,
        "seconds": round(seconds, 2),
        "figures": result.figures,
        "device": ctx.describe(),
        "details": result.details,
    }
    with (args.out / "details.jsonl").open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return EXIT[result.status]


if __name__ == "__main__":
    sys.exit(main())
