"""Transport security: server credentials that follow their files, and the client's credentials.

The server's certificate, key and (for mTLS) client CA are PEM files, typically a mounted
Kubernetes Secret that cert-manager rewrites before the certificate expires. They are served
through grpcio's dynamic credentials: gRPC asks `CertificateFiles.fetch` on each new
connection's handshake, which re-reads the files only when their stat (inode, size, mtime)
changed, so a rotation needs no restart and costs one `stat` per file per new connection.
Connections already open keep the certificate they were made with.

A rotation caught half-written (a file empty or unreadable, or a key that does not match the
certificate yet) keeps serving the previous certificate and logs a warning; the next handshake
tries again.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """Where the server's PEM files are; `client_ca_file` set = mTLS (client certs required)."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)

    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)


def _stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)  # follows the Secret volume's ..data symlink
    return st.st_ino, st.st_size, st.st_mtime_ns


def _read_pem(path: str, what: str) -> bytes:
    data = Path(path).read_bytes()
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} holds no PEM block")
    return data


def _check_pair(cert_file: str, key_file: str) -> None:
    """Raise ValueError unless the key belongs to the certificate: a rotation seen between
    writing the key and the certificate must not be served."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ValueError(f"tls_cert_file and tls_key_file do not form a pair: {exc}") from exc


class CertificateFiles:
    """The server's TLS material, re-read when its files change (the fetcher gRPC calls)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._stamps = self._current_stamps()
        self.initial = self._load()  # errors here are start-up errors: raised
        self.reloads = 0

    def _current_stamps(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(_stamp(p) for p in self.files.paths())

    def _load(self) -> grpc.ServerCertificateConfiguration:
        _check_pair(self.files.cert_file, self.files.key_file)
        key = _read_pem(self.files.key_file, "tls_key_file")
        cert = _read_pem(self.files.cert_file, "tls_cert_file")
        ca = (
            _read_pem(self.files.client_ca_file, "tls_client_ca_file")
            if self.files.mutual
            else None
        )
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when the files changed since the last load, else None.

        Called by gRPC on its own threads for each handshake: it never raises."""
        with self._lock:
            try:
                stamps = self._current_stamps()
                if stamps == self._stamps:
                    return None
                config = self._load()
                if self._current_stamps() != stamps:
                    # A rotation still in progress (the key and the certificate are replaced
                    # one after the other): keep serving the previous pair and load the
                    # settled files at a later handshake, so one rotation is one reload.
                    return None
            except (OSError, ValueError) as exc:
                log.warning(
                    "tls files unreadable; keeping the previous certificate", error=str(exc)
                )
                return None
            self._stamps = stamps
            self.reloads += 1
            log.info("tls certificate reloaded", files=list(self.files.paths()))
            return config

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch, require_client_authentication=self.files.mutual
        )


def channel_credentials(
    ca_file: str = "", cert_file: str = "", key_file: str = ""
) -> grpc.ChannelCredentials:
    """A client's TLS credentials: `ca_file` verifies the server ('' = the system roots);
    `cert_file` + `key_file` present a client certificate (mTLS)."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(ca_file, "tls_ca_file") if ca_file else None,
        private_key=_read_pem(key_file, "tls_key_file") if key_file else None,
        certificate_chain=_read_pem(cert_file, "tls_cert_file") if cert_file else None,
    )


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (localhost, 127/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
