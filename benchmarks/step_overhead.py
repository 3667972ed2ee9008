"""What the executor adds around the model per served step, against a bare grpcio round trip.

    python benchmarks/step_overhead.py                              # bs 1, 32, 256; 200 steps each
    python benchmarks/step_overhead.py --batch-sizes 1,32 --steps 100
    python benchmarks/step_overhead.py --server-env OMP_WAIT_POLICY=PASSIVE  # the executor's env
    python benchmarks/step_overhead.py --baseline-tree ../old-checkout  # A/B against another tree
    python benchmarks/step_overhead.py --python-paths  # host kernels against the Python paths
    python benchmarks/step_overhead.py --simulated-step-ms 2  # the stand-in accelerator's model

For each batch size, call by call in alternation (the order rotates every call, so drift and
the neighbours' load fall on all alike):
- executor: a unary DECODE `Forward` to `python -m executor serve` (tiny-random, float32, eager;
  benchmarks/served.py). Its overhead is the client's wall time minus the step's model forward
  (`ForwardStats.timings_ns["forward"]`).
- bare: the same `ForwardRequest` to a minimal grpcio server in its own process (this file with
  `--bare-server PORT`: a generic handler that parses the request and answers a canned
  `ForwardResponse` of the executor's size). Its wall time is what any Python gRPC service pays.

With `--baseline-tree`, a second executor served from that checkout (same flags) takes the same
requests in the same rotation, and a second table compares the two overheads: on a shared
machine only such a side-by-side run says what a change bought. With `--python-paths` the
second executor is this tree's with the host kernels off (`serve_python_paths.py`: admission
and staging in Python, as on a machine without a C compiler).

All clients are `ExecutorClient` stubs sending prebuilt requests, so the client's work inside
the call (serializing the request, parsing the answer) is the same on both sides; the
scheduler-side codec (`batch_to_proto`, `response_from_proto`) is timed on its own and is not
in the ratio. The overhead is split by the step's own timings (queue, validate, stage, sample,
and whatever `total` holds besides them) and the rest: the gRPC path, decoding, encoding,
telemetry and the thread hand-offs.

With `--simulated-step-ms D` the executor runs the stand-in accelerator (`serve
--simulated-step-ms D`): no model runs on the CPU, each step's device work is D ms after its
launch, and the overhead is the wall time minus D, as on a GPU host. On a CPU device the model's
forward streams its weights through the caches the host path then runs without; the stand-in
shows the same host path with the caches it would keep beside an accelerator. The split columns
then hold the stand-in's few ops (`forward`) and its wait (`step other`, outside the phases).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# Run from a checkout: this tree's packages and generated stubs, and served.py beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import torch
from rpc_overhead import PROMPT_LEN, decode_batches
from served import cpu_description, free_port, served

from executor.client.grpc_client import ExecutorClient
from executor.service.codec import batch_to_proto, response_from_proto
from model_executor.v1 import executor_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["ModelExecutor"].full_name
TARGETS = {1: 2.0, 32: 2.0, 256: 2.0}  # overhead / bare round trip, at most (issues 40, 24)
# The step's phases as ForwardStats names them; `forward` is the model, `total` validate..sample.
MODEL, TOTAL = "forward", "total"
PYTHON_PATHS = Path(__file__).with_name("serve_python_paths.py")
REST = "rpc"  # client wall time outside the step and its queue wait


def canned_response(bs: int) -> pb.ForwardResponse:
    """A DECODE answer shaped like the executor's for `bs` requests (tokens and ForwardStats)."""
    timings = dict.fromkeys(
        ("validate", "stage", "forward", "sample", "read", "total", "queue"), 10**6
    )
    return pb.ForwardResponse(
        batch_id=secrets.randbits(62),
        next_token_ids=pb.Tensor(dtype=pb.INT64, shape=[bs], data=bytes(8 * bs)),
        stats=pb.ForwardStats(
            path="eager",
            batch_size=bs,
            padded_batch_size=bs,
            num_tokens=bs,
            padded_num_tokens=bs,
            timings_ns=timings,
            mode="decode",
            fill_registry="eager_decode",
            fill_tensors=6,
            fill_bytes=48 * bs,
            fill_copy_calls=1,
            host_gap_ns=10**5,
        ),
    )


def start_bare_server(port: int = 0) -> tuple[grpc.Server, int]:
    """A grpcio server with nothing but `Forward`: parse the request, answer a same-size one."""
    answers: dict[int, pb.ForwardResponse] = {}

    def forward(request: pb.ForwardRequest, context: grpc.ServicerContext) -> pb.ForwardResponse:
        bs = len(request.batch.req_pool_indices.data) // 8
        answer = answers.get(bs)
        if answer is None:
            answer = answers[bs] = canned_response(bs)
        return answer

    handler = grpc.unary_unary_rpc_method_handler(
        forward,
        request_deserializer=pb.ForwardRequest.FromString,
        response_serializer=pb.ForwardResponse.SerializeToString,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Forward": handler}),)
    )
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, bound


