"""The GPU check's timing stages, on the SmolLM2-shaped model in bfloat16.

`latency`: bs-1 DECODE at context 128 per path (eager, eager_no_copy, full_graph) and one
128-token EXTEND (eager, piecewise): the wall time of `forward` (it returns host tokens, so
it waits for the device) and the device time of its forward phase (the step clock's CUDA
events), median and p90; both eager paths are timed again at the end, as the spread. Beside
each row: this process's CPU time over the wall time (above 1: another thread of it ran) and
the tasks runnable on the machine (/proc/loadavg), which tell a slow row's cause.

`occupancy`: what a ForwardStream keeps the device busy with. The reference scheduler
generates over one stream, plain (send, wait, send) and with overlap (step N+1 sent, built
from future-token references, before step N's tokens are read), against a server in this
process (client and server share one interpreter lock) and against `serve` in its own
process. Device-busy time is the steps' device phases (forward + sample, CUDA events);
occupancy is that over the run's wall time, beside the executor's phase timers. Reported,
not judged.

`host_phases`: where a served unary DECODE step's host time goes, phase by phase, on this
device (`benchmarks/overhead_phases.py` with `--device=cuda --graph-mode=both
--dtype=bfloat16`; the stand-in accelerator in a dry run): the RPC thread's and the device
thread's CPU time per phase, and the hand-offs between them. Reported, not judged.

`graph_memory`: a fresh executor with the default bucket ladders (`graph_batch_sizes` and
`piecewise_token_sizes` empty, max_reqs 128) captures both graph kinds: buckets, graphs,
seconds, the pool's growth (`CaptureReport.memory_bytes`) and the device's free-memory drop.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.device_common import (
    Context,
    StageResult,
    build,
    executor_config,
    markdown_table,
    percentiles,
)
from benchmarks.served import served
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.client.scheduler import ReferenceScheduler
from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.service.server import start_server
from executor.service.server_config import ServerConfig

CONTEXT = 128


def _runnable() -> int:
    """Tasks runnable on the machine now, this one included (/proc/loadavg; -1 off Linux)."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except OSError:
        return -1


@dataclasses.dataclass
class Timed:
    wall: list[float]  # ms per step
    gpu: list[float]  # ms of the forward phase per step (CUDA events)
    cpu_per_wall: float  # this process's CPU time over the wall time: > 1, another thread ran
    runnable: float  # median tasks runnable on the machine during the steps


def _time(ex: ModelExecutor, batches: list[Any], expect: str) -> Timed:
    wall, gpu, runnable = [], [], []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for batch in batches:
        t0 = time.perf_counter()
        out = ex.forward(batch)
        wall.append((time.perf_counter() - t0) * 1e3)
        gpu.append(out.stats.timings_ns.get("forward", 0) / 1e6)
        runnable.append(_runnable())
        if out.stats.path != expect:
            raise RuntimeError(
                f"a step ran {out.stats.path}, not {expect} ({out.stats.graph_fallback})"
            )
    cpu = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
    return Timed(wall, gpu, cpu, statistics.median(runnable))


def _row(name: str, t: Timed, warm: int) -> list[Any]:
    (w50, w90), (g50, g90) = percentiles(t.wall[warm:]), percentiles(t.gpu[warm:])
    figures = (w50, w90, g50, g90, t.cpu_per_wall)
    return [name, *(f"{v:.3f}" for v in figures), f"{t.runnable:g}"]


