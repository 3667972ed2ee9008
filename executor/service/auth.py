"""The optional shared secret that guards the runtime-config RPCs.

When `runtime_config_token_file` is set, `GetRuntimeConfig` and `UpdateRuntimeConfig` need
the metadata `authorization: Bearer <token>` with the file's content (surrounding whitespace
ignored); anything else is UNAUTHENTICATED. Forward and GetInfo never need it.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class UnauthenticatedError(PermissionError):
    """The call lacks the right bearer token. Maps to UNAUTHENTICATED."""


def read_token(path: str) -> bytes | None:
    """The secret in `path`; None for "" (no secret). ValueError if it cannot be used."""
    if not path:
        return None
    try:
        token = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"runtime_config_token_file {path!r}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"runtime_config_token_file {path!r} is empty")
    return token


class TokenCheck:
    """Checks the bearer token of a call; every call passes when there is no secret."""

    def __init__(self, token: bytes | None) -> None:
        self._token = token

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
        # NOTE: compare_digest takes time independent of where the bytes differ.
        if not presented or not hmac.compare_digest(presented, self._token):
            raise UnauthenticatedError(
                "this server guards its runtime config with a token: send the metadata "
                "'authorization: Bearer <token>' (model-executor config --token-file)"
            )