@contextmanager
def bare_served() -> Iterator[ExecutorClient]:
    """The bare server in its own process (as the executor is), and a client to it."""
    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, "--bare-server", str(port)])
    client = ExecutorClient(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(client.channel).result(timeout=60)
        yield client
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=30)


@dataclass
class Result:
    """One batch size: per-step figures in microseconds."""

    bs: int
    request_bytes: int
    response_bytes: int  # the executor's answer
    bare_response_bytes: int
    bare_us: list[float] = field(default_factory=list)
    overhead_us: list[float] = field(default_factory=list)  # executor wall minus model forward
    model_us: list[float] = field(default_factory=list)
    phases_us: dict[str, list[float]] = field(default_factory=dict)  # the overhead, split
    client_codec_us: list[float] = field(default_factory=list)  # encode + decode, not in ratio
    baseline_us: list[float] = field(default_factory=list)  # the baseline tree's overhead
    baseline_model_us: list[float] = field(default_factory=list)  # and its model forward

    @property
    def ratio(self) -> float:
        return statistics.median(self.overhead_us) / statistics.median(self.bare_us)


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def timed_call(
    client: ExecutorClient, request: pb.ForwardRequest
) -> tuple[int, pb.ForwardResponse]:
    t0 = time.perf_counter_ns()
    response = client.stub.Forward(request)
    return time.perf_counter_ns() - t0, response


def measure(
    executor: ExecutorClient,
    bare: ExecutorClient,
    bs: int,
    steps: int,
    *,
    first_row: int = 1,
    warmup: int = 10,
    baseline: ExecutorClient | None = None,
    device_ns: int | None = None,
) -> Result:
    """A prefill of `bs` requests (rows first_row..), then one DECODE step that sizes the
    messages, `warmup` and `steps` measured ones against the executor, each alternated with the
    same request to the bare server (and to `baseline`, another executor, when given).
    `device_ns`: the stand-in's device time a step, the "model" then (None: the forward's)."""
    prefill, decodes = decode_batches(bs, 1 + warmup + steps, first_row)
    executors = [executor] if baseline is None else [executor, baseline]
    for client in executors:
        client.forward(prefill)
    ids = itertools.count(secrets.randbits(62) + 1)  # fresh: a reused id would be replayed
    requests = [pb.ForwardRequest(batch_id=next(ids), batch=batch_to_proto(b)) for b in decodes]
    first = executor.stub.Forward(requests[0])
    if baseline is not None:
        baseline.stub.Forward(requests[0])
    result = Result(
        bs,
        requests[0].ByteSize(),
        first.ByteSize(),
        bare.stub.Forward(requests[0]).ByteSize(),
    )
    clients = [bare, *executors]
    for i, request in enumerate(requests[1:], start=1):
        first = i % len(clients)  # the order rotates step by step: each server goes first alike
        calls = {id(c): timed_call(c, request) for c in clients[first:] + clients[:first]}
        bare_ns, _ = calls[id(bare)]
        wall_ns, response = calls[id(executor)]
        if i <= warmup:
            continue
        if baseline is not None:
            base_ns, base_response = calls[id(baseline)]
            base_model = device_ns or base_response.stats.timings_ns[MODEL]
            result.baseline_us.append((base_ns - base_model) / 1e3)
            result.baseline_model_us.append(base_model / 1e3)
        timings = dict(response.stats.timings_ns)
        model = device_ns or timings[MODEL]
        overhead = wall_ns - model
        step = timings.pop(TOTAL)
        # Under the stand-in its forward is host work (a few ops): a part of the overhead.
        split = {k: v for k, v in timings.items() if k != MODEL or device_ns}
        split["step other"] = step - sum(v for k, v in timings.items() if k != "queue")
        split[REST] = wall_ns - step - timings.get("queue", 0)
        result.bare_us.append(bare_ns / 1e3)
        result.overhead_us.append(overhead / 1e3)
        result.model_us.append(model / 1e3)
        for k, v in split.items():
            result.phases_us.setdefault(k, []).append(v / 1e3)
        t0 = time.perf_counter_ns()
        batch_to_proto(decodes[i])
        response_from_proto(response)
        result.client_codec_us.append((time.perf_counter_ns() - t0) / 1e3)
    return result


PHASE_ORDER = ("queue", "validate", "stage", "sample", "step other", REST)


