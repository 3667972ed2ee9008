"""Runtime toggles: the executor's methods, the RPCs, refusals that change nothing, the token, the CLI."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import executor.observability.logs
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client import cli
from executor.client.grpc_client import ExecutorClient
from executor.core.errors import RuntimeConfigError, ToggleRefusedError
from executor.core.forward_batch import ForwardBatch
from executor.model_executor import ModelExecutor
from executor.service.auth import TokenCheck, TokenFile, read_token
from executor.service.runtime_config import RuntimeConfig, RuntimeConfigUpdate, parse_assignments
from executor.service.server import RunningServer
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.server_util import running_server, tiny_config

MakeExecutor = Callable[..., ModelExecutor]
DEFAULTS = RuntimeConfig(
    eager_input_no_copy=False,
    needs_cpu_seq_lens="auto",
    needs_cpu_seq_lens_effective=False,  # torch_paged reads no host lengths
    graph_mode="none",
    log_level="info",
    trace_sample_ratio=1.0,
)


def _decode_carries_mirror(ex: ModelExecutor, row: int) -> bool:
    """Whether a DECODE step's batch, as attention reads it, carries the host seq_lens."""
    seen: list[ForwardBatch] = []
    real = ex.attn_backend.init_forward_metadata
    ex.attn_backend.init_forward_metadata = lambda fb: seen.append(fb) or real(fb)  # type: ignore[method-assign]
    try:
        ex.forward(
            make_extend_batch(
                input_ids=[[1, 2]], req_pool_indices=[row], out_cache_loc=[[row * 10, row * 10 + 1]]
            )
        )
        ex.forward(
            make_decode_batch(
                input_ids=[3], req_pool_indices=[row], seq_lens=[3], out_cache_loc=[row * 10 + 2]
            )
        )
    finally:
        del ex.attn_backend.init_forward_metadata  # type: ignore[method-assign]
    return seen[-1].seq_lens_cpu is not None


# --- the executor's toggle methods (in-process) ---


def test_set_needs_cpu_seq_lens_reaches_the_batches(
    make_executor: MakeExecutor,
) -> None:
    ex = make_executor(attention_backend="torch_paged")
    assert _decode_carries_mirror(ex, 1) is False
    assert ex.control.set_needs_cpu_seq_lens("on") is True
    assert ex.toggles.needs_cpu_seq_lens is True and ex.runner.toggles.needs_cpu_seq_lens is True
    assert ex.toggles.seq_lens_policy == "on"
    assert _decode_carries_mirror(ex, 2) is True
    assert ex.control.set_needs_cpu_seq_lens("off") is False
    assert ex.runner.toggles.needs_cpu_seq_lens is False
    assert _decode_carries_mirror(ex, 3) is False


def test_off_is_refused_where_a_backend_reads_host_lengths(make_executor: MakeExecutor) -> None:
    ex = make_executor(attention_backend="torch_native")
    with pytest.raises(ToggleRefusedError, match="torch_native"):
        ex.control.set_needs_cpu_seq_lens("off")
    assert (ex.toggles.seq_lens_policy, ex.toggles.needs_cpu_seq_lens) == ("auto", True)
    assert ex.runner.toggles.needs_cpu_seq_lens is True


@pytest.mark.slow
def test_off_is_refused_with_the_piecewise_path(make_executor: MakeExecutor) -> None:
    ex = make_executor(attention_backend="torch_paged", graph_mode="extend")
    assert ex.toggles.needs_cpu_seq_lens is True
    with pytest.raises(ToggleRefusedError, match="piecewise"):
        ex.control.apply_toggles(needs_cpu_seq_lens="off")
    assert (ex.toggles.seq_lens_policy, ex.toggles.needs_cpu_seq_lens) == ("auto", True)


@pytest.mark.slow
def test_graph_mode_toggles_capture_on_first_use_and_report_it(make_executor: MakeExecutor) -> None:
    captures: list[tuple[str, bool]] = []

    class Recorder:
        def on_graph_capture(self, kind: str, seconds: float, ok: bool) -> None:
            captures.append((kind, ok))

        def on_graph_fallback(self, kind: str, reason: str) -> None:
            pass

    ex = make_executor(graph_batch_sizes="1,2", piecewise_token_sizes="8")
    ex.control.observer = Recorder()  # captures are reported by the graph control
    ex.control.apply_toggles(graph_mode="decode")
    assert (ex.toggles.graph_mode, ex.runner.toggles.graph_mode, captures) == (
        "decode",
        "decode",
        [("decode", True)],
    )
    ex.control.apply_toggles(
        graph_mode="both"
    )  # turning the piecewise path on re-decides the mirror
    assert captures[-1] == ("piecewise", True) and ex.toggles.needs_cpu_seq_lens is True
    native = make_executor(attention_backend="torch_native")
    with pytest.raises(ToggleRefusedError, match="cannot be captured"):
        native.control.apply_toggles(graph_mode="decode")
    assert native.toggles.graph_mode == "none"


