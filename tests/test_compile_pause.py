"""`CompilePause` (issue 36): on a CPU, a batch stops the compile worker's whole process group
(the worker and the compiler processes it started) from its arrival to its answer, a step for
its device work; the worker goes on once nothing ran for LINGER_S; a shutdown kills the group,
stopped or not."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.config import ExecutorConfig
from executor.core.errors import BatchValidationError
from executor.graphs import compile_job
from executor.graphs.compile_job import CompileJob, compile_in_worker
from executor.graphs.compile_pause import LINGER_S, CompilePause, process_state
from executor.graphs.idle_gate import IdleGate
from executor.model_executor import ModelExecutor
from executor.model_runner import ModelRunner
from executor.observability import logs
from executor.service import servicer
from tests.server_util import running_server, tiny_config
from tests.test_graphs import _prefill

# A worker that starts a child (as inductor starts the C++ compiler) and prints its pid.
_PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.01)'])\n"
    "print(child.pid, flush=True)\n"
    "while True: time.sleep(0.01)\n"
)


def _wait_state(pid: int, want: Callable[[str], bool], timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while not want(state := process_state(pid)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


@pytest.fixture
def worker() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, process_group=0
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    yield proc, child
    for pid in (proc.pid, child):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def test_steps_stop_the_worker_and_its_children_which_go_on_once_the_server_idles(
    worker: tuple[subprocess.Popen[bytes], int],
) -> None:
    proc, child = worker
    pause = CompilePause()
    pause.pause()  # nothing attached: nothing to stop
    assert pause.pauses == 0
    pause.attach(proc)
    pause.pause()
    assert _wait_state(proc.pid, "T".__eq__) == "T" and _wait_state(child, "T".__eq__) == "T"
    assert pause.poll() is None  # stopped, not ended
    time.sleep(LINGER_S * 2)
    pause.tick()  # a step runs: it stays stopped
    assert process_state(proc.pid) == "T"
    pause.resume()
    pause.pause()  # the next step, back to back: no second stop
    pause.resume()
    pause.tick()  # idle for less than the linger: still stopped
    assert process_state(proc.pid) == "T" and pause.pauses == 1
    time.sleep(LINGER_S * 1.5)
    pause.tick()
    assert _wait_state(proc.pid, "T".__ne__) != "T" and _wait_state(child, "T".__ne__) != "T"
    assert pause.pauses == 1 and pause.paused_s >= LINGER_S * 3
    pause.pause()
    pause.kill()  # stopped: the whole group dies all the same, the worker reaped
    assert not pause.attached and proc.returncode is not None
    assert _wait_state(child, lambda s: s in ("gone", "Z")) in ("gone", "Z")
    pause.pause()  # detached: a no-op again
    pause.resume()
    pause.tick()


def test_a_batch_holds_it_stopped_from_its_arrival_to_its_answer(
    worker: tuple[subprocess.Popen[bytes], int],
) -> None:
    """Batches overlap (counted); the step inside one ends before its answer is sent: the
    worker goes on only after the last batch left, and the linger."""
    proc, _ = worker
    pause = CompilePause()
    pause.attach(proc)
    pause.batch_arrived()  # a batch arrives (an RPC thread)
    assert _wait_state(proc.pid, "T".__eq__) == "T"
    pause.batch_arrived()  # a second one, from another caller
    pause.pause()  # the first one's step: stopped already, no second signal
    pause.resume()
    pause.batch_left()
    time.sleep(LINGER_S * 1.5)
    pause.tick()
    assert process_state(proc.pid) == "T" and pause.pauses == 1
    pause.batch_left()  # the last one answered: the idle time starts now
    pause.tick()
    assert process_state(proc.pid) == "T"
    time.sleep(LINGER_S * 1.5)
    pause.tick()
    assert _wait_state(proc.pid, "T".__ne__) != "T" and pause._arrivals == 0


def test_a_served_batch_stops_the_worker_before_its_decoding_and_admission(
    tmp_path: Path,
    worker: tuple[subprocess.Popen[bytes], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the server: the worker is stopped by the time the request is decoded (before
    the device thread has the batch), and the batch is let go once answered: one refused (a
    row beyond the table), one that ran, one refused at decoding."""
    proc, _ = worker
    decoded: list[str] = []
    real = servicer.batch_from_proto

    def spy(*args: Any, **kwargs: Any) -> Any:
        decoded.append(_wait_state(proc.pid, "T".__eq__, 2))
        return real(*args, **kwargs)

    monkeypatch.setattr(servicer, "batch_from_proto", spy)
    with (
        running_server(tiny_config(tmp_path, graph_mode="none")) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as client,
    ):
        assert srv.servicer.worker is not None
        runner = srv.servicer.worker.executor.runner
        pause, gate = runner.compile_pause, runner.idle_gate
        assert logs.WRITE_LOCK._is_owned in gate._guards  # (the device worker's)
        pause.attach(proc)
        bad = make_extend_batch(input_ids=[[1]], req_pool_indices=[10_000], out_cache_loc=[[1]])
        with pytest.raises(grpc.RpcError):
            client.forward(bad)  # refused: a row beyond the table
        assert decoded == ["T"] and pause._arrivals == 0 and gate._arrivals == 0
        out = client.forward(
            make_extend_batch(input_ids=[[1, 2]], req_pool_indices=[1], out_cache_loc=[[1, 2]])
        )
        assert len(out.next_token_ids) == 1
        assert decoded == ["T", "T"] and pause._arrivals == 0 and gate._arrivals == 0
        monkeypatch.setattr(servicer, "batch_from_proto", _refuse)
        with pytest.raises(grpc.RpcError):
            client.forward(
                make_extend_batch(input_ids=[[1]], req_pool_indices=[2], out_cache_loc=[[3]])
            )
        assert pause._arrivals == 0 and gate._arrivals == 0
        time.sleep(LINGER_S * 1.5)
        pause.tick()
        assert _wait_state(proc.pid, "T".__ne__) != "T"
        pause.kill()


