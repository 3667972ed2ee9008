"""Where PushKV may dial (`kv_peers`), and the few channels it keeps to those peers.

A target is dialed only when the allowlist names it; anything else is refused before a
channel exists (PERMISSION_DENIED), so the answer never tells what listens at a refused
address. Entries:
- `host:port` (a DNS name or an IP literal, `[::1]:port` for IPv6): exactly that peer;
- `*.domain:port`: any name under `domain` on that port (the pods of a headless Service);
- `CIDR:port` (`10.244.0.0/16:50051`, `[fd00::/8]:50051`): any IP literal in that network on
  that port (the pod network, where executors are dialed by pod IP);
- `unix:PATH` (or any other target gRPC understands): exactly that string, only if listed.
A target is compared after `dns:///` is dropped and the host lower-cased; a target with a
resolver authority (`dns://8.8.8.8/...`) or another scheme matches only a verbatim entry.

Under TLS the channel verifies the peer's certificate against `tls_client_ca_file` (never the
system roots) and against the host it dials (gRPC's host-name check), and presents this
server's own certificate. Channels are kept per peer, at most `capacity`, least recently used
closed first; a channel made before the TLS files changed (a renewal) is made again.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from executor.service.access import PermissionDeniedError
from executor.service.tls import TlsFiles, channel_credentials

_MAX_ECHO = 80  # characters of a refused target a message or log line repeats
MESSAGE_BYTES = 64 << 20  # a push channel's message limit (one KV chunk, with room)


def _echo(target: str) -> str:
    return target if len(target) <= _MAX_ECHO else target[:_MAX_ECHO] + "..."


def _host_port(target: str) -> tuple[str, int] | None:
    """(host, port) of `host:port` or `dns:///host:port`; None for anything else."""
    if target.startswith("dns:///"):
        target = target[len("dns:///") :]
    if "/" in target or "@" in target or target.count(":") == 0:
        return None
    host, _, port = target.rpartition(":")
    if host.startswith("["):  # IPv6 literal
        if not host.endswith("]"):
            return None
    elif ":" in host or not host:
        return None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return host.lower(), int(port)


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _network(entry: str) -> tuple[Network, int] | None:
    """(network, port) of `CIDR:port` / `[CIDR]:port`; None when `entry` is not one."""
    host, _, port = entry.rpartition(":")
    if "/" not in host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    try:
        return ipaddress.ip_network(host.strip("[]"), strict=False), int(port)
    except ValueError:
        return None


def _in_networks(host: str, port: int, networks: frozenset[tuple[Network, int]]) -> bool:
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return any(address in net and port == p for net, p in networks)


@dataclass(frozen=True)
class PeerList:
    exact: frozenset[tuple[str, int]]
    suffixes: frozenset[tuple[str, int]]  # (".domain", port)
    verbatim: frozenset[str]  # unix: and other targets, matched as written
    networks: frozenset[tuple[Network, int]] = frozenset()

    @classmethod
    def parse(cls, text: str) -> PeerList:
        exact, suffixes, verbatim, networks = set(), set(), set(), set()
        for entry in (e.strip() for e in text.split(",")):
            if not entry:
                continue
            net = _network(entry)
            if net is not None:
                networks.add(net)
                continue
            if entry.startswith("*."):
                hp = _host_port(entry[1:].lstrip("."))
                if hp is None:
                    raise ValueError(f"kv_peers: {entry!r} is not '*.domain:port'")
                suffixes.add(("." + hp[0], hp[1]))
                continue
            if "*" in entry:
                raise ValueError(f"kv_peers: {entry!r}: a wildcard is only '*.domain:port'")
            hp = _host_port(entry)
            if hp is not None:
                exact.add(hp)
            else:
                verbatim.add(entry)
        return cls(frozenset(exact), frozenset(suffixes), frozenset(verbatim), frozenset(networks))

    def __len__(self) -> int:
        return len(self.exact) + len(self.suffixes) + len(self.verbatim) + len(self.networks)

    def admit(self, target: str, field: str) -> str:
        """The target to dial; PermissionDeniedError (nothing dialed) when no entry names it."""
        if not len(self):
            raise PermissionDeniedError(
                f"{field}: this executor pushes to no peer (kv_peers is empty): PushKV is off"
            )
        if target in self.verbatim:
            return target
        hp = _host_port(target)
        if hp is not None:
            host, port = hp
            if (
                hp in self.exact
                or any(host.endswith(suffix) and port == p for suffix, p in self.suffixes)
                or _in_networks(host, port, self.networks)
            ):
                return f"{host}:{port}"
        raise PermissionDeniedError(
            f"{field}: {_echo(target)!r} is not one of this executor's kv_peers; it was not dialed"
        )


class PeerChannels:
    """The channels pushes use: one per peer, at most `capacity`, the least recently used
    closed first. `tls`: this server's TLS files (None: plaintext, as it serves)."""

    def __init__(self, peers: PeerList, tls: TlsFiles | None = None, capacity: int = 0) -> None:
        self.peers = peers
        self.tls = tls
        self.capacity = capacity or max(8, len(peers.exact) + len(peers.verbatim))
        self._lock = threading.Lock()
        self._channels: OrderedDict[str, tuple[grpc.Channel, tuple[int, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._channels)

    def _stamps(self) -> tuple[int, ...]:
        if self.tls is None:
            return ()
        out: list[int] = []
        for path in self.tls.paths():
            try:
                st = os.stat(path)
            except OSError:
                out.extend((0, 0))
                continue
            out.extend((st.st_ino, st.st_mtime_ns))
        return tuple(out)

    def channel(self, target: str) -> grpc.Channel:
        """The channel to `target` (admitted by the allowlist first)."""
        stamps = self._stamps()
        with self._lock:
            kept = self._channels.get(target)
            if kept is not None and kept[1] == stamps:
                self._channels.move_to_end(target)
                return kept[0]
            if kept is not None:  # the certificate was renewed: present the new one
                del self._channels[target]
                kept[0].close()
            options = [
                ("grpc.max_send_message_length", MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MESSAGE_BYTES),
            ]
            if self.tls is None:
                channel = grpc.insecure_channel(target, options=options)
            else:
                creds = channel_credentials(
                    self.tls.client_ca_file, self.tls.cert_file, self.tls.key_file
                )
                channel = grpc.secure_channel(target, creds, options=options)
            self._channels[target] = (channel, stamps)
            while len(self._channels) > self.capacity:
                _, (old, _) = self._channels.popitem(last=False)
                old.close()
            return channel

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()
