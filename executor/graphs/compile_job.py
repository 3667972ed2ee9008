"""A compile job and its launcher: the server compiles a graph mode's buckets into the caches
in a process of its own (`executor.compile_worker`) at a low CPU priority (nice 10), while it
keeps serving.

Compiling a whole-step graph is minutes of Python (dynamo's trace, inductor's lowering and
code generation) and C++ compiles. In the server's process that Python holds the GIL, and
every eager step then waits for it once per op (measured: several times slower). In the
worker it holds another process's GIL, at a low CPU priority (`WORKER_NICE`); on a CPU
device it also stops while steps run (`CompilePause`). What the worker leaves behind is
in the cache dir: the whole compiled steps (`<cache_dir>/graphs`) and inductor's caches (the
layer halves' compiled code). The server's own capture then loads them: its compile phase is
a load, its capture (under the step lock) the warm-up runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from executor.config import ExecutorConfig
from executor.graphs.compile_pause import TICK_S, CompilePause

log = structlog.get_logger(__name__)

WORKER_MODULE = "executor.compile_worker"  # the worker's entry (it builds an executor)
# The worker's niceness: CFS then gives it about a tenth of a core that a step's thread also
# wants (weights 110 against 1024), and all of a core nobody wants. Lower priorities
# (nice 19, SCHED_IDLE) starved it on a busy machine: a tiny model's compile made no
# progress in minutes beside other processes.
WORKER_NICE = 10
LOG_TAIL_BYTES = 4000  # of the worker's output, in the reason of a failure


@dataclass(frozen=True)
class CompileJob:
    """What to compile: the server's settings with its resolved graph choices (backend,
    bucket lists), the runners it will capture, and the host-lengths decision its capture
    uses (the decode runner's buffers depend on it)."""

    config: ExecutorConfig
    runners: tuple[str, ...]  # decode | piecewise: the runners the server will capture
    needs_cpu_seq_lens: bool

    def to_json(self) -> str:
        return json.dumps(
            {
                "config": dataclasses.asdict(self.config),
                "runners": list(self.runners),
                "needs_cpu_seq_lens": self.needs_cpu_seq_lens,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> CompileJob:
        data = json.loads(text)
        return cls(
            ExecutorConfig(**data["config"]), tuple(data["runners"]), data["needs_cpu_seq_lens"]
        )


def worker_command(job_file: Path, result_file: Path) -> list[str]:
    return [sys.executable, "-m", WORKER_MODULE, str(job_file), str(result_file)]


def compile_in_worker(
    job: CompileJob, stop: threading.Event, pause: CompilePause | None = None
) -> str | None:
    """Run the worker for `job` and wait for it (the calling thread only); None when it
    compiled every bucket, else why not (the server's capture then compiles what is
    missing itself). Killed when `stop` is set (a shutdown). With `pause` (a CPU device),
    the worker stops while steps run (`CompilePause`)."""
    root = str(Path(__file__).resolve().parents[2])  # where the `executor` package lives
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    pause = pause if pause is not None else CompilePause()  # no step pauses it: only the waiting
    with tempfile.TemporaryDirectory(prefix="compile-worker-") as tmp:
        job_file, result_file, out_file = (Path(tmp) / n for n in ("job", "result", "out"))
        job_file.write_text(job.to_json())
        t0 = time.perf_counter()
        with out_file.open("wb") as out:
            proc = subprocess.Popen(
                worker_command(job_file, result_file),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                process_group=0,  # its group: the compiler processes it starts stop with it
            )
            pause.attach(proc)
            log.info("compile worker started", pid=proc.pid, runners=job.runners)
            try:
                while not stop.wait(TICK_S):
                    pause.tick()  # stopped by the steps: on again once they pause
                    if pause.poll() is not None:
                        break
                else:
                    return "stopped: the server is shutting down"
            finally:
                pause.kill()  # still running (a shutdown, an error here): its whole group
        seconds = round(time.perf_counter() - t0, 3)
        if proc.returncode != 0 or not result_file.is_file():
            tail = out_file.read_bytes()[-LOG_TAIL_BYTES:].decode(errors="replace")
            return f"the compile worker exited with {proc.returncode} after {seconds} s: {tail}"
        result = json.loads(result_file.read_text())
    failed = {kind: buckets for kind, buckets in result["failed"].items() if buckets}
    log.info(
        "compile worker done",
        seconds=seconds,
        failed=failed,
        paused_s=round(pause.paused_s, 3),
        pauses=pause.pauses,
    )
    return f"buckets failed to compile: {failed}" if failed else None
