"""The compile worker's process: builds an executor from a compile job's settings (its KV
cache allocated, never written), runs every bucket's compile phase (`ModelRunner.compile_only`:
nothing runs on the device) and exits. The job, its launcher and why a process of its own:
`executor.graphs.compile_job`.

    python -m executor.compile_worker JOB.json RESULT.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import structlog

from executor.graphs.compile_job import WORKER_NICE, CompileJob
from executor.parallel.parent_watch import die_with_parent
from ops import triton_off

log = structlog.get_logger(__name__)


def lower_priority() -> int:
    """Run this process at `WORKER_NICE` (inherited by the C++ compiler processes it
    starts); its niceness."""
    return os.nice(max(0, WORKER_NICE - os.nice(0)))


def run_job(job: CompileJob) -> dict[str, dict[int, str]]:
    """Build the executor and compile every bucket of the job's mode: the failed buckets."""
    triton_off.keep_out_on_cpu(job.config.device)  # before inductor imports dynamo
    import torch
    import torch._inductor.config as inductor_config

    from executor.model_executor import ModelExecutor

    torch.set_num_threads(1)  # nothing runs on the device here
    inductor_config.compile_threads = 1  # no pool of compile processes: one C++ compile at a time
    executor = ModelExecutor(job.config, compile_only=True)
    executor.runner.graph_factory.store_only = True  # a saved step is not loaded, only kept
    return executor.runner.compile_only(job.runners, needs_cpu_seq_lens=job.needs_cpu_seq_lens)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m executor.graphs.compile_worker JOB.json RESULT.json")
        return 2
    die_with_parent()  # a server that died (even killed) leaves no compile behind
    priority = lower_priority()
    job = CompileJob.from_json(Path(args[0]).read_text())
    t0 = time.perf_counter()
    log.info("compile worker started", runners=job.runners, nice=priority)
    failed = run_job(job)
    seconds = round(time.perf_counter() - t0, 3)
    Path(args[1]).write_text(json.dumps({"failed": failed, "seconds": seconds}))
    log.info("compile worker done", seconds=seconds, failed=failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