def test_only_a_cpu_server_counts_arrivals() -> None:
    """On an accelerator the compile and the load share no core with the steps: an arrival
    costs one check there, and holds nothing to release."""
    for device, held in (("cuda", 0), ("cpu", 1)):
        runner = SimpleNamespace(
            device=torch.device(device), compile_pause=CompilePause(), idle_gate=IdleGate()
        )
        holds = ModelRunner.batch_arrived(runner)  # type: ignore[arg-type]
        assert runner.compile_pause._arrivals == runner.idle_gate._arrivals == held
        assert holds == bool(held)
        if holds:  # (the servicer's rule: `batch_left` only for a batch that holds)
            ModelRunner.batch_left(runner)  # type: ignore[arg-type]
        assert runner.compile_pause._arrivals == runner.idle_gate._arrivals == 0


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise BatchValidationError("batch.input_ids: refused by the test")


def test_the_worker_compiles_between_the_steps_and_ends_detached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """compile_in_worker attaches its worker: a step's pause stops it (its work waits); once
    the step ends its wait loop lets it go on and finish; then it is reaped and detached."""
    marker = tmp_path / "started"
    script = (
        "import pathlib, sys, time, json\n"
        f"pathlib.Path({str(marker)!r}).write_text('x')\n"
        "time.sleep(0.3)\n"
        "pathlib.Path(sys.argv[1]).write_text(json.dumps({'failed': {}, 'seconds': 0.3}))\n"
    )
    monkeypatch.setattr(
        compile_job,
        "worker_command",
        lambda job, result: [sys.executable, "-c", script, str(result)],
    )
    job = CompileJob(ExecutorConfig(model="tiny-random", device="cpu"), ("decode",), False)
    pause = CompilePause()
    answer: list[str | None] = []
    t = threading.Thread(
        target=lambda: answer.append(compile_in_worker(job, threading.Event(), pause))
    )
    t.start()
    deadline = time.monotonic() + 10
    while not (marker.exists() and pause.attached) and time.monotonic() < deadline:
        time.sleep(0.01)
    pause.pause()  # a step: the worker cannot finish meanwhile
    t.join(1.0)
    assert t.is_alive()
    pause.resume()
    t.join(10)
    assert answer == [None] and not pause.attached
    assert pause.pauses == 1 and pause.paused_s >= 1.0


