"""Where compiled code lives: every compile cache under the executor's cache dir.

- `<cache_dir>/inductor`: inductor's caches (FX graphs, AOTAutograd, generated C++ and its
  shared objects), `TORCHINDUCTOR_CACHE_DIR`;
- `<cache_dir>/triton`: Triton's kernel cache (CUDA kernels), `TRITON_CACHE_DIR`;
- `<cache_dir>/graphs`: the whole compiled steps (`executor.graphs.artifacts`);
- `<cache_dir>/kernels`: the qmm kernel (`ops.qmm`).

Set before anything can create them (the executor's first act), so a restart on the same
cache dir loads what the last run compiled, and a fresh cache dir starts from nothing. The
variables are process-wide; a compile worker inherits them.

A server that loads what a worker compiled keeps inductor's own processes away from its steps:
on a CPU such a process takes a core the step's threads count on, and a step took 2-5 times
its length (docs/performance.md). Inductor starts them even for a load: a preprocessor run and
a hash process to key its precompiled header (`loading_compiled` turns that off: a load finds
its shared objects by the code's key), and, once a process, per vector ISA a C++ build and a
Python process that loads it (`probe_vec_isas` runs those first, in the server's first idle
moments).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
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
    capture runs them first, while the server idles at start-up, not beside later steps."""
    try:
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.valid_vec_isa_list()
    except Exception as e:  # an inductor without them: its compile or load probes as usual
        log.warning("vector ISA probes failed", error=f"{type(e).__name__}: {e}")


@contextmanager
def loading_compiled() -> Iterator[None]:
    """Around this process's load of steps compiled elsewhere (a compile worker; a restart's
    cache dir): inductor precompiles no header (process-wide; nothing else in the server
    compiles meanwhile)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp_cache_precompile_headers": False}):
        yield
