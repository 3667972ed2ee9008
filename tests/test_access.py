"""Who may call: the client-identity allowlist (mTLS) and the bearer token on every call, both
checked before the request is decoded; the peer in logs and spans; the health port open."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.testing import capture_logs

from executor.batch_prep import make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.observability.peer import PeerBook, certificate_identities
from executor.service.access import parse_identity_patterns
from executor.service.server import RunningServer
from executor.service.server_config import ServerConfig
from executor.service.tls import channel_credentials
from tests.server_util import Scrape, running_server, tiny_config
from tests.tls_util import Issued, TestCA

FORWARD = "/model_executor.v1.ModelExecutor/Forward"
GARBAGE = b"\xff\xff\xff\xff not a protobuf"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("pki")
    ca = TestCA(d, "main")
    return {
        "ca": ca,
        "server": ca.issue("executor"),
        "scheduler": ca.issue("scheduler", client=True),
        "intruder": ca.issue("intruder", client=True),  # signed by the same CA: not allowed
        "token": d / "token",
    }


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def guarded(
    pki: dict[str, object],
    exporter: InMemorySpanExporter,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    server, ca, token = pki["server"], pki["ca"], pki["token"]
    assert isinstance(server, Issued) and isinstance(ca, TestCA) and isinstance(token, Path)
    token.write_text("call-s3cret\n")
    with running_server(
        tiny_config(tmp_path_factory.mktemp("cache")),
        span_exporter=exporter,
        tls_cert_file=str(server.cert_file),
        tls_key_file=str(server.key_file),
        tls_client_ca_file=str(ca.cert_file),
        allowed_client_identities="sched*, spiffe://cluster/ns/llm/sa/scheduler",
        call_token_file=str(token),
        health_port=0,
        refusal_log_interval_s=0,  # every refusal logged: the tests read the lines
    ) as running:
        yield running


def _client(
    pki: dict[str, object], srv: RunningServer, who: str, token: str | None
) -> ExecutorClient:
    ca, issued = pki["ca"], pki[who]
    assert isinstance(ca, TestCA) and isinstance(issued, Issued)
    creds = channel_credentials(str(ca.cert_file), str(issued.cert_file), str(issued.key_file))
    return ExecutorClient(f"localhost:{srv.port}", token=token, credentials=creds)


def _raw_forward(client: ExecutorClient, payload: bytes, token: str | None) -> grpc.RpcError:
    """Send `payload` as a Forward request's bytes (no protobuf encoding on our side)."""
    call = client.channel.unary_unary(FORWARD, request_serializer=None)
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with pytest.raises(grpc.RpcError) as err:
        call(payload, timeout=10, metadata=metadata)
    return err.value


def _batch(row: int) -> object:
    return make_extend_batch(
        input_ids=[[5, 6, 7]],
        req_pool_indices=[row],
        out_cache_loc=[[10 * row + i for i in (1, 2, 3)]],
    )


@pytest.mark.slow
def test_an_allowed_identity_with_the_token_is_served(
    pki: dict[str, object], guarded: RunningServer
) -> None:
    with _client(pki, guarded, "scheduler", "call-s3cret") as c:
        assert c.health() == "SERVING"
        assert c.info().info.vocab_size == 512
        assert c.forward(_batch(1)).next_token_ids.shape == (1,)  # type: ignore[arg-type]
        # bytes that do not parse, from an allowed caller: decoded, and refused as such
        err = _raw_forward(c, GARBAGE, "call-s3cret")
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ForwardRequest" in (err.details() or "")


def test_an_identity_off_the_allowlist_is_refused_before_decode(
    pki: dict[str, object], guarded: RunningServer
) -> None:
    """The intruder's certificate is valid (same CA) and it has the token: PERMISSION_DENIED
    on every method, and its undecodable bytes never reach the decoder (the same bytes are
    INVALID_ARGUMENT for an allowed caller). The message names the rule, not the list."""
    before = Scrape(guarded).get(
        "model_executor_requests_total", method="Forward", code="PERMISSION_DENIED"
    )
    with capture_logs() as logs, _client(pki, guarded, "intruder", "call-s3cret") as c:
        err = _raw_forward(c, GARBAGE, "call-s3cret")
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        details = err.details() or ""
        assert "allowed_client_identities" in details and "intruder" in details
        assert "sched" not in details and "spiffe" not in details  # the list stays private
        for call in (c.info, c.health, lambda: c.forward(_batch(2))):  # type: ignore[arg-type]
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as streamed:
            list(c.stream([_batch(2)]))  # type: ignore[list-item]
        assert streamed.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert guarded.servicer.worker is not None
    # Nothing of the intruder's reached the device: row 2 holds nothing.
    assert guarded.executor is not None
    assert int(guarded.executor.req_to_token_pool.resident_lens[2]) == 0
    refusals = [line for line in logs if line["event"] == "call refused"]
    assert refusals and all(line["code"] == "PERMISSION_DENIED" for line in refusals)
    assert refusals[0]["peer"].startswith("ipv")  # who it was: address and certificate names
    assert "intruder" in refusals[0]["peer_identity"]
    scrape = Scrape(guarded)
    after = scrape.get("model_executor_requests_total", method="Forward", code="PERMISSION_DENIED")
    assert after - before == 2  # the raw call and the unary forward, counted as refusals
    assert (
        scrape.get(
            "model_executor_requests_total", method="ForwardStream", code="PERMISSION_DENIED"
        )
        >= 1
    )


def test_every_call_needs_the_token(pki: dict[str, object], guarded: RunningServer) -> None:
    for token in (None, "wrong", "call-s3cre"):
        with _client(pki, guarded, "scheduler", token) as c:
            for call in (c.info, c.health, lambda c=c: c.forward(_batch(3))):  # type: ignore[misc]
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "call_token_file" in (err.value.details() or "")
            assert _raw_forward(c, GARBAGE, token).code() == grpc.StatusCode.UNAUTHENTICATED


