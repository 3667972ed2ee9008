"""Where a served unary DECODE step's host time goes, phase by phase (issue 40, part 5).

    python benchmarks/overhead_phases.py                      # bs 1 and 32, 300 steps each
    python benchmarks/overhead_phases.py --batch-sizes 1 --steps 500
    python benchmarks/overhead_phases.py --tree ../old-checkout      # the same, another tree
    python benchmarks/overhead_phases.py --server-flag=--device=cuda --server-flag=--graph-mode=both

The executor runs in its own process (`python -m executor serve`, the flags of
`step_overhead.py`) with timing wrappers around the functions of the step's path; a client in
this process sends unary DECODE `Forward` calls one after another. Per step and phase it
records the wall time and the calling thread's CPU time (`time.thread_time_ns`: what the
phase itself burned, robust to other processes' load), and four timestamps for the thread
hand-offs (submit -> the device thread's start; the future's resolve -> the RPC thread awake).
The table gives medians per step; phases nest (a phase's time includes the ones indented
under it). A wrapper costs about 1 us of its own, so the figures are slightly high; compare
them with each other, and use `step_overhead.py` for the end-to-end figure. `--server-flag`
adds a `serve` flag after those (a later one wins): a GPU's steps (`--device=cuda`, a graph
mode), or the stand-in accelerator's (`--simulated-step-ms=2`).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (label, module, attribute path, depth for the table). Functions imported by name are patched
# where they are called from.
PHASES: tuple[tuple[str, str, str, int], ...] = (
    ("Forward handler", "executor.service.servicer", "ExecutorServicer.Forward", 0),
    ("telemetry scope open", "executor.observability.telemetry", "RpcScope.__init__", 1),
    ("access.identity", "executor.service.access", "AccessRules.identity", 1),
    ("_submit", "executor.service.servicer", "ExecutorServicer._submit", 1),
    ("batch_from_proto", "executor.service.servicer", "batch_from_proto", 2),
    ("check_size_claims", "executor.service.codec", "check_size_claims", 3),
    ("fingerprint", "executor.service.servicer", "fingerprint", 2),
    ("worker.submit", "executor.service.device_worker", "DeviceWorker.submit", 2),
    ("_wait (device step inside)", "executor.service.servicer", "ExecutorServicer._wait", 1),
    ("record_step (span)", "executor.observability.tracing", "SpanScope.record_step", 1),
    ("_encode", "executor.service.servicer", "ExecutorServicer._encode", 1),
    ("telemetry scope close", "executor.observability.telemetry", "RpcScope.__exit__", 1),
    ("serialize (SerializeToString)", "", "serializer", 0),
    ("device: _serve", "executor.service.device_worker", "DeviceWorker._serve", 0),
    ("_prepare", "executor.service.device_worker", "DeviceWorker._prepare", 1),
    ("applied.lookup", "executor.service.applied_batches", "AppliedBatches.lookup", 2),
    ("prepare", "executor.model_executor", "ModelExecutor.prepare", 2),
    ("admit", "executor.step.step", "Step.admit", 3),
    ("resolve_held_prefix", "executor.step.step", "resolve_held_prefix", 4),
    ("validate_batch", "executor.step.step", "validate_batch", 4),
    ("complete_batch", "executor.step.step", "complete_batch", 4),
    ("sampler.plan", "executor.sampling", "Sampler.plan", 4),
    ("row_table.admit", "executor.row_table", "RowTable.admit", 4),
    ("check_write", "executor.kv_cache", "ReqToTokenPool.check_write", 5),
    ("controls.admit", "executor.controls.step_controls", "StepControls.admit", 4),
    ("extras.admit", "executor.extras.feature", "Extras.admit", 4),
    ("future.admit", "executor.future_tokens.feature", "FutureTokens.admit", 4),
    ("lora.admit", "executor.lora.rows", "LoraRows.admit", 4),
    ("stage", "executor.step.step", "Step.stage", 3),
    ("staged_fields", "executor.core.step_batch", "StepBatch.staged_fields", 4),
    ("H2DStaging.stage", "ops.h2d_staging", "H2DStaging.stage", 4),
    ("apply", "executor.core.step_batch", "StepBatch.apply", 4),
    ("on_device", "executor.core.forward_batch", "ForwardBatch.on_device", 5),
    ("write_batch", "executor.kv_cache", "ReqToTokenPool.write_batch", 5),
    ("controls.apply", "executor.controls.step_controls", "ControlsPart.apply", 5),
    ("launch", "executor.model_executor", "ModelExecutor.launch", 1),
    ("runner.forward (model)", "executor.model_runner", "ModelRunner.forward", 2),
    ("sampler.draw_step", "executor.sampling", "Sampler.draw_step", 2),
    ("finish", "executor.model_executor", "ModelExecutor.finish", 1),
    ("read", "executor.step.step", "Step.read", 2),
    ("_fill_stats", "executor.step.step", "Step._fill_stats", 3),
    ("_done", "executor.service.device_worker", "DeviceWorker._done", 1),
    ("applied.store", "executor.service.applied_batches", "AppliedBatches.store", 2),
    ("_report (metrics)", "executor.service.device_worker", "DeviceWorker._report", 2),
    ("resolve (future)", "executor.service.device_worker", "resolve", 2),
)
MARKS = ("submitted", "device_start", "resolved", "woken")


class Recorder:
    """Per step: each phase's summed wall and thread-CPU ns, and the hand-off timestamps."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.current: dict[str, Any] = {}

    def add(self, label: str, wall: int, cpu: int) -> None:
        w, c = self.current.get(label, (0, 0))
        self.current[label] = (w + wall, c + cpu)

    def mark(self, name: str) -> None:
        self.current["@" + name] = time.perf_counter_ns()

    def flush(self) -> None:
        self.steps.append(self.current)
        self.current = {}


