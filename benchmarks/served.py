"""The executor in its own process for the benchmarks (`python -m executor serve`), as it is
deployed: a client in the benchmark's process shares neither its GIL nor its OpenMP threads.

    with served(["--model", "smollm2", "--quantization", "gguf"]) as server:
        server.client.forward(batch)
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from executor.client.grpc_client import ExecutorClient

ROOT = Path(__file__).resolve().parents[1]


def cpu_description() -> tuple[str, str]:
    """(model name, the SIMD flags that decide the kernels) from /proc/cpuinfo."""
    model, flags = platform.processor() or "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "x86_64", ""):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma", "f16c")
                flags = " ".join(f for f in line.split(":", 1)[1].split() if f in wanted)
    except OSError:
        pass
    return model, flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    client: ExecutorClient
    port: int
    ready_s: float  # from the process's start until readiness
    process: subprocess.Popen[bytes]
    started_at: float = 0.0  # time.perf_counter() when the process started


@contextmanager
def served(
    flags: list[str],
    env: Mapping[str, str] | None = None,
    ready_timeout: float = 1800,
    root: Path = ROOT,
    token: str | None = None,
    launcher: tuple[str, ...] = ("-m", "executor"),
) -> Iterator[Served]:
    """Start `serve` with `flags` (plus a free port, no metrics port, warning-level logs),
    wait for readiness, yield it with a connected client; stop it on the way out. `root`:
    the checkout whose code serves (another tree's, for a side-by-side comparison);
    `launcher`: what runs the CLI (a script path, e.g. `serve_python_paths.py`)."""
    port = free_port()
    cmd = [
        sys.executable, *launcher, "serve", "--port", str(port), "--metrics-port", "-1",
        "--log-level", "warning", *flags,
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(root), str(root / "proto"), os.getenv("PYTHONPATH")]))
    # Loopback: the benchmarks change runtime toggles without a token (an older tree's
    # server, run side by side, ignores the variable).
    environ = {
        **os.environ,
        "PYTHONPATH": path,
        "MODEL_EXECUTOR_OPERATOR_CALLS_OPEN": "1",
        **(env or {}),
    }
    t0 = time.perf_counter()
    process = subprocess.Popen(cmd, env=environ, cwd=root)
    client = ExecutorClient(f"127.0.0.1:{port}", token=token)  # `token`: the call token
    try:
        deadline = time.monotonic() + ready_timeout
        while True:  # in short waits, so a server that died is reported at once
            if process.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {process.returncode}")
            try:
                client.wait_ready(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
        yield Served(client, port, time.perf_counter() - t0, process, t0)
    finally:
        client.close()
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
