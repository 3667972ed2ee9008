"""The server's credentials from its settings: the token files, and the three access rules
(`access.AccessRules`) they and the identity allowlists make."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from executor.service.access import AccessRules, Rule, parse_identity_patterns
from executor.service.auth import CALL_RULE, CONFIG_RULE, KV_RULE, TokenCheck, TokenFile
from executor.service.server_config import ServerConfig

KV_OFF = (
    "the KV data plane is off on this executor: start it with --kv-transfer (and a KV "
    "credential: --kv-token-file or --allowed-kv-identities)"
)
OPERATOR_CLOSED = (
    "the operator calls (runtime config) are closed on this executor: it was started with "
    "no runtime_config_token_file and no allowed_operator_identities"
)


@dataclass(frozen=True)
class Credentials:
    rules: AccessRules
    call_token: TokenFile | None
    kv_token: TokenFile | None
    operator_token: TokenFile | None


def _file(path: str, setting: str) -> TokenFile | None:
    return TokenFile(path, setting) if path else None


def credentials_from(sc: ServerConfig) -> Credentials:
    call_token = _file(sc.call_token_file, "call_token_file")
    kv_token = _file(sc.kv_token_file, "kv_token_file")
    operator_token = _file(sc.runtime_config_token_file, "runtime_config_token_file")
    clients = parse_identity_patterns(sc.allowed_client_identities)
    call = Rule(
        "allowed_client_identities",
        clients,
        TokenCheck(call_token, operator_token, rule=CALL_RULE) if call_token else TokenCheck(),
    )
    if not sc.kv_transfer:
        kv = Rule("kv_transfer", closed=KV_OFF, closed_code=grpc.StatusCode.UNIMPLEMENTED)
    else:
        kv_ids = parse_identity_patterns(sc.allowed_kv_identities, "allowed_kv_identities")
        kv = Rule(
            "allowed_kv_identities" if kv_ids else call.name,
            kv_ids or clients,
            TokenCheck(kv_token, rule=KV_RULE) if kv_token else call.tokens,
        )
    operator_ids = parse_identity_patterns(
        sc.allowed_operator_identities, "allowed_operator_identities"
    )
    if operator_token is not None:
        operator = Rule(
            "allowed_operator_identities" if operator_ids else call.name,
            operator_ids or clients,
            TokenCheck(operator_token, rule=CONFIG_RULE),
        )
    elif operator_ids:
        operator = Rule("allowed_operator_identities", operator_ids, call.tokens)
    elif sc.operator_calls_open:  # development, on loopback (ServerConfig checks)
        operator = call
    else:
        operator = Rule("runtime_config_token_file", closed=OPERATOR_CLOSED)
    files = [f for f in (call_token, kv_token, operator_token) if f is not None]
    tenants = bool(sc.tls_client_ca_file) or any(f.named for f in files)
    return Credentials(
        AccessRules(call, kv, operator, tenants=tenants), call_token, kv_token, operator_token
    )