def _wrap(fn: Callable[..., Any], label: str, rec: Recorder) -> Callable[..., Any]:
    perf, cpu = time.perf_counter_ns, time.thread_time_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        w0, c0 = perf(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.add(label, perf() - w0, cpu() - c0)

    return timed


def phase_targets() -> list[tuple[str, Any, str]]:
    """(label, owner, attribute) of every timed phase; AttributeError names a phase whose
    function moved or was renamed."""
    import importlib

    targets = []
    for label, module_name, attr, _ in PHASES:
        if not module_name:
            continue
        owner: Any = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        if not hasattr(owner, name):
            raise AttributeError(f"phase {label!r}: {module_name}.{attr} does not exist")
        targets.append((label, owner, name))
    return targets


def install(rec: Recorder) -> None:
    """Patch every phase's function with a timer, and the hand-off marks."""
    import inspect

    from executor.service import device_worker, handlers, servicer

    for label, owner, name in phase_targets():
        timed = _wrap(getattr(owner, name), label, rec)
        if isinstance(inspect.getattr_static(owner, name), staticmethod):
            timed = staticmethod(timed)
        setattr(owner, name, timed)
    # The serializer and deserializer are bound when the service registers: wrap the factories.
    for key, factory in list(handlers._FACTORIES.items()):

        def wrapped(behaviour: Any, *, request_deserializer: Any, response_serializer: Any,
                    _factory: Any = factory) -> Any:  # fmt: skip
            return _factory(
                behaviour,
                request_deserializer=request_deserializer,
                response_serializer=_wrap(
                    response_serializer, "serialize (SerializeToString)", rec
                ),
            )

        handlers._FACTORIES[key] = wrapped
    # Hand-off marks and the step boundary.
    submit = device_worker.DeviceWorker.submit
    serve = device_worker.DeviceWorker._serve
    wait = servicer.ExecutorServicer._wait
    forward = servicer.ExecutorServicer.Forward
    resolve = device_worker.resolve

    def submit_marked(self: Any, *a: Any, **k: Any) -> Any:
        job = submit(self, *a, **k)
        rec.mark("submitted")
        return job

    def serve_marked(self: Any, turn: Any, before: Any) -> Any:
        rec.mark("device_start")
        return serve(self, turn, before)

    def resolve_marked(future: Any, result: Any = None, exc: Any = None) -> Any:
        out = resolve(future, result, exc)
        rec.mark("resolved")
        return out

    def wait_marked(self: Any, job: Any) -> Any:
        out = wait(self, job)
        rec.mark("woken")
        return out

    def forward_flushed(self: Any, request: Any, context: Any) -> Any:
        try:
            return forward(self, request, context)
        finally:
            rec.flush()

    device_worker.DeviceWorker.submit = submit_marked  # type: ignore[method-assign]
    device_worker.DeviceWorker._serve = serve_marked  # type: ignore[method-assign]
    device_worker.resolve = resolve_marked
    servicer.ExecutorServicer._wait = wait_marked  # type: ignore[method-assign]
    servicer.ExecutorServicer.Forward = forward_flushed  # type: ignore[method-assign]


def serve_profiled(out: Path, flags: list[str]) -> int:
    rec = Recorder()
    install(rec)
    atexit.register(lambda: out.write_text(json.dumps(rec.steps)))
    from executor.client.cli import main

    return main(["serve", *flags])


def summarize(steps: list[dict[str, Any]], client_us: list[float]) -> list[str]:
    """Markdown rows: phase, median wall us, median thread-CPU us (per step)."""
    rows = []
    n = len(steps)

    def med(label: str, i: int) -> float:
        return statistics.median(s.get(label, (0, 0))[i] for s in steps) / 1e3

    rows.append(f"| client wall (unary Forward) | {statistics.median(client_us):.0f} | |")
    for label, _, _, depth in PHASES:
        if not any(label in s for s in steps):
            continue
        indent = "&nbsp;&nbsp;" * depth
        rows.append(f"| {indent}{label} | {med(label, 0):.1f} | {med(label, 1):.1f} |")
    handoffs = [
        ("hand-off: submit -> device thread start", "submitted", "device_start"),
        ("hand-off: future resolved -> RPC thread awake", "resolved", "woken"),
    ]
    for what, a, b in handoffs:
        values = [(s["@" + b] - s["@" + a]) / 1e3 for s in steps if "@" + a in s and "@" + b in s]
        if values:
            rows.append(f"| {what} | {statistics.median(values):.1f} | |")

    def per_step(labels: tuple[str, ...], minus: tuple[str, ...] = ()) -> float:
        values = [
            sum(s.get(x, (0, 0))[1] for x in labels) - sum(s.get(x, (0, 0))[1] for x in minus)
            for s in steps
        ]
        return statistics.median(values) / 1e3

    rpc = per_step(("deserialize (FromString)", "Forward handler", "serialize (SerializeToString)"))
    device = per_step(("device: _serve",), ("runner.forward (model)",))
    rows.append(f"| **RPC thread CPU** (deserialize, handler, serialize) | | {rpc:.0f} |")
    rows.append(f"| **device thread CPU outside the model** | | {device:.0f} |")
    rows.append(f"| (steps) | {n} | |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--serve-profiled", type=Path, help=argparse.SUPPRESS)
    ap.add_argument(
        "--tree", type=Path, help="serve another checkout's executor (an A/B against it)"
    )
    ap.add_argument(
        "--server-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="a `serve` flag after the defaults, e.g. --server-flag=--device=cuda (repeatable)",
    )
    args, rest = ap.parse_known_args()
    if args.tree is not None:  # before anything imports the executor
        root = args.tree.resolve()
        sys.path[:0] = [str(root), str(root / "proto")]
    if args.serve_profiled is not None:
        sys.exit(serve_profiled(args.serve_profiled, [a for a in rest if a != "--"]))

    import itertools
    import secrets
    import tempfile

    import grpc
    from rpc_overhead import PROMPT_LEN, decode_batches
    from served import cpu_description, free_port

    from executor.client.grpc_client import ExecutorClient
    from executor.service.codec import batch_to_proto
    from model_executor.v1 import executor_pb2 as pb

    model, simd = cpu_description()
    print(f"# {model} ({simd}); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# executor from {(args.tree or Path(__file__).parents[1]).resolve()}")
    for bs in (int(s) for s in args.batch_sizes.split(",")):
        span = PROMPT_LEN + 2 + args.warmup + args.steps
        flags = [
            "--model", "tiny-random", "--dtype", "float32", "--graph-mode", "none",
            "--max-reqs", str(bs + 1), "--max-batch-size", str(bs),
            "--kv-slots", str(bs * span + 8), "--max-context-len", str(span + 8),
            *args.server_flag,
        ]  # fmt: skip
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "steps.json"
            cmd = [
                sys.executable, __file__, "--serve-profiled", str(out), "--", "--port", str(port),
                "--metrics-port", "-1", "--log-level", "warning", *flags,
            ]  # fmt: skip
            if args.tree is not None:
                cmd[2:2] = ["--tree", str(args.tree)]
            env = {**os.environ, "MODEL_EXECUTOR_OPERATOR_CALLS_OPEN": "1"}
            process = subprocess.Popen(cmd, env=env)
            client = ExecutorClient(f"127.0.0.1:{port}")
            try:
                deadline = time.monotonic() + 600
                while True:  # ready, or the server died (a phase it could not patch)
                    try:
                        client.wait_ready(timeout=5)
                        break
                    except TimeoutError:
                        if process.poll() is not None or time.monotonic() > deadline:
                            raise SystemExit(
                                f"the profiled server is not ready (exit {process.poll()})"
                            ) from None
                prefill, decodes = decode_batches(bs, 1 + args.warmup + args.steps, 1)
                client.forward(prefill)
                ids = itertools.count(secrets.randbits(62) + 1)
                requests = [
                    pb.ForwardRequest(batch_id=next(ids), batch=batch_to_proto(b)) for b in decodes
                ]
                client_us = []
                for i, request in enumerate(requests):
                    t0 = time.perf_counter_ns()
                    client.stub.Forward(request)
                    if i > args.warmup:
                        client_us.append((time.perf_counter_ns() - t0) / 1e3)
            finally:
                client.close()
                process.terminate()
                process.wait(timeout=60)
            steps = json.loads(out.read_text())[2 + args.warmup :]  # prefill, first decodes
        print(f"\n## bs {bs}: medians per step, us (wall | thread CPU)\n")
        print("| phase | wall | CPU |\n|---|---:|---:|")
        print("\n".join(summarize(steps, client_us)))
    del grpc
    print(f"\n# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
