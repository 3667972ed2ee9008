"""Bearer tokens: the files that hold them, re-read when they change, and the check of a call.

A token file holds one credential per line (blank lines and `#` comments skipped): `TOKEN`, or
`NAME TOKEN`. A call passes when its metadata `authorization: Bearer <token>` equals one of
the lines' tokens; `NAME` is then the caller's identity, which the rows it starts are recorded
under (`executor.service.tenancy`); an unnamed token's callers share the identity "". Several
lines rotate a secret without a gap: add the new one, move the callers, drop the old one.

A file is re-read when its stat (inode, size, mtime) changes, checked at most once a second,
as `tls.py` re-reads certificates: a Kubernetes Secret rewritten in place takes effect
without a restart. A file caught empty or unreadable keeps the previous tokens (a warning).
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

RECHECK_S = 1.0  # the most often a token file's stat is read


class UnauthenticatedError(PermissionError):
    """The call lacks the right bearer token. Maps to UNAUTHENTICATED."""


@dataclass(frozen=True)
class Credential:
    name: str  # the caller's identity ("": unnamed)
    secret: bytes


def parse_tokens(text: bytes, where: str) -> tuple[Credential, ...]:
    """The credentials of a token file's bytes; ValueError when it holds none."""
    found: list[Credential] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ValueError(f"{where}: a line is 'TOKEN' or 'NAME TOKEN', got {len(parts)} words")
        name, secret = (b"", parts[0]) if len(parts) == 1 else (parts[0], parts[1])
        found.append(Credential(name.decode(errors="replace"), secret))
    if not found:
        raise ValueError(f"{where} is empty")
    return tuple(found)


def read_token(path: str, setting: str = "runtime_config_token_file") -> bytes | None:
    """The secret a client sends from `path` (its first line's token); None for "" (none).
    ValueError if it cannot be used."""
    if not path:
        return None
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ValueError(f"{setting} {path!r}: {exc.strerror}") from None
    return parse_tokens(data, f"{setting} {path!r}")[0].secret


class TokenFile:
    """One token file's credentials, re-read when the file changes."""

    def __init__(
        self, path: str, setting: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = str(Path(path).expanduser())
        self.setting = setting
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._credentials = self._read()  # errors here are start-up errors: raised
        self._checked = clock()
        self.reloads = 0

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)  # follows a Secret volume's ..data symlink
        except OSError as exc:
            raise ValueError(f"{self.setting} {self.path!r}: {exc.strerror}") from None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _read(self) -> tuple[Credential, ...]:
        try:
            data = Path(self.path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{self.setting} {self.path!r}: {exc.strerror}") from None
        return parse_tokens(data, f"{self.setting} {self.path!r}")

    @property
    def credentials(self) -> tuple[Credential, ...]:
        """The current credentials (the file is re-read when it changed)."""
        now = self._clock()
        if now - self._checked >= RECHECK_S:
            with self._lock:
                if now - self._checked >= RECHECK_S:
                    self._checked = now
                    self._reload()
        return self._credentials

    def _reload(self) -> None:
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return
            credentials = self._read()
        except ValueError as exc:
            log.warning("token file unreadable; keeping the previous tokens", error=str(exc))
            return
        self._stamp, self._credentials = stamp, credentials
        self.reloads += 1
        log.info("token file reloaded", setting=self.setting, tokens=len(credentials))

    @property
    def named(self) -> bool:
        """Whether any line names its caller (callers may then differ in identity)."""
        return any(c.name for c in self.credentials)

    def first(self) -> bytes:
        """The token this server sends when it calls a peer (the first line's)."""
        return self.credentials[0].secret


def bearer(metadata: Sequence[Any] | None) -> bytes:
    """The call's bearer token (b"" when it sends none)."""
    presented = b""
    for key, value in metadata or ():
        if str(key).lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, credential = text.strip().partition(" ")
            if scheme.lower() == "bearer":
                presented = credential.strip().encode()
    return presented


CONFIG_RULE = (
    "this server guards its runtime config with a token: send the metadata "
    "'authorization: Bearer <token>' (model-executor config --token-file)"
)
CALL_RULE = (
    "this server needs a bearer token on every call (rule: call_token_file): send the "
    "metadata 'authorization: Bearer <token>'"
)
KV_RULE = (
    "the KV data plane needs its own bearer token (rule: kv_token_file): send the metadata "
    "'authorization: Bearer <kv token>'"
)


class TokenCheck:
    """Checks the bearer token of a call against token files; every call passes when there
    is none. `check` returns the matched line's name (the caller's identity)."""

    def __init__(self, *files: TokenFile | None, rule: str = CONFIG_RULE) -> None:
        self.files = tuple(f for f in files if f is not None)
        self._rule = rule

    @property
    def enabled(self) -> bool:
        return bool(self.files)

    def check(self, metadata: Sequence[Any] | None) -> str:
        if not self.files:
            return ""
        presented = bearer(metadata)
        name: str | None = None
        # NOTE: compare_digest takes time independent of where the bytes differ; every token
        # is compared, so the time does not tell which one was close either.
        for credential in (c for f in self.files for c in f.credentials):
            if hmac.compare_digest(presented, credential.secret) and name is None:
                name = credential.name
        if not presented or name is None:
            raise UnauthenticatedError(self._rule)
        return name