def test_apply_toggles_is_all_or_nothing(make_executor: MakeExecutor) -> None:
    ex = make_executor(attention_backend="torch_native")
    with pytest.raises(ToggleRefusedError):
        ex.control.apply_toggles(eager_input_no_copy=True, needs_cpu_seq_lens="off")
    with pytest.raises(ToggleRefusedError):
        ex.control.apply_toggles(eager_input_no_copy=True, graph_mode="both")
    assert ex.toggles.eager_input_no_copy is False and ex.toggles.seq_lens_policy == "auto"
    ex.control.apply_toggles(eager_input_no_copy=True, needs_cpu_seq_lens="on")
    assert ex.toggles.eager_input_no_copy is True and ex.toggles.seq_lens_policy == "on"


def test_updates_check_their_values() -> None:
    for bad in (
        {"needs_cpu_seq_lens": "sometimes"},
        {"graph_mode": "all"},
        {"log_level": "loud"},
        {"trace_sample_ratio": 1.5},
        {"trace_sample_ratio": float("nan")},
    ):
        with pytest.raises(RuntimeConfigError):
            RuntimeConfigUpdate(**bad)  # type: ignore[arg-type]
    update = parse_assignments(
        ["eager_input_no_copy=true", "needs-cpu-seq-lens=ON", "trace_sample_ratio=0.25"]
    )
    assert update == RuntimeConfigUpdate(
        eager_input_no_copy=True, needs_cpu_seq_lens="on", trace_sample_ratio=0.25
    )
    for bad_pair in (
        "eager_input_no_copy",
        "colour=red",
        "eager_input_no_copy=maybe",
        "trace_sample_ratio=x",
    ):
        with pytest.raises(RuntimeConfigError):
            parse_assignments([bad_pair])


# --- the RPCs on a live server ---


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tiny_config(tmp_path_factory.mktemp("cache"))) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[ExecutorClient]:
    with ExecutorClient(f"127.0.0.1:{server.port}") as c:
        yield c
        c.update_runtime_config(
            RuntimeConfigUpdate(eager_input_no_copy=False, needs_cpu_seq_lens="auto")
        )


def test_get_and_get_info_report_the_effective_config(client: ExecutorClient) -> None:
    assert client.get_runtime_config() == DEFAULTS
    assert client.info().runtime_config == DEFAULTS


def test_an_update_changes_only_the_fields_it_sets(client: ExecutorClient) -> None:
    got = client.update_runtime_config(RuntimeConfigUpdate(eager_input_no_copy=True))
    assert got == RuntimeConfig(**{**DEFAULTS.__dict__, "eager_input_no_copy": True})
    got = client.update_runtime_config(RuntimeConfigUpdate(needs_cpu_seq_lens="on"))
    expected = {
        "eager_input_no_copy": True,
        "needs_cpu_seq_lens": "on",
        "needs_cpu_seq_lens_effective": True,
    }
    assert got == RuntimeConfig(**{**DEFAULTS.__dict__, **expected})
    assert client.get_runtime_config() == got
    assert client.info().runtime_config == got


def _raw_update(server: RunningServer, config: pb.RuntimeConfig) -> grpc.RpcError:
    with (
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        pytest.raises(grpc.RpcError) as err,
    ):
        pb_grpc.ModelExecutorStub(channel).UpdateRuntimeConfig(
            pb.UpdateRuntimeConfigRequest(config=config)
        )
    return err.value


