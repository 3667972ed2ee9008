"""The benchmarks' measuring logic on a few steps (their figures live in docs/performance.md)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import step_overhead
from executor.client.grpc_client import ExecutorClient
from tests.server_util import running_server, tiny_config


def test_step_overhead_splits_the_executor_overhead_and_times_a_bare_round_trip(
    cache_dir: Path,
) -> None:
    """Three bs-1 steps against an in-process executor and bare server: every step has a bare
    round trip, a model forward and an overhead whose parts add up to it."""
    config = tiny_config(cache_dir, graph_mode="none", max_reqs=4)
    bare_server, bare_port = step_overhead.start_bare_server()
    try:
        with (
            running_server(config) as running,
            ExecutorClient(f"127.0.0.1:{running.port}") as executor,
            ExecutorClient(f"127.0.0.1:{bare_port}") as bare,
        ):
            result = step_overhead.measure(executor, bare, bs=1, steps=3, warmup=1)
    finally:
        bare_server.stop(grace=None)

    assert result.bs == 1
    assert len(result.bare_us) == len(result.overhead_us) == len(result.model_us) == 3
    assert min(result.bare_us + result.model_us + result.client_codec_us) > 0
    assert {"queue", "validate", "stage", "sample", step_overhead.REST} <= result.phases_us.keys()
    for i, overhead in enumerate(result.overhead_us):
        parts = sum(values[i] for values in result.phases_us.values())
        assert parts == pytest.approx(overhead, abs=1e-3)
        assert result.phases_us[step_overhead.REST][i] > 0
    # The bare answer is the executor's size (a few bytes of timings' varints apart).
    assert abs(result.response_bytes - result.bare_response_bytes) <= 16
    assert result.request_bytes > 0
    assert math.isfinite(result.ratio) and result.ratio > 0
    table = step_overhead.table([result]).splitlines()
    assert table[0].startswith("| bs | bare round trip | executor overhead | ratio | target |")
    assert table[2].startswith("| 1 | ") and "| 1.5x |" in table[2]


def test_step_overhead_measures_a_baseline_executor_in_the_same_rotation(
    cache_dir: Path,
) -> None:
    """`--baseline-tree`: a second executor takes every measured request too, and the A/B
    table compares the two overheads."""
    config = tiny_config(cache_dir, graph_mode="none", max_reqs=4)
    bare_server, bare_port = step_overhead.start_bare_server()
    try:
        with (
            running_server(config) as running,
            running_server(config) as other,
            ExecutorClient(f"127.0.0.1:{running.port}") as executor,
            ExecutorClient(f"127.0.0.1:{other.port}") as baseline,
            ExecutorClient(f"127.0.0.1:{bare_port}") as bare,
        ):
            result = step_overhead.measure(
                executor, bare, bs=1, steps=3, warmup=1, baseline=baseline
            )
    finally:
        bare_server.stop(grace=None)

    assert len(result.baseline_us) == len(result.overhead_us) == len(result.bare_us) == 3
    assert min(result.baseline_us) > 0
    rows = step_overhead.baseline_table([result]).splitlines()
    assert rows[0].startswith("| bs | bare round trip | baseline overhead |")
    assert rows[2].startswith("| 1 | ") and "%)" in rows[2]
