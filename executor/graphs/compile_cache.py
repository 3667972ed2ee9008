"""Where compiled code lives: every compile cache under the executor's cache dir.

- `<cache_dir>/inductor`: inductor's caches (FX graphs, AOTAutograd, generated C++ and its
  shared objects), `TORCHINDUCTOR_CACHE_DIR`;
- `<cache_dir>/triton`: Triton's kernel cache (CUDA kernels), `TRITON_CACHE_DIR`;
- `<cache_dir>/graphs`: the whole compiled steps (`executor.graphs.artifacts`);
- `<cache_dir>/kernels`: the qmm kernel (`ops.qmm`).

Set before anything can create them (the executor's first act), so a restart on the same
cache dir loads what the last run compiled, and a fresh cache dir starts from nothing. The
variables are process-wide; a compile worker inherits them.

Inductor starts processes of its own even to load compiled code: once a process, per vector
ISA a C++ build and a Python process that loads it (the "probes"). Beside a CPU step such a
process takes a core the step's threads count on: a step took 2-5 times its length
(docs/performance.md). `probe_vec_isas` runs them while a compile worker compiles, in the
server's idle time, not at the load beside the steps.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

INDUCTOR_DIR = "inductor"
TRITON_DIR = "triton"


def use_compile_caches(cache_dir: Path) -> None:
    """Point inductor's and Triton's caches into `cache_dir` (overriding the environment's)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir.resolve() / INDUCTOR_DIR)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir.resolve() / TRITON_DIR)


def probe_vec_isas() -> None:
    """Inductor's probes of this CPU's vector ISAs (once a process), now: the background
    capture runs them while its compile worker compiles, not beside the steps of its load."""
    try:
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.valid_vec_isa_list()
    except Exception as e:  # an inductor without them: its compile or load probes as usual
        log.warning("vector ISA probes failed", error=f"{type(e).__name__}: {e}")
