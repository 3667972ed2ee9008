"""SIGTERM during start-up (a pod deleted while it loads or captures graphs): capture stops at
the next bucket, readiness never reports SERVING, the process exits 0 within the drain grace
and without an abort from a thread still running at interpreter exit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

from executor.client.grpc_client import ExecutorClient
from tests.server_util import free_port, serve_command

DRAIN_GRACE_S = 30.0


def _serve(tmp_path: Path, port: int, graphs: bool) -> subprocess.Popen[str]:
    cmd = serve_command(
        port, tmp_path / "cache", "--metrics-port", "-1", "--drain-grace-s", str(DRAIN_GRACE_S)
    )
    if graphs:  # many buckets: capture takes long enough on CPU to be interrupted
        cmd += [
            "--graph-mode",
            "both",
            # The CUDA-graph stand-in: the start-up capture's bucket loop, without inductor's
            # compile of each bucket (tests/test_background_capture.py stops a compile).
            "--graph-backend",
            "standin",
            "--graph-batch-sizes",
            ",".join(str(n) for n in range(1, 33)),
            "--piecewise-token-sizes",
            ",".join(str(n) for n in range(16, 513, 16)),
        ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.slow
@pytest.mark.parametrize("when", ["loading", "capturing"])
def test_sigterm_during_start_up_exits_zero_never_serving(tmp_path: Path, when: str) -> None:
    port = free_port()
    proc = _serve(tmp_path, port, graphs=True)
    output: list[str] = []
    signal_after = '"event": "listening"' if when == "loading" else '"event": "graph captured"'
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if signal_after in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    readiness: list[str] = []
    stop_polling = threading.Event()

    def poll() -> None:  # what a kubelet's readiness probe sees, until the port closes
        with ExecutorClient(f"127.0.0.1:{port}") as c:
            while not stop_polling.is_set():
                with contextlib.suppress(grpc.RpcError):  # not listening yet, or closed
                    readiness.append(c.health(timeout=2))
                time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        assert seen.wait(120), "".join(output)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = proc.wait(timeout=DRAIN_GRACE_S + 30)
        took = time.monotonic() - t0
    finally:
        stop_polling.set()
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    poller.join(10)
    text = "".join(output)
    assert code == 0, text
    assert took < DRAIN_GRACE_S, text
    assert "terminate called" not in text and "Traceback" not in text, text
    assert '"event": "start-up cancelled"' in text, text
    assert '"event": "ready"' not in text, text
    assert "SERVING" not in readiness, readiness
    if when == "capturing":
        # Stopped at a bucket boundary, well before the 64 buckets were all captured.
        assert '"event": "graph capture stopped"' in text, text
        assert text.count('"event": "graph captured"') < 64