def table(results: list[Result]) -> str:
    """The markdown table: medians (p90 after the slash) in microseconds."""
    phases = [p for p in PHASE_ORDER if any(p in r.phases_us for r in results)]
    phases += sorted({p for r in results for p in r.phases_us} - set(phases))
    head = [
        "bs", "bare round trip", "executor overhead", "ratio", "target", "model forward",
        *phases, "client codec",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in results:
        target = TARGETS.get(r.bs)
        cells = [
            str(r.bs),
            f"{statistics.median(r.bare_us):.0f} / {p90(r.bare_us):.0f}",
            f"{statistics.median(r.overhead_us):.0f} / {p90(r.overhead_us):.0f}",
            f"{r.ratio:.2f}x",
            f"{target}x" if target else "-",
            f"{statistics.median(r.model_us):.0f}",
            *(
                f"{statistics.median(r.phases_us[p]):.0f}" if p in r.phases_us else "-"
                for p in phases
            ),
            f"{statistics.median(r.client_codec_us):.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _change(before: float, after: float) -> str:
    return f"{after - before:+.0f} ({(after - before) / before:+.0%})"


def baseline_table(results: list[Result], name: str = "baseline") -> str:
    """The A/B table: the baseline's overhead and model forward against this tree's, medians
    in us (a change that moves work into the forward shows in the second)."""
    head = [
        "bs", "bare round trip", f"{name} overhead", "ratio", "overhead", "ratio", "change",
        f"{name} forward", "forward", "change",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    med = statistics.median
    for r in results:
        bare = med(r.bare_us)
        base, new = med(r.baseline_us), med(r.overhead_us)
        base_fwd, fwd = med(r.baseline_model_us), med(r.model_us)
        cells = [
            str(r.bs), f"{bare:.0f}", f"{base:.0f}", f"{base / bare:.2f}x", f"{new:.0f}",
            f"{new / bare:.2f}x", _change(base, new), f"{base_fwd:.0f}", f"{fwd:.0f}",
            _change(base_fwd, fwd),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--batch-sizes", default="1,32,256")
    ap.add_argument("--steps", type=int, default=200, help="measured steps per batch size")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for the executor's process (repeatable)",
    )
    ap.add_argument(
        "--baseline-tree",
        type=Path,
        metavar="DIR",
        help="another checkout to serve a second executor from, measured in the same rotation",
    )
    ap.add_argument(
        "--python-paths",
        action="store_true",
        help="the second executor: this tree with the host kernels off (the Python paths)",
    )
    ap.add_argument(
        "--simulated-step-ms",
        type=float,
        metavar="D",
        help="serve the stand-in accelerator (D ms of device work a step) instead of the model",
    )
    ap.add_argument("--bare-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_server is not None:
        server, _ = start_bare_server(args.bare_server)
        server.wait_for_termination()
        return
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    span = PROMPT_LEN + 1 + args.warmup + args.steps  # KV slots per request row
    rows = sum(sizes)
    flags = [
        "--model", "tiny-random", "--dtype", "float32", "--graph-mode", "none",
        "--max-reqs", str(rows + 1), "--max-batch-size", str(max(sizes)),
        "--kv-slots", str(rows * span + 8), "--max-context-len", str(span + 8),
    ]  # fmt: skip
    device_ns = None
    if args.simulated_step_ms:
        flags += ["--simulated-step-ms", str(args.simulated_step_ms)]
        device_ns = round(args.simulated_step_ms * 1e6)
    model, simd = cpu_description()
    print(f"# {model} ({simd}); torch {torch.__version__}, grpcio {grpc.__version__}, ", end="")
    print(f"Python {platform.python_version()}; {args.steps} steps per bs after {args.warmup}")
    env = dict(kv.split("=", 1) for kv in args.server_env)
    print(f"# executor: {' '.join([*args.server_env, 'python -m executor serve', *flags])}")
    if args.baseline_tree is not None and args.python_paths:
        ap.error("--baseline-tree and --python-paths both name the second executor")
    if args.baseline_tree is not None:
        print(f"# baseline: the same, served from {args.baseline_tree.resolve()}")
    if args.python_paths:
        print(f"# python paths: the same, served by {PYTHON_PATHS.name} (host kernels off)")
    print(f"# load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = []
    with ExitStack() as stack:
        executor = stack.enter_context(served(flags, env))
        baseline = None
        if args.baseline_tree is not None:
            root = args.baseline_tree.resolve()
            baseline = stack.enter_context(served(flags, env, root=root)).client
        elif args.python_paths:
            launcher = (str(PYTHON_PATHS),)
            baseline = stack.enter_context(served(flags, env, launcher=launcher)).client
        bare = stack.enter_context(bare_served())
        first_row = 1
        for bs in sizes:
            r = measure(
                executor.client,
                bare,
                bs,
                args.steps,
                first_row=first_row,
                warmup=args.warmup,
                baseline=baseline,
                device_ns=device_ns,
            )
            first_row += bs
            results.append(r)
            print(
                f"# bs {bs}: request {r.request_bytes} B, response {r.response_bytes} B "
                f"(bare {r.bare_response_bytes} B)"
            )
    print(
        "\nmicroseconds per step, median / p90; the split columns are medians of the overhead's parts"
    )
    print(table(results))
    if args.baseline_tree is not None:
        print("\nexecutor overhead, baseline tree against this one (medians, us)")
        print(baseline_table(results))
    if args.python_paths:
        print("\nexecutor overhead, the Python paths against the host kernels (medians, us)")
        print(baseline_table(results, "python paths"))
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
