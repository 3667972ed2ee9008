"""What hardening costs and holds (issue 29), on tiny-random over loopback gRPC:

- `access`: the median round trip of a bs-1 DECODE `Forward` with no access rule, and with
  `call_token_file` (the interceptor: request bytes handed through, token compared, then
  decoded), the two servers taking requests in turn;
- `health`: the slowest of `--probes` health checks on the health-only port while every
  handler thread of the main port is held by idle streams, idle reflection streams and unary
  calls whose body never arrives;
- `headers`: the time and peak Python memory to refuse hostile model headers (a 45-byte GGUF
  claiming 2**63 tensors; a safetensors header claiming a 2**63-byte length, and a tensor of
  4 TiB in a 16-byte file).

    python benchmarks/hardening.py [--calls 1000] [--probes 50]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import struct
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.config import ExecutorConfig
from executor.models.gguf_header import check_gguf_header
from executor.models.safetensors_header import check_safetensors_header
from executor.service.server import RunningServer, start_server
from executor.service.server_config import ServerConfig
from model_executor.v1 import executor_pb2_grpc as pb_grpc


def tiny(cache_dir: Path) -> ExecutorConfig:
    return ExecutorConfig(
        model="tiny-random",
        device="cpu",
        max_reqs=8,
        kv_slots=4096,
        max_context_len=1024,
        cache_dir=str(cache_dir),
        graph_mode="none",
        dtype="float32",
    )


def serve(config: ExecutorConfig, **server: object) -> RunningServer:
    values: dict[str, object] = {"host": "127.0.0.1", "port": 0, "metrics_port": -1}
    values.update(server)
    return start_server(config, ServerConfig(**values), block_until_ready=True)  # type: ignore[arg-type]


@dataclass
class AccessResult:
    open_us: list[float]
    token_us: list[float]

    @property
    def added_us(self) -> float:
        return statistics.median(self.token_us) - statistics.median(self.open_us)


def measure_access(
    open_client: ExecutorClient, token_client: ExecutorClient, calls: int
) -> AccessResult:
    """Alternating bs-1 DECODE steps on row 1 of each server (prefilled here first)."""
    if not 0 < calls <= 1000:
        raise ValueError(f"calls must be in 1..1000 (one row of max_context_len 1024), got {calls}")
    for client in (open_client, token_client):
        client.forward(
            make_extend_batch(input_ids=[[5, 6]], req_pool_indices=[1], out_cache_loc=[[1, 2]])
        )
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(calls):
        slot = 3 + i
        batch = make_decode_batch(
            input_ids=[7], req_pool_indices=[1], seq_lens=[slot], out_cache_loc=[slot]
        )
        for which, client in enumerate((open_client, token_client)):
            t0 = time.perf_counter_ns()
            client.forward(batch)
            times[which].append((time.perf_counter_ns() - t0) / 1e3)
    return AccessResult(times[0], times[1])


def measure_health(srv: RunningServer, probes: int) -> list[float]:
    """Health-port latencies (ms) while the main port's handler threads are all held."""
    assert srv.health_port is not None
    stop = threading.Event()

    def idle() -> Iterator[bytes]:
        stop.wait(60)
        yield from ()

    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    holders: list[object] = []
    threads = srv.server_config.rpc_threads
    holders += [pb_grpc.ModelExecutorStub(channel).ForwardStream(idle()) for _ in range(threads)]
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    holders += [reflection.ServerReflectionInfo(idle()) for _ in range(threads)]
    stalled = channel.stream_unary(
        "/model_executor.v1.ModelExecutor/GetInfo", request_serializer=None
    )
    holders += [stalled.future(idle()) for _ in range(threads)]
    time.sleep(0.5)
    latencies = []
    try:
        with ExecutorClient(f"127.0.0.1:{srv.health_port}") as probe:
            for _ in range(probes):
                t0 = time.perf_counter()
                if probe.health("", timeout=1.0) != "SERVING":
                    raise AssertionError("liveness not SERVING")
                latencies.append((time.perf_counter() - t0) * 1e3)
    finally:
        stop.set()
        for holder in holders:
            holder.cancel()  # type: ignore[attr-defined]
        channel.close()
    return latencies


def _timed(fn: Callable[[], object]) -> tuple[float, int, str]:
    """(ms, peak Python bytes, the refusal) of `fn`, which must raise ValueError."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
    except ValueError as exc:
        refusal = str(exc)
    else:
        raise AssertionError("a hostile header was accepted")
    finally:
        ms = (time.perf_counter() - t0) * 1e3
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return ms, peak, refusal


def measure_headers(folder: Path) -> dict[str, tuple[float, int, str]]:
    gguf = folder / "hostile.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 63, 0) + bytes(21))  # 45 bytes
    huge = folder / "huge-length.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 63) + b"{}")
    raw = json.dumps({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]}})
    tib = folder / "4tib.safetensors"
    tib.write_bytes(struct.pack("<Q", len(raw)) + raw.encode() + bytes(16))
    return {
        "GGUF, 45 bytes, 2**63 tensors": _timed(lambda: check_gguf_header(gguf)),
        "safetensors, header length 2**63": _timed(lambda: check_safetensors_header(huge)),
        "safetensors, a 4 TiB tensor in 16 bytes": _timed(lambda: check_safetensors_header(tib)),
    }


def report(
    access: AccessResult, health: list[float], headers: dict[str, tuple[float, int, str]]
) -> str:
    lines = [
        "| measure | value |",
        "|---|---|",
        f"| bs-1 DECODE round trip, no access rule (median) | {statistics.median(access.open_us):.0f} us |",
        f"| the same with call_token_file (median) | {statistics.median(access.token_us):.0f} us |",
        f"| added by the access check | {access.added_us:+.0f} us |",
        f"| health port, main port saturated: slowest of {len(health)} | {max(health):.1f} ms |",
    ]
    for name, (ms, peak, _) in headers.items():
        lines.append(f"| refuse {name} | {ms:.2f} ms, peak {peak / 1024:.0f} KiB |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="at most 1000 (one row's context)")
    parser.add_argument("--probes", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "token").write_text("bench-token")
        config = tiny(folder / "cache")
        plain = serve(config)
        guarded = serve(
            config,
            call_token_file=str(folder / "token"),
            rpc_threads=4,
            max_forward_calls=2,
            health_port=0,
        )
        try:
            with (
                ExecutorClient(f"127.0.0.1:{plain.port}") as open_client,
                ExecutorClient(f"127.0.0.1:{guarded.port}", token="bench-token") as token_client,
            ):
                access = measure_access(open_client, token_client, args.calls)
            health = measure_health(guarded, args.probes)
        finally:
            plain.drain(1.0)
            guarded.drain(1.0)
        headers = measure_headers(folder)
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads default"
    )
    print(report(access, health, headers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
