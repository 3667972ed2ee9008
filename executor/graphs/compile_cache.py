"""Where compiled code lives: every compile cache under the executor's cache dir.

- `<cache_dir>/inductor`: inductor's caches (FX graphs, AOTAutograd, generated C++ and its
  shared objects), `TORCHINDUCTOR_CACHE_DIR`;
- `<cache_dir>/triton`: Triton's kernel cache (CUDA kernels), `TRITON_CACHE_DIR`;
- `<cache_dir>/graphs`: the whole compiled steps (`executor.graphs.artifacts`);
- `<cache_dir>/kernels`: the qmm kernel (`ops.qmm`).

Set before anything can create them (the executor's first act), so a restart on the same
cache dir loads what the last run compiled, and a fresh cache dir starts from nothing. The
variables are process-wide; a compile worker inherits them.
"""

from __future__ import annotations

import os
from pathlib import Path

INDUCTOR_DIR = "inductor"
TRITON_DIR = "triton"


def use_compile_caches(cache_dir: Path) -> None:
    """Point inductor's and Triton's caches into `cache_dir` (overriding the environment's)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir.resolve() / INDUCTOR_DIR)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir.resolve() / TRITON_DIR)
