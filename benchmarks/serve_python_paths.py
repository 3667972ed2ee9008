"""`python -m executor` with the host kernels off: every step takes the pure-Python paths of
admission and staging (`ops.host_kernels.disabled()`), as on a machine without a C compiler.

    python benchmarks/serve_python_paths.py serve --model tiny-random ...

`step_overhead.py --python-paths` serves one beside the usual executor to compare the two.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.client.cli import main
from ops import host_kernels

if __name__ == "__main__":
    with host_kernels.disabled():
        code = main()
    sys.exit(code)
