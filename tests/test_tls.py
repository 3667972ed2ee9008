"""TLS and mTLS on the gRPC port, the plaintext probe port, and certificate rotation on a live
server; certificates from throwaway CAs made at test time (tests/tls_util.py)."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from executor.batch_prep import make_extend_batch
from executor.client.cli import main as cli_main
from executor.client.grpc_client import ExecutorClient
from executor.service.server import RunningServer
from executor.service.server_config import ServerConfig
from executor.service.tls import channel_credentials, is_loopback
from tests.server_util import running_server, tiny_config
from tests.tls_util import Issued, TestCA, serial_of


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("pki")
    ca, other = TestCA(d, "main"), TestCA(d, "other")
    return {
        "ca": ca,
        "server": ca.issue("executor"),
        "client": ca.issue("scheduler", client=True),
        "stranger": other.issue("scheduler", client=True),
    }


def _batch(row: int) -> object:
    return make_extend_batch(
        input_ids=[[5, 6, 7]],
        req_pool_indices=[row],
        out_cache_loc=[[10 * row + i for i in (1, 2, 3)]],
    )


def _server_cert_serial(port: int, ca_file: Path) -> int:
    """The serial of the certificate a fresh TLS connection to `port` is shown."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
        ctx.wrap_socket(sock, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return serial_of(ssl.DER_cert_to_PEM_cert(der).encode())


@pytest.fixture(scope="module")
def tls_server(
    pki: dict[str, object], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    server = pki["server"]
    assert isinstance(server, Issued)
    with running_server(
        tiny_config(tmp_path_factory.mktemp("cache")),
        tls_cert_file=str(server.cert_file),
        tls_key_file=str(server.key_file),
        health_port=0,
    ) as running:
        yield running


def test_tls_end_to_end_and_probes_on_the_plaintext_health_port(
    pki: dict[str, object], tls_server: RunningServer
) -> None:
    ca = pki["ca"]
    assert isinstance(ca, TestCA)
    creds = channel_credentials(str(ca.cert_file))
    with ExecutorClient(f"localhost:{tls_server.port}", credentials=creds) as c:
        assert c.health() == "SERVING"
        out = c.forward(_batch(1))  # type: ignore[arg-type]
        assert out.next_token_ids.shape == (1,)
    # The probe port answers health in plaintext (what the kubelet's gRPC probe speaks) ...
    assert tls_server.health_port is not None
    with ExecutorClient(f"127.0.0.1:{tls_server.health_port}") as probe:
        assert probe.health() == "SERVING" and probe.health("") == "SERVING"
        # ... and nothing else: no batches travel in the clear.
        with pytest.raises(grpc.RpcError) as err:
            probe.forward(_batch(2))  # type: ignore[arg-type]
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_plaintext_client_cannot_talk_to_a_tls_port(tls_server: RunningServer) -> None:
    with ExecutorClient(f"127.0.0.1:{tls_server.port}") as c, pytest.raises(grpc.RpcError) as err:
        c.health(timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_does_not_trust_the_ca_is_refused(
    pki: dict[str, object], tls_server: RunningServer
) -> None:
    ca = pki["ca"]
    assert isinstance(ca, TestCA)
    creds = channel_credentials(str(TestCA(ca.directory, "untrusted").cert_file))
    with (
        ExecutorClient(f"localhost:{tls_server.port}", credentials=creds) as c,
        pytest.raises(grpc.RpcError) as err,
    ):
        c.health(timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_info_over_tls(
    pki: dict[str, object], tls_server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = pki["ca"]
    assert isinstance(ca, TestCA)
    code = cli_main(
        ["info", "--target", f"localhost:{tls_server.port}", "--tls-ca-file", str(ca.cert_file)]
    )
    assert code == 0
    assert '"readiness": "SERVING"' in capsys.readouterr().out


def test_mtls_refuses_clients_without_a_certificate_or_with_another_cas(
    pki: dict[str, object], tmp_path: Path
) -> None:
    ca, server, client, stranger = pki["ca"], pki["server"], pki["client"], pki["stranger"]
    assert isinstance(ca, TestCA) and isinstance(server, Issued)
    assert isinstance(client, Issued) and isinstance(stranger, Issued)
    with running_server(
        tiny_config(tmp_path),
        tls_cert_file=str(server.cert_file),
        tls_key_file=str(server.key_file),
        tls_client_ca_file=str(ca.cert_file),
    ) as srv:
        target = f"localhost:{srv.port}"
        good = channel_credentials(str(ca.cert_file), str(client.cert_file), str(client.key_file))
        with ExecutorClient(target, credentials=good) as c:
            assert c.forward(_batch(1)).next_token_ids.shape == (1,)  # type: ignore[arg-type]
        refused = {
            "no certificate": channel_credentials(str(ca.cert_file)),
            "another CA's certificate": channel_credentials(
                str(ca.cert_file), str(stranger.cert_file), str(stranger.key_file)
            ),
        }
        for why, creds in refused.items():
            with (
                ExecutorClient(target, credentials=creds) as c,
                pytest.raises(grpc.RpcError) as err,
            ):
                c.health(timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, why


def _install(issued: Issued, cert_file: Path, key_file: Path) -> None:
    """Replace the served files atomically (rename), as a Secret volume update does."""
    for src, dst in ((issued.key_file, key_file), (issued.cert_file, cert_file)):
        tmp = dst.with_suffix(".new")
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)


@pytest.mark.slow
def test_rotation_on_a_live_server_new_connections_see_the_new_cert_and_no_rpc_fails(
    pki: dict[str, object], tmp_path: Path
) -> None:
    ca = pki["ca"]
    assert isinstance(ca, TestCA)
    first, second = ca.issue("executor", stem="first"), ca.issue("executor", stem="second")
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(first, cert_file, key_file)
    with running_server(
        tiny_config(tmp_path / "cache"),
        tls_cert_file=str(cert_file),
        tls_key_file=str(key_file),
    ) as srv:
        assert _server_cert_serial(srv.port, ca.cert_file) == first.serial
        creds = channel_credentials(str(ca.cert_file))
        stop, errors, done = threading.Event(), [], [0]

        def keep_calling(row: int) -> None:
            # One long-lived connection and a fresh one per call, both through the rotation.
            with ExecutorClient(f"localhost:{srv.port}", credentials=creds) as kept:
                while not stop.is_set():
                    try:
                        kept.forward(_batch(row))  # type: ignore[arg-type]
                        with ExecutorClient(f"localhost:{srv.port}", credentials=creds) as fresh:
                            fresh.health()
                        done[0] += 1
                    except grpc.RpcError as exc:
                        errors.append(exc)

        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(keep_calling, row) for row in (1, 2)]
            time.sleep(0.5)
            _install(second, cert_file, key_file)
            deadline = time.monotonic() + 20
            while _server_cert_serial(srv.port, ca.cert_file) != second.serial:
                assert time.monotonic() < deadline, "the new certificate was never served"
                time.sleep(0.1)
            time.sleep(0.5)
            stop.set()
            for f in calls:
                f.result(timeout=60)
        assert errors == [] and done[0] > 0
        assert srv.certificates is not None and srv.certificates.reloads == 1


@dataclass
class Served:
    """A live server serving `issued` from files the test may rewrite."""

    server: RunningServer
    ca: TestCA
    issued: Issued
    cert_file: Path
    key_file: Path


@pytest.fixture
def served(pki: dict[str, object], tmp_path: Path) -> Iterator[Served]:
    ca, server = pki["ca"], pki["server"]
    assert isinstance(ca, TestCA) and isinstance(server, Issued)
    cert_file, key_file = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(server, cert_file, key_file)
    with running_server(
        tiny_config(tmp_path / "cache"), tls_cert_file=str(cert_file), tls_key_file=str(key_file)
    ) as srv:
        yield Served(srv, ca, server, cert_file, key_file)


def test_a_half_written_rotation_keeps_the_previous_certificate(served: Served) -> None:
    with capture_logs() as logs:
        served.cert_file.write_bytes(b"")  # cert-manager caught mid-write
        assert _server_cert_serial(served.server.port, served.ca.cert_file) == served.issued.serial
    assert any(line["event"].startswith("tls files unreadable") for line in logs)


@pytest.mark.slow
def test_plaintext_on_a_non_loopback_address_warns_once(tmp_path: Path) -> None:
    with capture_logs() as logs, running_server(tiny_config(tmp_path), host="0.0.0.0"):
        pass
    warnings = [line for line in logs if line["event"].startswith("plaintext gRPC")]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    with capture_logs() as logs, running_server(tiny_config(tmp_path)):  # loopback: no warning
        pass
    assert not [line for line in logs if line["event"].startswith("plaintext gRPC")]


def test_tls_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="go together"):
        ServerConfig(tls_cert_file="cert.pem")
    with pytest.raises(ValueError, match="needs tls_cert_file"):
        ServerConfig(tls_client_ca_file="ca.pem")
    with pytest.raises(ValueError, match="health_port"):
        ServerConfig(health_port=-2)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")


@pytest.mark.slow
def test_a_key_that_does_not_match_the_certificate_is_not_served(served: Served) -> None:
    port, ca_file = served.server.port, served.ca.cert_file
    newer = served.ca.issue("executor", stem="newer")
    served.key_file.write_bytes(newer.key_file.read_bytes())  # the key first, the cert not yet
    assert _server_cert_serial(port, ca_file) == served.issued.serial
    served.cert_file.write_bytes(newer.cert_file.read_bytes())
    assert _server_cert_serial(port, ca_file) == newer.serial
