"""The rate-limited refusal log: one line per reason per interval, with a suppressed count."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from executor.batch_prep import make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.observability.log_limit import RateLimitedLog
from tests.server_util import running_server, tiny_config


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_reason_per_interval_with_the_suppressed_count() -> None:
    clock = _Clock()
    limited = RateLimitedLog(interval_s=10.0, clock=clock)
    with capture_logs() as logs:
        assert limited.info("a", "refused", reason="rule a")
        assert not any(limited.info("a", "refused") for _ in range(999))
        assert limited.warning("b", "refused")  # another reason has its own budget
        clock.now += 9.9
        assert not limited.info("a", "refused")
        clock.now += 0.2
        assert limited.info("a", "refused", reason="rule a")
        clock.now += 11
        assert limited.info("a", "refused")
    assert [line.get("suppressed", 0) for line in logs] == [0, 0, 1000, 0]
    assert logs[0]["reason"] == "rule a" and logs[1]["log_level"] == "warning"
    assert logs[2]["suppressed_interval_s"] == 10.0


def test_reasons_are_bounded_and_zero_interval_logs_everything() -> None:
    clock = _Clock()
    limited = RateLimitedLog(interval_s=10.0, max_reasons=2, clock=clock)
    with capture_logs() as logs:
        for key in ("a", "b", "c", "a"):  # "a" was forgotten when "c" came: written again
            limited.info(key, "refused")
    assert len(logs) == 4
    every = RateLimitedLog(interval_s=0)
    with capture_logs() as logs:
        for _ in range(5):
            every.info("a", "refused")
    assert len(logs) == 5
    with pytest.raises(ValueError, match="interval_s"):
        RateLimitedLog(interval_s=-1)


def test_a_burst_of_refused_batches_writes_one_line(tmp_path: Path) -> None:
    """A caller sending 50 bad batches (the same rule broken) gets 50 refusals and the log one
    line; the line names the rule and the caller."""
    bad = make_extend_batch(input_ids=[[1]], req_pool_indices=[10_000], out_cache_loc=[[1]])
    with (
        running_server(tiny_config(tmp_path), refusal_log_interval_s=60) as srv,
        capture_logs() as logs,
        ExecutorClient(f"127.0.0.1:{srv.port}") as c,
    ):
        for _ in range(50):
            with pytest.raises(grpc.RpcError) as err:
                c.forward(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    refused = [line for line in logs if line["event"] == "request refused"]
    assert len(refused) == 1
    assert "req_pool_indices" in refused[0]["reason"]
    assert refused[0]["peer"].startswith("ipv")
