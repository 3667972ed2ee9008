"""What the client subcommands share: the server and executor settings from flags,
environment and file, a client's TLS and token flags, a connected client, and a session (a
client of `--target`, or of an embedded server started on a free loopback port)."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING

from executor.config import ExecutorConfig, resolve_cache_dir
from executor.observability.logs import configure_logging
from executor.service import settings
from executor.service.auth import read_token
from executor.service.server_config import ServerConfig

if TYPE_CHECKING:
    from executor.client.grpc_client import ExecutorClient, RemoteInfo
    from executor.models.tokenizer import Tokenizer

DEFAULT_TARGET = "127.0.0.1:50051"


def configs(args: argparse.Namespace) -> tuple[ExecutorConfig, ServerConfig]:
    values = vars(args)
    file_values = settings.load_file(values.get("config"))
    env = dict(os.environ)
    executor_cfg = settings.build(
        ExecutorConfig, args=values, env=env, file_values=file_values.get("executor", {})
    )
    server_cfg = settings.build(
        ServerConfig, args=values, env=env, file_values=file_values.get("server", {})
    )
    return executor_cfg, server_cfg


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """A client's TLS flags: for a server started with --tls-cert-file (and mTLS)."""
    group = parser.add_argument_group("TLS and credentials (for a guarded server)")
    group.add_argument(
        "--tls-ca-file",
        dest="client_tls_ca_file",
        default=None,
        help="PEM CA bundle that signed the server's certificate; turns TLS on "
        "(default: plaintext, or the system roots when a client certificate is given)",
    )
    # dest names that are no ServerConfig field: `generate` builds one from the same namespace.
    group.add_argument(
        "--tls-cert-file",
        dest="client_tls_cert_file",
        default=None,
        help="PEM client certificate (mTLS)",
    )
    group.add_argument(
        "--tls-key-file",
        dest="client_tls_key_file",
        default=None,
        help="PEM key of --tls-cert-file",
    )
    group.add_argument(
        "--kv-token-file",
        dest="client_kv_token_file",
        default="",
        help="file with the KV data plane's bearer token (the server's kv_token_file), sent "
        "on KV calls in place of --token-file's (generate --prefill-target's pushes)",
    )
    group.add_argument(
        "--token-file",
        default=os.environ.get("MODEL_EXECUTOR_RUNTIME_CONFIG_TOKEN_FILE", ""),
        help="file with a bearer token sent on every call: the server's call_token_file, or "
        "its runtime-config secret (needed by `config`; default: env "
        "MODEL_EXECUTOR_RUNTIME_CONFIG_TOKEN_FILE)",
    )


def connect(args: argparse.Namespace, target: str, token: str | None = None) -> ExecutorClient:
    from executor.client.grpc_client import ExecutorClient
    from executor.service.tls import channel_credentials

    ca, cert, key = args.client_tls_ca_file, args.client_tls_cert_file, args.client_tls_key_file
    credentials = (
        channel_credentials(ca or "", cert or "", key or "") if (ca or cert or key) else None
    )
    if token is None:
        secret = read_token(args.token_file, "--token-file")
        token = secret.decode() if secret else None
    kv_secret = read_token(getattr(args, "client_kv_token_file", ""), "--kv-token-file")
    return ExecutorClient(
        target,
        token=token,
        kv_token=kv_secret.decode() if kv_secret else None,
        credentials=credentials,
    )


def session(
    args: argparse.Namespace, stack: ExitStack
) -> tuple[ExecutorClient, RemoteInfo, Tokenizer]:
    """A client of `args.target`, or of an embedded server on a free loopback port (stopped
    with `stack`), its GetInfo, and the model's tokenizer. Logs go to stderr."""
    from executor.models.loader import resolve_model_spec
    from executor.models.tokenizer import load_tokenizer
    from executor.service.server import start_server

    executor_cfg, server_cfg = configs(args)
    configure_logging(
        args.log_level_generate, "console" if sys.stderr.isatty() else "json", stream=sys.stderr
    )
    target = args.target
    if target is None:
        running = start_server(
            executor_cfg,
            ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, log_level=server_cfg.log_level),
        )
        stack.callback(running.drain)
        running.wait_ready(timeout=args.ready_timeout)  # raises if the model failed to load
        target = f"127.0.0.1:{running.port}"
    client = stack.enter_context(connect(args, target))
    client.wait_ready(timeout=args.ready_timeout)
    remote = client.info()
    tok = load_tokenizer(
        resolve_model_spec(args.tokenizer or remote.model_spec),
        remote.info.vocab_size,
        remote.info.bos_token_id,
        remote.info.eos_token_ids,
        resolve_cache_dir(executor_cfg),
    )
    return client, remote, tok


def prompt_texts(args: argparse.Namespace, tok: Tokenizer, prompts: list[str]) -> list[str]:
    """The prompts as sent: each wrapped in the model's chat template with `--chat` (after
    the `--system` message, if any), else as given."""
    if not args.chat:
        return prompts
    system = [{"role": "system", "content": args.system}] if args.system else []
    return [tok.apply_chat_template([*system, {"role": "user", "content": p}]) for p in prompts]
