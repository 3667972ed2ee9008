"""Children that exit when their server is gone (`executor.parent_watch`): a tp worker, the
compile worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from executor import compile_worker
from executor.graphs.compile_pause import process_state

ROOT = Path(__file__).resolve().parents[1]
CHILD = (
    "from executor.parallel.parent_watch import die_with_parent as d; "
    "import time; d(0.05); time.sleep(60)"
)
PARENT = (
    "import subprocess, sys, time; "
    f"p = subprocess.Popen([sys.executable, '-c', {CHILD!r}]); "
    "print(p.pid, flush=True); time.sleep(60)"
)


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may not reap an orphan at once)."""
    return process_state(pid) not in ("gone", "Z")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_watched_child_exits_when_its_parent_is_killed() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, env=env)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the child's watch started
        assert running(child)
        parent.send_signal(signal.SIGKILL)  # no drain, no clean-up: the child must notice
        parent.wait()
        deadline = time.monotonic() + 30
        while running(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()


def test_the_compile_worker_watches_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(compile_worker, "die_with_parent", lambda: calls.append("watch"))
    monkeypatch.setattr(compile_worker, "lower_priority", lambda: calls.append("nice") or 10)
    monkeypatch.setattr(compile_worker, "run_job", lambda job: {})
    monkeypatch.setattr(
        compile_worker.CompileJob, "from_json", lambda text: SimpleNamespace(runners=["decode"])
    )
    job, result = tmp_path / "job", tmp_path / "result"
    job.write_text("{}")
    assert compile_worker.main([str(job), str(result)]) == 0
    assert calls == ["watch", "nice"]  # before any work
