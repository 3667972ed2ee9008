"""The server's log lines: every one is JSON; lines about a step carry its batch and trace ids."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

import executor.observability.logs
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.observability.logs import configure_logging
from executor.service.codec import batch_to_proto
from executor.service.runtime_config import RuntimeConfigUpdate
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.server_util import running_server, tiny_config

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    """structlog writing JSON lines at debug level into a buffer; the old set-up restored."""
    saved, level = structlog.get_config(), executor.observability.logs._current_level
    buffer = io.StringIO()
    configure_logging("debug", "json", stream=buffer)
    try:
        yield buffer
    finally:
        structlog.configure(**saved)
        executor.observability.logs._current_level = level


def test_every_line_is_json_and_step_lines_carry_batch_and_trace_ids(
    json_logs: io.StringIO, tmp_path: Path
) -> None:
    metadata = [("traceparent", f"00-{TRACE_ID}-b7ad6b7169203331-01")]
    with running_server(tiny_config(tmp_path)) as srv:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.ModelExecutorStub(channel)
            prefill = make_extend_batch(
                input_ids=[[4, 5]], req_pool_indices=[3], out_cache_loc=[[7, 8]]
            )
            stub.Forward(
                pb.ForwardRequest(batch_id=101, batch=batch_to_proto(prefill)), metadata=metadata
            )
            decode = make_decode_batch(
                input_ids=[1], req_pool_indices=[3], seq_lens=[3], out_cache_loc=[9]
            )
            stub.Forward(
                pb.ForwardRequest(batch_id=102, batch=batch_to_proto(decode)), metadata=metadata
            )
            bad = make_decode_batch(
                input_ids=[1], req_pool_indices=[0], seq_lens=[3], out_cache_loc=[9]
            )
            with pytest.raises(grpc.RpcError):
                stub.Forward(
                    pb.ForwardRequest(batch_id=103, batch=batch_to_proto(bad)), metadata=metadata
                )
        with ExecutorClient(f"127.0.0.1:{srv.port}") as client:
            client.update_runtime_config(RuntimeConfigUpdate(eager_input_no_copy=True))
            client.update_runtime_config(RuntimeConfigUpdate(log_level="info"))
    lines: list[dict[str, Any]] = [json.loads(line) for line in json_logs.getvalue().splitlines()]
    assert len(lines) > 5
    for line in lines:
        assert {"timestamp", "level", "event"} <= set(line), line
    steps = [line for line in lines if line["event"] == "step"]
    assert [s["batch_id"] for s in steps] == [101, 102]
    assert all(s["trace_id"] == TRACE_ID and len(s["span_id"]) == 16 for s in steps)
    assert [s["mode"] for s in steps] == ["extend", "decode"]
    [refused] = [line for line in lines if line["event"] == "request refused"]
    assert refused["code"] == "INVALID_ARGUMENT" and refused["batch_id"] == 103
    assert refused["trace_id"] == TRACE_ID
    changes = [line for line in lines if line["event"] == "runtime config updated"]
    assert changes[0]["changed"] == {"eager_input_no_copy": [False, True]}
    assert changes[1]["changed"] == {"log_level": ["debug", "info"]}
    # After the level went to info, no more debug lines.
    after = lines[lines.index(changes[1]) + 1 :]
    assert after and all(line["level"] != "debug" for line in after)