def latency_stage(ctx: Context) -> StageResult:
    warm, reps = (1, 3) if ctx.dry_run else (10, 50)
    n_ext = 32 if ctx.dry_run else 128
    ex = build(
        ctx, ctx.main_model, "bfloat16", graph_batch_sizes="1", piecewise_token_sizes=str(n_ext)
    )
    ex.control.set_graph_mode("both")
    decode_paths = (
        ("eager", False, "none"),
        ("eager_no_copy", True, "none"),
        ("full_graph", False, "decode"),
        ("eager (again)", False, "none"),
        ("eager_no_copy (again)", True, "none"),
    )
    span = CONTEXT + len(decode_paths) * (warm + reps) + 8
    slots = list(range(1, span + 1))
    ex.forward(
        make_extend_batch(
            input_ids=[[7] * CONTEXT], req_pool_indices=[1], out_cache_loc=[slots[:CONTEXT]]
        )
    )
    if ctx.cuda:  # 2 s of eager steps first: on the H200 the first path timed ran slower
        # than the same path timed last (docs/gpu.md)
        ex.control.set_graph_mode("none")
        warmup = make_decode_batch(
            input_ids=[11],
            req_pool_indices=[1],
            seq_lens=[CONTEXT + 1],
            out_cache_loc=[slots[CONTEXT]],
        )
        until = time.perf_counter() + 2.0
        while time.perf_counter() < until:
            ex.forward(warmup)
    seq = CONTEXT
    rows: list[list[Any]] = []
    figures: dict[str, float] = {}
    for path, no_copy, mode in decode_paths:
        ex.toggles.eager_input_no_copy = no_copy
        ex.control.set_graph_mode(mode)
        batches = []
        for _ in range(warm + reps):
            batches.append(
                make_decode_batch(
                    input_ids=[11],
                    req_pool_indices=[1],
                    seq_lens=[seq + 1],
                    out_cache_loc=[slots[seq]],
                )
            )
            seq += 1
        rows.append(_row(f"decode bs 1, {path}", _time(ex, batches, path.split()[0]), warm))
        figures[path] = float(rows[-1][1])
    ext_slot = span + 1
    for path, mode in (("eager", "none"), ("piecewise", "extend")):
        ex.toggles.eager_input_no_copy = False
        ex.control.set_graph_mode(mode)
        batches = [
            make_extend_batch(
                input_ids=[[5] * n_ext],
                req_pool_indices=[2],
                out_cache_loc=[list(range(ext_slot, ext_slot + n_ext))],
            )
            for _ in range(warm + reps // 2)
        ]
        rows.append(_row(f"extend {n_ext} tokens, {path}", _time(ex, batches, path), warm))
        figures[f"extend {path}"] = float(rows[-1][1])
    header = ["step", "wall ms p50", "wall ms p90", "device ms p50 (forward)", "device ms p90"]
    # cpu/wall above 1: another thread of this process ran; runnable: the machine's load
    lines = markdown_table([*header, "cpu/wall", "runnable"], rows)
    text = ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
    return StageResult("PASS", f"bs-1 decode wall ms p50: {text}", lines, {"ms": figures})


def _generate(client: ExecutorClient, bs: int, new_tokens: int, overlap: bool) -> dict[str, Any]:
    limits = client.info().info.limits
    session = client.open_stream()
    answers: list[Any] = []
    refs = [0]  # input ids sent as future-token references (-slot)

    class Pipe:
        def send(self, batch: Any) -> int:
            if batch.input_ids is not None:
                refs[0] += int((batch.input_ids < 0).sum())
            return session.send(batch)

        def recv(self) -> Any:
            out = session.recv()
            answers.append(out)
            return out

    pipe = Pipe()

    def lockstep(batch: Any) -> Any:
        pipe.send(batch)
        return pipe.recv()

    scheduler = ReferenceScheduler(lockstep, limits, overlap=overlap, pipe=pipe)
    reqs = [
        scheduler.add_request(
            [(31 * r + j) % 400 + 5 for j in range(16)], max_new_tokens=new_tokens, ignore_eos=True
        )
        for r in range(bs)
    ]
    t0 = time.perf_counter()
    scheduler.run()
    wall = time.perf_counter() - t0
    session.close()
    steps = [a for a in answers if a.stats.mode != "idle"]
    busy = (
        sum(
            a.stats.timings_ns.get("forward", 0) + a.stats.timings_ns.get("sample", 0)
            for a in steps
        )
        / 1e9
    )
    phases = sorted({k for a in steps for k in a.stats.timings_ns})
    return {
        "tokens": [r.output_ids for r in reqs],
        # the executor's own phase timers, median ms per step (DECODE dominates)
        "phase_ms": {
            k: statistics.median([a.stats.timings_ns.get(k, 0) for a in steps]) / 1e6
            for k in phases
        },
        "wall_s": wall,
        "busy_s": busy,
        "steps": len(steps),
        "future_refs": refs[0],
    }


# `serve` in its own process, with the check's models registered first.
_SERVE = (
    "-c",
    "import sys; from benchmarks.device_common import register_models; register_models(); "
    "from executor.client.cli import main; sys.exit(main(sys.argv[1:]))",
)


def _serve_flags(config: ExecutorConfig) -> list[str]:
    """`config` as `serve` flags: every field that differs from the default."""
    flags = []
    for f in dataclasses.fields(config):
        value, default = getattr(config, f.name), f.default
        if value == default:
            continue
        name = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + name[2:])
        else:
            flags += [name, str(value)]
    return flags