def test_watch_streams_of_an_allowed_identity_hold_no_thread(
    pki: dict[str, object], guarded: RunningServer
) -> None:
    """With the identity check wrapping every method, health Watch keeps gRPC's non-blocking
    form: 24 Watch streams (more than the 16 handler threads) leave GetInfo answered."""
    with _client(pki, guarded, "scheduler", "call-s3cret") as c:
        stub = health_pb2_grpc.HealthStub(c.channel)
        watches = [
            stub.Watch(health_pb2.HealthCheckRequest(), metadata=c._auth, timeout=30)
            for _ in range(24)
        ]
        try:
            for w in watches:
                assert next(w).status == health_pb2.HealthCheckResponse.SERVING
            assert c.info(timeout=3).info.vocab_size == 512
        finally:
            for w in watches:
                w.cancel()


def test_the_health_port_needs_no_credentials(guarded: RunningServer) -> None:
    assert guarded.health_port is not None
    with ExecutorClient(f"127.0.0.1:{guarded.health_port}") as probe:  # plaintext, no token
        assert probe.health("", timeout=5.0) == "SERVING"
        assert probe.health(timeout=5.0) == "SERVING"


def test_spans_carry_the_peer_address_and_identity(
    pki: dict[str, object], guarded: RunningServer, exporter: InMemorySpanExporter
) -> None:
    exporter.clear()
    with _client(pki, guarded, "scheduler", "call-s3cret") as c:
        c.forward(_batch(4))  # type: ignore[arg-type]
    [span] = [s for s in exporter.get_finished_spans() if s.name.endswith("/Forward")]
    assert span.attributes is not None
    assert str(span.attributes["client.address"]).startswith("ipv")
    assert "scheduler" in tuple(span.attributes["model_executor.peer.identity"])  # type: ignore[arg-type]


def test_the_runtime_config_token_passes_the_call_check(tmp_path: Path) -> None:
    """The operator's token opens everything; the call token does not open the config RPCs."""
    (tmp_path / "call").write_text("call-s3cret")
    (tmp_path / "admin").write_text("admin-s3cret")
    with running_server(
        tiny_config(tmp_path),
        call_token_file=str(tmp_path / "call"),
        runtime_config_token_file=str(tmp_path / "admin"),
    ) as srv:
        target = f"127.0.0.1:{srv.port}"
        with ExecutorClient(target, token="admin-s3cret") as admin:
            assert admin.forward(_batch(1)).next_token_ids.shape == (1,)  # type: ignore[arg-type]
            assert admin.get_runtime_config() is not None
        with ExecutorClient(target, token="call-s3cret") as scheduler:
            assert scheduler.forward(_batch(2)).next_token_ids.shape == (1,)  # type: ignore[arg-type]
            with pytest.raises(grpc.RpcError) as err:
                scheduler.get_runtime_config()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "runtime config" in (err.value.details() or "")


def test_identity_settings_are_checked() -> None:
    assert parse_identity_patterns("") == ()
    assert parse_identity_patterns(" a , spiffe://x/* ,") == ("a", "spiffe://x/*")
    with pytest.raises(ValueError, match="holds no pattern"):
        parse_identity_patterns(" , ")
    with pytest.raises(ValueError, match="needs tls_client_ca_file"):
        ServerConfig(allowed_client_identities="scheduler")
    with pytest.raises(ValueError, match="refusal_log_interval_s"):
        ServerConfig(refusal_log_interval_s=-1)


def test_certificate_identities_read_sans_and_subject() -> None:
    auth = {
        "transport_security_type": [b"ssl"],
        "x509_common_name": [b"scheduler"],
        "x509_subject": [b"CN=scheduler,O=llm"],
        "x509_subject_alternative_name": [b"scheduler.llm.svc", b"spiffe://c/ns/llm/sa/s"],
        "x509_uri_subject_alternative_name": [b"spiffe://c/ns/llm/sa/s"],
        "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----..."],
    }
    assert certificate_identities(auth) == (
        "scheduler",
        "CN=scheduler,O=llm",
        "scheduler.llm.svc",
        "spiffe://c/ns/llm/sa/s",
    )


def test_each_new_connection_is_logged_once_with_its_identity(
    pki: dict[str, object], guarded: RunningServer
) -> None:
    with capture_logs() as logs, _client(pki, guarded, "scheduler", "call-s3cret") as c:
        for _ in range(3):
            c.info()
        c.forward(_batch(5))  # type: ignore[arg-type]
    [line] = [line for line in logs if line["event"] == "new peer"]
    assert line["peer"].startswith("ipv") and "scheduler" in line["peer_identity"]


def test_peer_book_forgets_the_oldest() -> None:
    book = PeerBook(capacity=2)
    assert book.first("a") and not book.first("a")
    assert book.first("b") and book.first("c")  # "a" forgotten
    assert book.first("a") and not book.first("c")


@pytest.mark.slow
def test_the_cli_sends_the_call_token_from_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from executor.client import cli

    (tmp_path / "call").write_text("call-s3cret\n")
    with running_server(tiny_config(tmp_path), call_token_file=str(tmp_path / "call")) as srv:
        target = ["--target", f"127.0.0.1:{srv.port}"]
        assert cli.main(["info", *target, "--token-file", str(tmp_path / "call")]) == 0
        assert '"readiness": "SERVING"' in capsys.readouterr().out
        with pytest.raises(grpc.RpcError) as err:
            cli.main(["info", *target, "--token-file", ""])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
