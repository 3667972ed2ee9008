"""A CPU serving process never imports Triton (`ops.triton_off`): torch's dynamo
would, during a background compile or load, holding the interpreter lock while a step waits."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor.batch_prep import make_decode_batch, make_extend_batch
from tests.server_util import free_port, serve_command

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed: there is nothing to keep out",
)


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return done.stdout.strip()


@needs_triton
def test_kept_out_on_the_cpu_only_and_only_before_it_is_imported() -> None:
    # On the CPU: dynamo and inductor import without it, and torch sees no triton.
    assert (
        _run(
            "import sys; from ops.triton_off import keep_out_on_cpu as k\n"
            "assert not k('cuda') and not k('cuda:1') and 'triton' not in sys.modules\n"
            "assert k('cpu')\n"
            "import torch._dynamo, torch._inductor.codecache\n"
            "from torch.utils._triton import has_triton_package\n"
            "maps = open('/proc/self/maps').read()\n"
            "print(sys.modules['triton'], has_triton_package(), 'libtriton' in maps)"
        )
        == "None False False"
    )
    # Imported already (a library caller's process): it stays.
    assert (
        _run(
            "import triton, sys; from ops.triton_off import keep_out_on_cpu as k\n"
            "print(k('cpu'), sys.modules['triton'] is triton)"
        )
        == "False True"
    )


@needs_triton
def test_a_cpu_serve_traces_and_runs_its_compiled_step_without_triton(tmp_path: Path) -> None:
    """`serve` on the CPU with a whole-step graph traced at start-up (dynamo, whose import
    brings triton in wherever it is installed): no triton library is mapped in the server,
    and DECODE runs on the graph."""
    from executor.client.grpc_client import ExecutorClient

    port = free_port()
    cmd = serve_command(
        port, tmp_path / "cache", "--max-context-len", "64", "--graph-mode", "decode",
        "--graph-backend", "compiled_step", "--batch-invariant", "--graph-batch-sizes", "1",
    )  # fmt: skip
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        with ExecutorClient(f"127.0.0.1:{port}") as c:
            c.wait_ready(timeout=300)
            c.forward(
                make_extend_batch(
                    input_ids=[[5, 6, 7]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]]
                )
            )
            out = c.forward(
                make_decode_batch(
                    input_ids=[8], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[4]
                )
            )
            assert out.stats.path == "full_graph"
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            assert "torch/lib" in maps  # (the server's own mappings, read as they are)
            assert "libtriton" not in maps
    finally:
        proc.terminate()
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
        log.close()