def _occupancy_runs(
    client: ExecutorClient, where: str, new_tokens: int, rows: list[list[Any]], out: dict[str, Any]
) -> list[str]:
    """Plain and overlapped streams at bs 1 and 8 against one server; a table row each."""
    failures = []
    _generate(client, 1, 4, overlap=True)  # warm both code paths
    for bs in (1, 8):
        done = {m: _generate(client, bs, new_tokens, overlap=m) for m in (False, True)}
        if done[False]["tokens"] != done[True]["tokens"]:
            failures.append(f"{where}, bs {bs}: overlap changed the tokens")
        if done[True]["future_refs"] == 0:
            failures.append(f"{where}, bs {bs}: the overlapped run sent no future-token reference")
        for overlap, r in done.items():
            occ = r["busy_s"] / r["wall_s"]
            name = f"bs {bs} {'overlap' if overlap else 'plain'}, {where}"
            out["occupancy"][name] = occ
            out["phase_ms"][name] = r["phase_ms"]
            rows.append(
                [
                    name,
                    r["steps"],
                    f"{r['wall_s'] * 1e3 / r['steps']:.3f}",
                    f"{r['busy_s'] * 1e3 / r['steps']:.3f}",
                    f"{occ:.1%}",
                ]
            )
    return failures


def occupancy_stage(ctx: Context) -> StageResult:
    """The same streams against a server in this process (its gRPC and the client share one
    interpreter lock) and against `serve` in its own process, as a scheduler meets it."""
    new_tokens = 4 if ctx.dry_run else 64
    config = executor_config(
        ctx,
        ctx.main_model,
        "bfloat16",
        graph_mode="both",
        graph_batch_sizes="1,2,4,8",
        piecewise_token_sizes="16,32,64,128",
    )
    rows: list[list[Any]] = []
    out: dict[str, Any] = {"occupancy": {}, "phase_ms": {}}
    server = start_server(
        config, ServerConfig(host="127.0.0.1", port=0, metrics_port=0), block_until_ready=True
    )
    if server.load_error:
        raise RuntimeError(f"the server did not start: {server.load_error[0]}")
    try:
        client = ExecutorClient(f"127.0.0.1:{server.port}")
        failures = _occupancy_runs(client, "in-process", new_tokens, rows, out)
        client.close()
    finally:
        server.drain()
    with served(_serve_flags(config), launcher=_SERVE) as own:
        failures += _occupancy_runs(own.client, "own process", new_tokens, rows, out)
    lines = markdown_table(
        ["stream", "steps", "wall ms/step", "device-busy ms/step", "occupancy"], rows
    )
    phase_ms = out["phase_ms"]
    names = sorted({k for p in phase_ms.values() for k in p})
    lines += ["", "Executor phase timers, median ms per step:"]
    lines += markdown_table(
        ["stream", *names],
        [[run, *(f"{p.get(k, 0):.3f}" for k in names)] for run, p in phase_ms.items()],
    )
    lines += [f"- {f}" for f in failures]
    figures_text = "device busy / wall: " + ", ".join(
        f"{k} {v:.0%}" for k, v in out["occupancy"].items()
    )
    return StageResult("FAIL" if failures else "PASS", figures_text, lines, out)