@pytest.mark.parametrize(
    ("config", "code", "message"),
    [
        (
            pb.RuntimeConfig(
                graph_mode=pb.GRAPH_MODE_EXTEND, needs_cpu_seq_lens=pb.NEEDS_CPU_SEQ_LENS_OFF
            ),
            "FAILED_PRECONDITION",
            "piecewise",
        ),
        (
            pb.RuntimeConfig(
                eager_input_no_copy=True,
                graph_mode=pb.GRAPH_MODE_BOTH,
                needs_cpu_seq_lens=pb.NEEDS_CPU_SEQ_LENS_OFF,
            ),
            "FAILED_PRECONDITION",
            "piecewise",
        ),
        (
            pb.RuntimeConfig(eager_input_no_copy=True, log_level="loud"),
            "INVALID_ARGUMENT",
            "log_level",
        ),
        (pb.RuntimeConfig(trace_sample_ratio=2.0), "INVALID_ARGUMENT", "trace_sample_ratio"),
        (
            pb.RuntimeConfig(needs_cpu_seq_lens=pb.NEEDS_CPU_SEQ_LENS_UNSPECIFIED),
            "INVALID_ARGUMENT",
            "needs_cpu_seq_lens",
        ),
        (pb.RuntimeConfig(needs_cpu_seq_lens_effective=True), "INVALID_ARGUMENT", "output only"),
    ],
    ids=[
        "graph mode",
        "graph mode with another field",
        "log level",
        "ratio",
        "unspecified enum",
        "output field",
    ],
)
def test_refusals_change_nothing(
    server: RunningServer, client: ExecutorClient, config: pb.RuntimeConfig, code: str, message: str
) -> None:
    err = _raw_update(server, config)
    assert err.code().name == code and message in (err.details() or "")
    assert client.get_runtime_config() == DEFAULTS


def test_off_with_a_backend_that_needs_host_lengths_is_failed_precondition(tmp_path: Path) -> None:
    with (
        running_server(tiny_config(tmp_path, attention_backend="torch_native")) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as c,
    ):
        before = c.get_runtime_config()
        assert before.needs_cpu_seq_lens_effective is True
        with pytest.raises(grpc.RpcError) as err:
            c.update_runtime_config(
                RuntimeConfigUpdate(eager_input_no_copy=True, needs_cpu_seq_lens="off")
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "torch_native" in (err.value.details() or "")
        assert c.get_runtime_config() == before


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.01)


def test_a_change_waits_for_the_running_batch(
    server: RunningServer, client: ExecutorClient
) -> None:
    """Sent while a batch is on the device, the change applies after it, before the next."""
    assert server.worker is not None
    worker = server.worker
    gate = threading.Event()
    real_prepare = worker.executor.prepare

    def held(batch, clock):  # type: ignore[no-untyped-def]
        gate.wait(30)
        return real_prepare(batch, clock)

    worker.executor.prepare = held  # type: ignore[method-assign]
    try:
        results: dict[str, object] = {}
        first = make_extend_batch(
            input_ids=[[1, 2]], req_pool_indices=[9], out_cache_loc=[[90, 91]]
        )
        t1 = threading.Thread(target=lambda: results.__setitem__("batch", client.forward(first)))
        t1.start()
        _wait_until(lambda: not worker.depth and worker._in_flight > 0, "the batch on the device")
        update = RuntimeConfigUpdate(eager_input_no_copy=True)
        t2 = threading.Thread(
            target=lambda: results.__setitem__("config", client.update_runtime_config(update))
        )
        t2.start()
        _wait_until(lambda: worker.depth == 1, "the change queued behind the batch")
        assert client.get_runtime_config().eager_input_no_copy is False
        gate.set()
        t1.join(30)
        t2.join(30)
    finally:
        gate.set()
        worker.executor.prepare = real_prepare  # type: ignore[method-assign]
    assert results["batch"].stats.path == "eager"  # type: ignore[attr-defined]
    assert results["config"].eager_input_no_copy is True  # type: ignore[attr-defined]
    second = make_decode_batch(
        input_ids=[3], req_pool_indices=[9], seq_lens=[3], out_cache_loc=[92]
    )
    assert client.forward(second).stats.path == "eager_no_copy"


# --- the shared secret ---


def test_read_token(tmp_path: Path) -> None:
    assert read_token("") is None
    (tmp_path / "t").write_text("  s3cret\n")
    assert read_token(str(tmp_path / "t")) == b"s3cret"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="runtime_config_token_file"):
        read_token(str(tmp_path / "missing"))
    check = TokenCheck(TokenFile(str(tmp_path / "t"), "runtime_config_token_file"))
    check.check([("authorization", "Bearer s3cret")])
    check.check([("Authorization", "bearer  s3cret ")])


