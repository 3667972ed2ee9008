"""Bearer tokens: the runtime-config secret, and the optional token of every call.

When `runtime_config_token_file` is set, `GetRuntimeConfig` and `UpdateRuntimeConfig` need
the metadata `authorization: Bearer <token>` with the file's content (surrounding whitespace
ignored); anything else is UNAUTHENTICATED. When `call_token_file` is set, every call needs
that token or the runtime-config one (`executor.service.access` checks it before decode).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class UnauthenticatedError(PermissionError):
    """The call lacks the right bearer token. Maps to UNAUTHENTICATED."""


def read_token(path: str, setting: str = "runtime_config_token_file") -> bytes | None:
    """The secret in `path`; None for "" (no secret). ValueError if it cannot be used."""
    if not path:
        return None
    try:
        token = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"{setting} {path!r}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"{setting} {path!r} is empty")
    return token


_CONFIG_RULE = (
    "this server guards its runtime config with a token: send the metadata "
    "'authorization: Bearer <token>' (model-executor config --token-file)"
)
CALL_RULE = (
    "this server needs a bearer token on every call (rule: call_token_file): send the "
    "metadata 'authorization: Bearer <token>'"
)


class TokenCheck:
    """Checks the bearer token of a call; every call passes when there is no secret.

    `also`: further tokens that pass (the runtime-config token passes the call check)."""

    def __init__(
        self, token: bytes | None, *, also: tuple[bytes | None, ...] = (), rule: str = _CONFIG_RULE
    ) -> None:
        self._token = token
        self._tokens = tuple(t for t in (token, *also) if t is not None) if token else ()
        self._rule = rule

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, metadata: Sequence[Any] | None) -> None:
        if self._token is None:
            return
        presented = b""
        for key, value in metadata or ():
            if str(key).lower() == "authorization":
                text = value.decode() if isinstance(value, bytes) else str(value)
                scheme, _, credential = text.strip().partition(" ")
                if scheme.lower() == "bearer":
                    presented = credential.strip().encode()
        # NOTE: compare_digest takes time independent of where the bytes differ; every token
        # is compared, so the time does not tell which one was close either.
        matches = [hmac.compare_digest(presented, token) for token in self._tokens]
        if not presented or not any(matches):
            raise UnauthenticatedError(self._rule)