def host_phases_stage(ctx: Context) -> StageResult:
    """`overhead_phases.py` in its own processes (the profiled server and its client)."""
    flags = ["--device=cuda", "--graph-mode=both", "--dtype=bfloat16"]
    if not ctx.cuda:
        flags = ["--simulated-step-ms=2"]
    sizes, steps, warmup = ("1", 10, 3) if ctx.dry_run else ("1,8", 300, 30)
    script = Path(__file__).with_name("overhead_phases.py")
    cmd = [sys.executable, str(script), "--batch-sizes", sizes, "--steps", str(steps)]
    cmd += ["--warmup", str(warmup), *(f"--server-flag={f}" for f in flags)]
    budget = float(os.environ.get("DEVICE_CHECK_STAGE_S", "60")) - 5
    # A session of its own: out of time, its profiled server goes with it (it holds the GPU).
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return StageResult("FAIL", f"overhead_phases ran past {budget:.0f} s")
    if proc.returncode != 0:
        tail = (stdout + stderr).splitlines()[-20:]
        return StageResult("FAIL", f"overhead_phases exited {proc.returncode}", tail)
    lines = [x for x in stdout.splitlines() if x.startswith(("|", "##"))]
    cpu: dict[str, str] = {}  # "bs 1, RPC thread CPU" -> us a step
    bs = ""
    for x in lines:
        if x.startswith("## "):
            bs = x[3:].split(":")[0]
        elif x.startswith("| **"):
            cpu[f"{bs}, {x.split('**')[1]}"] = x.split("|")[3].strip()
    figures = f"{' '.join(flags)}; a step's CPU: " + ", ".join(
        f"{k} {v} us" for k, v in cpu.items()
    )
    return StageResult("PASS", figures, lines, {"cpu_us": cpu, "stdout": stdout})


def graph_memory_stage(ctx: Context) -> StageResult:
    ex = build(
        ctx,
        ctx.main_model,
        "bfloat16",
        graph_batch_sizes="",
        piecewise_token_sizes="",
        max_reqs=128,
        kv_slots=65536 if ctx.cuda else 4096,
    )
    free0 = torch.cuda.mem_get_info(ctx.device)[0] if ctx.cuda else 0
    t0 = time.perf_counter()
    reports = ex.control.set_graph_mode("both")
    seconds = time.perf_counter() - t0
    ctx.sync()
    drop = free0 - torch.cuda.mem_get_info(ctx.device)[0] if ctx.cuda else 0
    rows = [
        [
            r.kind,
            len(r.captured),
            r.graphs,
            f"{r.seconds:.1f}",
            f"{r.memory_bytes / 2**20:.1f}",
            len(r.failed),
            r.poisoned or "",
        ]
        for r in reports
    ]
    lines = markdown_table(
        ["kind", "buckets", "graphs", "seconds", "pool MiB", "failed", "poisoned"], rows
    )
    failures = [
        f"{r.kind}: {len(r.failed)} failed, e.g. {next(iter(r.failed.values()))}"
        for r in reports
        if r.failed
    ]
    failures += [f"{r.kind}: poisoned: {r.poisoned}" for r in reports if r.poisoned]
    lines += [f"- free device memory dropped {drop / 2**20:.0f} MiB", *(f"- {f}" for f in failures)]
    graphs = sum(r.graphs for r in reports)
    pool = sum(r.memory_bytes for r in reports) / 2**20
    figures = f"{graphs} graphs ({', '.join(f'{r.kind} {len(r.captured)} buckets' for r in reports)}) in {seconds:.1f} s, pool {pool:.0f} MiB, free memory -{drop / 2**20:.0f} MiB"
    details = {
        "seconds": seconds,
        "graphs": graphs,
        "pool_mib": pool,
        "free_drop_mib": drop / 2**20,
    }
    return StageResult("FAIL" if failures else "PASS", figures, lines, details)
