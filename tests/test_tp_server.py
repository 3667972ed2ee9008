"""`serve --tp-size 2` as a real process (tiny-random, gloo): it spawns its worker, answers
with tp 1's tokens and reports tp_size; SIGTERM stops every rank (no orphans); a killed
worker turns it NOT_SERVING, answers UNAVAILABLE and exits non-zero within a bounded time.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from executor.batch_prep import make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.client.scheduler import generate
from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from tests.server_util import free_port, serve_command

PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 3, 77, 250, 12, 9, 31]]
TP_TIMEOUT_S = 8  # the collective timeout: a hung rank is found within about 1.25x this


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    return bool((mapped or address).is_loopback)


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return False


class Served:
    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        cmd = serve_command(
            self.port,
            tmp_path / "cache",
            "--tp-size",
            "2",
            "--tp-timeout-s",
            str(TP_TIMEOUT_S),
            "--metrics-port",
            str(self.metrics_port),
            "--max-reqs",
            "8",
            "--kv-slots",
            "1024",
            "--max-context-len",
            "256",
            *flags,
        )
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.output: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def text(self) -> str:
        return "".join(self.output)


@contextlib.contextmanager
def _served(tmp_path: Path, *flags: str) -> Iterator[tuple[Served, ExecutorClient, set[int]]]:
    served = Served(tmp_path, *flags)
    children: set[int] = set()
    try:
        with ExecutorClient(f"127.0.0.1:{served.port}") as client:
            try:
                client.wait_ready(timeout=180)
            except TimeoutError as e:
                raise AssertionError(served.text) from e
            children = _descendants(served.proc.pid)
            yield served, client, children
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait(10)
        for pid in children | _descendants(served.proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        served.reader.join(10)


def _no_orphans(children: set[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_alive(p) for p in children):
        time.sleep(0.1)
    assert not [p for p in children if _alive(p)], "tensor-parallel children outlived the server"


@pytest.mark.slow
def test_serve_tp2_answers_like_tp1_and_sigterm_stops_every_rank(tmp_path: Path) -> None:
    ex = ModelExecutor(
        ExecutorConfig(
            model="tiny-random",
            device="cpu",
            max_reqs=8,
            kv_slots=1024,
            max_context_len=256,
            dtype="float32",
        )
    )
    want = generate(ex.forward, ex.limits, PROMPTS, max_new_tokens=8, ignore_eos=True)
    with _served(tmp_path) as (served, client, children):
        info = client.info()
        assert info.info.tp_size == 2
        try:
            got = generate(
                client.forward, info.info.limits, PROMPTS, max_new_tokens=8, ignore_eos=True
            )
        except grpc.RpcError as e:
            raise AssertionError(served.text) from e
        assert got == want
        with urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}/metrics") as r:
            metrics = r.read().decode()
        count = re.search(
            r'^model_executor_allreduce_seconds_count\{rank="0"\} (\S+)$', metrics, re.M
        )
        assert count is not None and float(count.group(1)) > 0, metrics
        assert 'tp_size="2"' in metrics and 'rank="0"' in metrics
        assert children, "no worker process was spawned"
        # The group listens on loopback only (a FileStore, no TCPStore; gloo pinned to lo):
        # nothing off the pod can join it or write its store.
        exposed = [
            (pid, c.laddr)
            for pid in (served.proc.pid, *children)
            for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and not _loopback(c.laddr.ip)
        ]
        assert exposed == [], exposed
        served.proc.send_signal(signal.SIGTERM)
        code = served.proc.wait(timeout=60)
        assert code == 0, served.text
        _no_orphans(children)
    text = served.text
    assert '"rank": 1' in text and '"tensor-parallel worker stopping"' in text, text
    assert '"event": "tensor-parallel workers stopped"' in text, text


@pytest.mark.slow
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "hung"])
def test_failed_worker_means_not_serving_unavailable_and_exit_1(
    tmp_path: Path, fault: signal.Signals
) -> None:
    """A dead worker (connection closed) or a hung one (the collective timeout) turns rank 0
    NOT_SERVING, answers UNAVAILABLE, and it exits 1 within about the timeout; every child,
    the stopped one too, is gone after."""
    with _served(tmp_path) as (served, client, children):
        # A health Watch, not polling: the server pushes NOT_SERVING the moment it drains,
        # however briefly the port stays open before `serve` exits.
        readiness: list[str] = []
        watching = threading.Event()

        def watch() -> None:
            with contextlib.suppress(grpc.RpcError):
                for status in client.watch_health(timeout=TP_TIMEOUT_S * 4):
                    readiness.append(status)
                    watching.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert watching.wait(30), "the health Watch never answered"
        workers = [p for p in children if _is_spawned_worker(p)]
        assert workers, served.text
        t0 = time.monotonic()
        for pid in workers:
            os.kill(pid, fault)
        batch = make_extend_batch(
            input_ids=[[5, 6, 7]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]]
        )
        with pytest.raises(grpc.RpcError) as err:
            client.forward(batch, timeout=TP_TIMEOUT_S * 3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        code = served.proc.wait(timeout=TP_TIMEOUT_S * 3)
        took = time.monotonic() - t0
        watcher.join(5)
        assert code == 1, served.text
        assert took < TP_TIMEOUT_S * 2, took
        assert "NOT_SERVING" in readiness, readiness
        assert '"event": "tensor-parallel group failed; not serving"' in served.text
        _no_orphans(children)


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def _is_spawned_worker(pid: int) -> bool:
    """A torch.multiprocessing spawn child (not its resource tracker)."""
    cmd = _cmdline(pid)
    return "spawn_main" in cmd
