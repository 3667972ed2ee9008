"""Inductor's vector-ISA probes (a C++ build and a process per ISA, once a process) run while
the compile worker compiles, not beside the steps of the load that follows (issue 36)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from torch._inductor import cpu_vec_isa

from executor.config import ExecutorConfig
from executor.graphs import compile_cache, compile_job
from executor.graphs.compile_cache import probe_vec_isas
from executor.graphs.compile_job import CompileJob, compile_in_worker


def test_the_probes_run_once_a_process_and_a_failure_is_only_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probe_vec_isas()  # (this process's, if not run before)
    hits = cpu_vec_isa.valid_vec_isa_list.cache_info().hits
    probe_vec_isas()  # a load's: from the process's cache, no process started
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().hits == hits + 1

    def broken() -> None:
        raise RuntimeError("no compiler")

    logged: list[str] = []
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", broken)
    monkeypatch.setattr(compile_cache.log, "warning", lambda event, **kw: logged.append(event))
    probe_vec_isas()
    assert logged == ["vector ISA probes failed"]


def test_meanwhile_runs_once_the_worker_started_and_before_it_ends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    job = CompileJob(
        ExecutorConfig(model="tiny-random", device="cpu", cache_dir=str(tmp_path)),
        ("decode",),
        needs_cpu_seq_lens=False,
    )
    done = tmp_path / "done"
    worker = (
        "import json, pathlib, sys, time; time.sleep(0.5); "
        f"pathlib.Path({str(done)!r}).touch(); "
        "pathlib.Path(sys.argv[1]).write_text(json.dumps({'failed': {}}))"
    )
    monkeypatch.setattr(
        compile_job, "worker_command", lambda job, result: [sys.executable, "-c", worker, result]
    )
    seen: list[bool] = []
    reason = compile_in_worker(job, threading.Event(), meanwhile=lambda: seen.append(done.exists()))
    assert reason is None
    assert seen == [False] and done.exists()
