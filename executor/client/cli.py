"""`model-executor` (also `python -m executor`): serve, generate, info, config.

    model-executor serve --model smollm2 --port 50051
    model-executor generate "The capital of France is" --max-new-tokens 16
    model-executor generate --chat "Name three colours." --target 127.0.0.1:50051
    model-executor generate --speculate 4 "Rewrite: ..."   # prompt-lookup drafts, same output
    model-executor generate --json --logprobs --logprobs-mode processed --temperature 0.8 "Hi"
    model-executor generate "A user:" --json-schema user.json --repetition-penalty 1.1 \
        --logit-bias 13=-100 --min-tokens 4 --ban-ids 7,8
    model-executor info --target 127.0.0.1:50051
    model-executor config get --target 127.0.0.1:50051
    model-executor config set eager_input_no_copy=true log_level=debug --target 127.0.0.1:50051
    model-executor info --target executor:50051 --tls-ca-file ca.pem \
        --tls-cert-file client.pem --tls-key-file client-key.pem   # TLS / mTLS

Every ExecutorConfig / ServerConfig field is a flag and a MODEL_EXECUTOR_* environment
variable; `--config file.toml` supplies defaults ([executor] and [server] tables).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict
from typing import Any

from executor.client.cli_generate import add_generate_command
from executor.client.cli_lora import add_lora_commands
from executor.client.cli_session import (
    DEFAULT_TARGET,
    add_tls_arguments,
    configs,
    connect,
    session,
)
from executor.client.cli_weights import add_weight_commands
from executor.config import ExecutorConfig
from executor.observability.logs import configure_logging
from executor.service import settings
from executor.service.auth import read_token
from executor.service.runtime_config import parse_assignments
from executor.service.server_config import ServerConfig


def cmd_serve(args: argparse.Namespace) -> int:
    from executor.service.server import serve

    executor_cfg, server_cfg = configs(args)
    configure_logging(server_cfg.log_level, server_cfg.log_format)
    return serve(executor_cfg, server_cfg)


def cmd_info(args: argparse.Namespace) -> int:
    with connect(args, args.target) as client:
        remote = client.info()
        info = asdict(remote.info)
        info["model_spec"] = remote.model_spec
        info["readiness"] = client.health()
        if remote.info.kv_layout is not None:  # its dtype as the wire names it
            info["kv_layout"]["dtype"] = str(remote.info.kv_layout.dtype).removeprefix("torch.")
        print(json.dumps(info, indent=2))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    import grpc

    if args.action == "set" and not args.assignments:
        raise ValueError("config set: give at least one key=value")
    if args.action == "get" and args.assignments:
        raise ValueError("config get takes no key=value")
    update = parse_assignments(args.assignments) if args.action == "set" else None
    token = read_token(args.token_file)
    with connect(args, args.target, token.decode() if token else None) as client:
        try:
            if update is None:
                config = client.get_runtime_config()
            else:
                config = client.update_runtime_config(update)
        except grpc.RpcError as exc:
            print(f"model-executor: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json.dumps(asdict(config), indent=2))
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    """One JSON line per file: its token count, mean negative log-likelihood, perplexity."""
    with ExitStack() as stack:
        client, _, tok = session(args, stack)
        for path in args.files:
            with open(path, encoding="utf-8") as f:
                tokens = tok.encode(f.read(), add_special_tokens=False)
            result = client.score(tokens)
            print(json.dumps({"file": path, **result.summary(per_token=args.per_token)}))
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    """One JSON line per text: its pooled embedding."""
    from executor.core.extras_types import Pooling

    texts = list(args.texts) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    with ExitStack() as stack:
        client, _, tok = session(args, stack)
        for text in texts:
            vector = client.embed(
                tok.encode(text, add_special_tokens=False),
                pooling=Pooling[args.pooling.upper()],
                layer=args.layer,
            )
            print(json.dumps({"text": text, "embedding": vector}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="model-executor", description="A remote model executor for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gRPC server")
    serve.add_argument(
        "--config", help="TOML file with [executor] and [server] tables (env MODEL_EXECUTOR_CONFIG)"
    )
    settings.add_arguments(serve, ExecutorConfig)
    settings.add_arguments(serve, ServerConfig)
    serve.set_defaults(func=cmd_serve)

    add_generate_command(sub)

    score = sub.add_parser(
        "score", help="files -> one JSON line each: tokens, mean NLL and perplexity of the text"
    )
    score.add_argument("files", nargs="+", help="text files (tokenized without special tokens)")
    score.add_argument("--per-token", action="store_true", help="add each token's logprob")
    embed = sub.add_parser("embed", help="texts -> one JSON line each: the pooled embedding")
    embed.add_argument("texts", nargs="*", help="texts (default: one per line on stdin)")
    embed.add_argument("--pooling", choices=("mean", "last"), default="mean")
    embed.add_argument(
        "--layer", type=int, default=None, help="hidden state index (default: the final one)"
    )
    for p in (score, embed):
        p.add_argument(
            "--target",
            default=None,
            help="host:port of a running executor (default: start one in-process)",
        )
        p.add_argument("--tokenizer", default=None, help="model spec whose tokenizer to use")
        p.add_argument("--ready-timeout", type=float, default=300.0)
        p.add_argument("--log-level-generate", default="warning", help="log level on stderr")
        p.add_argument("--config", help="TOML file for the embedded server")
        settings.add_arguments(p, ExecutorConfig)
        add_tls_arguments(p)
    score.set_defaults(func=cmd_score)
    embed.set_defaults(func=cmd_embed)

    info = sub.add_parser("info", help="print a running executor's GetInfo as JSON")
    info.add_argument("--target", default=DEFAULT_TARGET)
    add_tls_arguments(info)
    info.set_defaults(func=cmd_info)

    config = sub.add_parser("config", help="read or change a running executor's runtime toggles")
    config.add_argument("action", choices=("get", "set"))
    config.add_argument(
        "assignments",
        nargs="*",
        metavar="key=value",
        help="with set: eager_input_no_copy=true|false, needs_cpu_seq_lens=auto|on|off, "
        "graph_mode=none|decode|extend|both, log_level=debug|info|warning|error, "
        "trace_sample_ratio=0..1",
    )
    config.add_argument("--target", default=DEFAULT_TARGET)
    add_tls_arguments(config)
    config.set_defaults(func=cmd_config)
    add_lora_commands(sub, add_tls_arguments)
    add_weight_commands(sub, DEFAULT_TARGET, add_tls_arguments, connect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None and "MODEL_EXECUTOR_CONFIG" in os.environ:
        args.config = os.environ["MODEL_EXECUTOR_CONFIG"]
    try:
        code: Any = args.func(args)
    except ValueError as exc:  # configuration and input errors: one clear line, no traceback
        print(f"model-executor: error: {exc}", file=sys.stderr)
        return 2
    return int(code)


def run() -> None:
    """The process's entry (the console script, `python -m executor`): `main`, then the exit
    without the interpreter's teardown. With torch loaded, the teardown (every module's
    objects freed, the last collections) is slow, and the answer is out before it; what a
    process's exit owes is done here: the threads that are not daemons joined, the `atexit`
    functions run (logging's flush among them), the standard streams flushed."""
    code = main()
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # (CPython's own exit runs them the same way)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a closed pipe (`| head`): the interpreter's own exit code for it
            code = 120
    os._exit(code)


if __name__ == "__main__":
    run()
