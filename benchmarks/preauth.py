"""Callers without credentials against the call path (issue 37), this tree and another side by
side (`--before`, e.g. the checkout before the change), each `serve` in its own process on
tiny-random with a call token:

- `stalled`: `--stalled` tokenless calls (GetInfo and Forward) that send their headers and
  never a body are opened; then an authenticated GetInfo's latency (median and slowest of
  `--calls`, each with a 3 s deadline: a timeout counts as 3000 ms) and how many of the
  stalled calls the server still held after a second (each holds a handler thread or an RPC
  slot while it is open);
- `health`: the slowest of `--calls` Checks on the health-only port while `--stalled`
  Checks that never send their body are open there;
- `forward`: the median round trip of a bs-1 DECODE `Forward` with the token (the access
  check's cost on the hot path), the servers taking the steps in turn.

    python benchmarks/preauth.py --before ../main [--stalled 200] [--calls 50]
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.served import ROOT, served
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from tests.server_util import free_port

TOKEN = "bench-call-token"


@dataclass
class Figures:
    getinfo_ms: list[float]
    still_held: int
    health_ms: list[float]
    forward_us: list[float]


def _stalled(target: str, method: str, n: int) -> tuple[list[grpc.Channel], list[object]]:
    channels = [grpc.insecure_channel(target) for _ in range(4)]
    calls: list[object] = []
    for i in range(n):
        raw = channels[i % 4].stream_unary(method, request_serializer=None)
        outbox: queue.Queue[bytes | None] = queue.Queue()
        calls.append((outbox, raw.future(iter(outbox.get, None), timeout=120)))
    return channels, calls


def _close(channels: list[grpc.Channel], calls: list[object]) -> None:
    for outbox, future in calls:  # type: ignore[misc]
        future.cancel()
        outbox.put(None)
    for ch in channels:
        ch.close()


def _flags(token_file: Path, health_port: int) -> list[str]:
    flags = ["--model", "tiny-random", "--dtype", "float32", "--graph-mode", "none"]
    flags += ["--call-token-file", str(token_file), "--health-port", str(health_port)]
    return [*flags, "--kv-slots", "4096", "--max-reqs", "8", "--max-context-len", "1024"]


def measure_stalled(port: int, health_port: int, stalled: int, calls: int) -> Figures:
    target = f"127.0.0.1:{port}"
    legit = ExecutorClient(target, token=TOKEN)
    held: list[object] = []
    channels: list[grpc.Channel] = []
    for method in ("GetInfo", "Forward"):
        ch, c = _stalled(target, f"/model_executor.v1.ModelExecutor/{method}", stalled // 2)
        channels += ch
        held += c
    time.sleep(1.0)
    still = sum(1 for _, f in held if not f.done())  # type: ignore[misc]
    getinfo = []
    for _ in range(calls):
        t0 = time.perf_counter()
        try:
            legit.info(timeout=3)
            getinfo.append((time.perf_counter() - t0) * 1e3)
        except grpc.RpcError:
            getinfo.append(3000.0)
    _close(channels, held)
    legit.close()
    hch, hcalls = _stalled(f"127.0.0.1:{health_port}", "/grpc.health.v1.Health/Check", stalled)
    time.sleep(1.0)
    health = []
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as probe:
        stub = health_pb2_grpc.HealthStub(probe)
        for _ in range(calls):
            t0 = time.perf_counter()
            try:
                stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
                health.append((time.perf_counter() - t0) * 1e3)
            except grpc.RpcError:
                health.append(3000.0)
    _close(hch, hcalls)
    return Figures(getinfo, still, health, [])


def measure_forward(clients: list[ExecutorClient], steps: int = 500) -> list[list[float]]:
    """bs-1 DECODE round trips (us), the servers taking them in turn."""
    for c in clients:
        c.forward(
            make_extend_batch(input_ids=[[5, 6]], req_pool_indices=[1], out_cache_loc=[[1, 2]])
        )
    times: list[list[float]] = [[] for _ in clients]
    for i in range(steps):
        batch = make_decode_batch(
            input_ids=[7], req_pool_indices=[1], seq_lens=[3 + i], out_cache_loc=[3 + i]
        )
        for which, c in enumerate(clients):
            t0 = time.perf_counter_ns()
            c.forward(batch)
            times[which].append((time.perf_counter_ns() - t0) / 1e3)
    return times


def row(name: str, f: Figures, stalled: int) -> str:
    return (
        f"| {name} | {statistics.median(f.getinfo_ms):.1f} / {max(f.getinfo_ms):.0f} ms | "
        f"{f.still_held} of {stalled} | {max(f.health_ms):.1f} ms | "
        f"{statistics.median(f.forward_us):.0f} us |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, default=None, help="another checkout to compare")
    parser.add_argument("--stalled", type=int, default=200)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    roots = [("this tree", ROOT)]
    if args.before is not None:
        roots.append(("before", args.before.resolve()))
    results: list[tuple[str, Figures]] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        token = Path(tmp) / "token"
        token.write_text(TOKEN + "\n")
        servers = []
        for name, root in roots:
            health_port = free_port()
            flags = _flags(token, health_port)
            server = stack.enter_context(served(flags, root=root, token=TOKEN))
            servers.append((name, server, health_port))
        for name, server, health_port in servers:
            figures = measure_stalled(server.port, health_port, args.stalled, args.calls)
            results.append((name, figures))
        forward = measure_forward(
            [ExecutorClient(f"127.0.0.1:{s.port}", token=TOKEN) for _, s, _ in servers]
        )
        for (_, figures), times in zip(results, forward, strict=True):
            figures.forward_us = times
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; load {os.getloadavg()}"
    )
    print(
        f"| tree | authenticated GetInfo with {args.stalled} stalled tokenless calls "
        "(median / slowest) | stalled calls still held after 1 s | health port, "
        f"{args.stalled} stalled Checks (slowest) | bs-1 DECODE Forward with the token (median) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, figures in results:
        print(row(name, figures, args.stalled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