def test_the_token_guards_both_runtime_config_rpcs_and_nothing_else(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    config = tiny_config(tmp_path)
    with running_server(config, runtime_config_token_file=str(token_file)) as srv:
        target = f"127.0.0.1:{srv.port}"
        for token in (None, "wrong", "s3cre"):
            with ExecutorClient(target, token=token) as c:
                for call in (
                    c.get_runtime_config,
                    lambda c=c: c.update_runtime_config(
                        RuntimeConfigUpdate(eager_input_no_copy=True)
                    ),
                ):
                    with pytest.raises(grpc.RpcError) as err:
                        call()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                # GetInfo needs no token, but keeps the guarded runtime config to itself.
                assert c.info().info.vocab_size == 512 and c.info().runtime_config is None
                out = c.forward(
                    make_extend_batch(input_ids=[[1]], req_pool_indices=[1], out_cache_loc=[[1]])
                )
                assert out.next_token_ids.shape == (1,)  # neither does Forward
        with ExecutorClient(target, token="s3cret") as c:
            assert c.info().runtime_config is not None  # the token holder sees it there too
            assert (
                c.get_runtime_config().eager_input_no_copy is False
            )  # the refusals changed nothing
            assert c.update_runtime_config(
                RuntimeConfigUpdate(eager_input_no_copy=True)
            ).eager_input_no_copy


# --- the CLI ---


def _printed_json(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    """The CLI's JSON answer (the in-process server's own log lines may precede it)."""
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n") :])  # type: ignore[no-any-return]


def test_cli_config_get_and_set(
    server: RunningServer,
    client: ExecutorClient,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    target = ["--target", f"127.0.0.1:{server.port}"]
    assert cli.main(["config", "get", *target]) == 0
    assert _printed_json(capsys) == DEFAULTS.__dict__
    level = executor.observability.logs.current_level()
    try:
        assert (
            cli.main(["config", "set", "eager_input_no_copy=true", "log_level=warning", *target])
            == 0
        )
        out = _printed_json(capsys)
        assert out["eager_input_no_copy"] is True and out["log_level"] == "warning"
        assert client.get_runtime_config().eager_input_no_copy is True
    finally:
        client.update_runtime_config(RuntimeConfigUpdate(log_level=level))
    refused = ["config", "set", "graph_mode=extend", "needs_cpu_seq_lens=off", *target]
    assert cli.main(refused) == 1  # refused by the server: the piecewise path needs host lengths
    assert "FAILED_PRECONDITION" in capsys.readouterr().err
    assert cli.main(["config", "set", "colour=red", *target]) == 2  # refused before sending
    assert "colour=red" in capsys.readouterr().err
    assert cli.main(["config", "set", *target]) == 2
    assert client.get_runtime_config().graph_mode == "none"


def test_cli_sends_the_token_from_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    with running_server(tiny_config(tmp_path), runtime_config_token_file=str(token_file)) as srv:
        target = ["--target", f"127.0.0.1:{srv.port}"]
        assert cli.main(["config", "get", *target, "--token-file", ""]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert (
            cli.main(
                ["config", "set", "needs_cpu_seq_lens=on", *target, "--token-file", str(token_file)]
            )
            == 0
        )
        assert _printed_json(capsys)["needs_cpu_seq_lens_effective"] is True


def test_the_step_vocabulary_is_the_wire_and_metric_vocabulary() -> None:
    from executor.core.names import GraphMode, Path, SeqLensPolicy
    from executor.core.toggles import CaptureState, Toggles
    from executor.service import info_codec as codec

    assert [str(p) for p in Path] == [
        "eager",
        "eager_no_copy",
        "full_graph",
        "piecewise",
        "simulated",
    ]
    assert set(codec._GRAPH_MODE) == set(GraphMode)
    assert set(codec._NEEDS_CPU_SEQ_LENS) == set(SeqLensPolicy)
    assert [m for m in GraphMode if m.decode_graphs] == ["decode", "both"]
    assert [m for m in GraphMode if m.piecewise] == ["extend", "both"]
    t = Toggles(GraphMode.NONE, SeqLensPolicy.AUTO, False, eager_input_no_copy=False)
    assert t.graph_capture == "idle"
    t.capture, t.capture_target = CaptureState.CAPTURING, GraphMode.EXTEND
    assert t.graph_capture == "capturing graph_mode=extend"
    t.capture, t.capture_error = CaptureState.FAILED, "RuntimeError: boom"
    assert t.graph_capture == "failed: RuntimeError: boom"
