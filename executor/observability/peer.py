"""Who is on the other end of a call: its address and, under mTLS, its certificate's names.

Read from the call's `grpc.ServicerContext`: `peer()` ("ipv4:10.0.3.7:51234") and the auth
context, where gRPC puts the verified client certificate's subject and subject alternative
names. Logs carry them as `peer` / `peer_identity` (on refusals and failures, and a `new peer`
line for each new connection), spans as `client.address` / `model_executor.peer.identity`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import grpc

# Keys of grpc's auth context that name the client certificate's subject; SAN keys end in
# "subject_alternative_name" (newer grpcio adds typed ones: x509_uri_subject_alternative_name).
_SUBJECT_KEYS = ("x509_common_name", "x509_subject")


@dataclass(frozen=True)
class Peer:
    address: str  # as gRPC writes it: "ipv4:10.0.3.7:51234", "ipv6:[::1]:5000", "unix:..."
    identities: tuple[str, ...] = ()  # SANs, common name and subject of the client certificate

    def log_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"peer": self.address}
        if self.identities:
            fields["peer_identity"] = list(self.identities)
        return fields

    def span_attributes(self) -> dict[str, Any]:
        attributes: dict[str, Any] = {"client.address": self.address}
        if self.identities:
            attributes["model_executor.peer.identity"] = list(self.identities)
        return attributes


def certificate_identities(auth_context: dict[str, list[bytes]]) -> tuple[str, ...]:
    """The client certificate's names from grpc's auth context, deduplicated, in its order."""
    names: dict[str, None] = {}
    for key, values in auth_context.items():
        if key.endswith("subject_alternative_name") or key in _SUBJECT_KEYS:
            for value in values:
                names[value.decode(errors="replace")] = None
    return tuple(names)


def peer_of(context: grpc.ServicerContext, address: str | None = None) -> Peer:
    """The call's peer; identities only when the transport carries a client certificate.
    `address`: `context.peer()` read earlier (a call that already ended may not tell it)."""
    if address is None:
        address = context.peer()
    try:
        auth = context.auth_context()
    except Exception:  # the call ended (cancelled, gone): its address is all there is
        return Peer(address)
    identities = certificate_identities(auth) if auth.get("x509_pem_cert") else ()
    return Peer(address, identities)


class PeerBook:
    """The peer addresses seen lately (at most `capacity`, the oldest forgotten first): each
    new connection is logged once with its identity, not every call it makes."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, None] = OrderedDict()

    def first(self, address: str) -> bool:
        """True the first time `address` is seen (since it was last forgotten)."""
        with self._lock:
            if address in self._seen:
                self._seen.move_to_end(address)
                return False
            self._seen[address] = None
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
            return True