def test_a_step_stops_the_attached_worker_for_its_device_work(
    make_executor: Callable[..., ModelExecutor],
    worker: tuple[subprocess.Popen[bytes], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped during the forward and the draw, on again once the server idles after the
    step; after a step that fails too."""
    proc, child = worker
    ex = make_executor(graph_mode="none")
    _prefill(ex, [1], [3], first_slot=1)
    ex.runner.compile_pause.attach(proc)
    seen: list[tuple[str, str]] = []
    forward = ex.runner.forward

    def spy(fb):  # (a stop is delivered a moment after the signal is sent)
        seen.append((_wait_state(proc.pid, "T".__eq__, 2), _wait_state(child, "T".__eq__, 2)))
        return forward(fb)

    monkeypatch.setattr(ex.runner, "forward", spy)
    out = ex.forward(
        make_decode_batch(input_ids=[5], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[9])
    )
    assert out.stats.path == "eager" and seen == [("T", "T")]
    pause = ex.runner.compile_pause
    assert not pause._stepping  # the step ended: the idle time runs
    time.sleep(LINGER_S * 1.5)
    pause.tick()  # (the capture thread's, every TICK_S)
    assert _wait_state(proc.pid, "T".__ne__) != "T" and _wait_state(child, "T".__ne__) != "T"

    def broken(fb):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(ex.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        ex.forward(
            make_decode_batch(input_ids=[6], req_pool_indices=[1], seq_lens=[5], out_cache_loc=[10])
        )
    assert _wait_state(proc.pid, "T".__eq__) == "T" and not pause._stepping
    time.sleep(LINGER_S * 1.5)
    pause.tick()
    assert _wait_state(proc.pid, "T".__ne__) != "T"
    assert pause.pauses == 2


def test_a_stopped_worker_group_ends_when_its_server_dies() -> None:
    """A server killed while a step holds its worker stopped leaves no stopped orphans: the
    group (its own, in the server's session) is orphaned with stopped members, and the
    kernel sends it SIGHUP and SIGCONT."""
    server = (
        "import os, signal, subprocess, sys, time\n"
        f"worker = subprocess.Popen([sys.executable, '-c', {_PARENT!r}],"
        " stdout=subprocess.PIPE, process_group=0)\n"
        "child = int(worker.stdout.readline())\n"
        "os.killpg(worker.pid, signal.SIGSTOP)\n"
        "print(worker.pid, child, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", server], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    worker, child = map(int, proc.stdout.readline().split())
    assert _wait_state(worker, "T".__eq__) == "T" and _wait_state(child, "T".__eq__) == "T"
    proc.kill()
    proc.wait()
    ended = ("gone", "Z")
    assert _wait_state(worker, ended.__contains__) in ended
    assert _wait_state(child, ended.__contains__) in ended


def test_a_worker_killed_while_stopped_is_reaped_and_never_signalled_again(
    worker: tuple[subprocess.Popen[bytes], int],
) -> None:
    """The OOM killer may end a stopped worker: `poll` reaps it and detaches without a
    SIGCONT to its group id, which is no longer the worker's once it is reaped."""
    proc, _ = worker
    pause = CompilePause()
    pause.attach(proc)
    pause.pause()
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while (code := pause.poll()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert code == -signal.SIGKILL and not pause.attached
    assert pause.pauses == 1 and pause.paused_s > 0
    pause.resume()  # nothing in force: no signal
    pause.pause()  # detached: nothing
    assert pause.pauses == 1
