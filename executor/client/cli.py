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
import json
import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from executor.client.cli_controls import (
    add_control_arguments,
    json_schema,
    sampling_controls,
    sampling_params,
)
from executor.client.cli_lora import add_generate_lora, add_lora_commands, prompt_loras
from executor.client.cli_output import add_output_arguments, check_output_arguments, print_results
from executor.client.cli_weights import add_weight_commands
from executor.client.speculation import DEFAULT_NGRAM
from executor.config import ExecutorConfig, resolve_cache_dir
from executor.observability.logs import configure_logging
from executor.service import settings
from executor.service.auth import read_token
from executor.service.runtime_config import parse_assignments
from executor.service.server_config import ServerConfig

if TYPE_CHECKING:
    from executor.client.grpc_client import ExecutorClient, RemoteInfo
    from executor.models.tokenizer import Tokenizer

DEFAULT_TARGET = "127.0.0.1:50051"


def _configs(args: argparse.Namespace) -> tuple[ExecutorConfig, ServerConfig]:
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


def cmd_serve(args: argparse.Namespace) -> int:
    from executor.service.server import serve

    executor_cfg, server_cfg = _configs(args)
    configure_logging(server_cfg.log_level, server_cfg.log_format)
    return serve(executor_cfg, server_cfg)


def _add_tls_arguments(parser: argparse.ArgumentParser) -> None:
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


def _client(args: argparse.Namespace, target: str, token: str | None = None) -> ExecutorClient:
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


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args, args.target) as client:
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
    with _client(args, args.target, token.decode() if token else None) as client:
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


def _session(
    args: argparse.Namespace, stack: ExitStack
) -> tuple[ExecutorClient, RemoteInfo, Tokenizer]:
    """A client of `args.target`, or of an embedded server on a free loopback port (stopped
    with `stack`), its GetInfo, and the model's tokenizer. Logs go to stderr."""
    from executor.models.loader import resolve_model_spec
    from executor.models.tokenizer import load_tokenizer
    from executor.service.server import start_server

    executor_cfg, server_cfg = _configs(args)
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
    client = stack.enter_context(_client(args, target))
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


def cmd_score(args: argparse.Namespace) -> int:
    """One JSON line per file: its token count, mean negative log-likelihood, perplexity."""
    with ExitStack() as stack:
        client, _, tok = _session(args, stack)
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
        client, _, tok = _session(args, stack)
        for text in texts:
            vector = client.embed(
                tok.encode(text, add_special_tokens=False),
                pooling=Pooling[args.pooling.upper()],
                layer=args.layer,
            )
            print(json.dumps({"text": text, "embedding": vector}))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from executor.client.scheduler import ReferenceScheduler, Request

    # stdout carries the generated text only; logs go to stderr.
    controls = sampling_controls(args)  # flags first: a bad one fails before any model loads
    schema = json_schema(args.json_schema)
    prompts = list(args.prompts) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("generate: give prompts as arguments or on stdin", file=sys.stderr)
        return 2
    if (conflict := check_output_arguments(args)) is not None:
        print(f"generate: {conflict}", file=sys.stderr)
        return 2
    loras = prompt_loras(args.lora_names, len(prompts))
    if args.prefill_target is not None:
        from executor.client.cli_disaggregated import generate_disaggregated

        return generate_disaggregated(args, prompts, controls, schema)
    with ExitStack() as stack:
        client, remote, tok = _session(args, stack)
        texts = prompts
        if args.chat:
            texts = []
            for p in prompts:
                messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                    {"role": "user", "content": p}
                ]
                texts.append(tok.apply_chat_template(messages))
        sampling = sampling_params(args)
        pipe = None
        if args.overlap:  # one step in flight on a ForwardStream, tokens fed back by reference
            pipe = client.open_stream()
            stack.callback(pipe.close)
        grammars = None
        if schema is not None:  # xgrammar is loaded only here
            from executor.client.grammar import Grammars

            grammars = Grammars(tok, remote.info.vocab_size)
        # Masks: inline in each unary batch; with --overlap, each follows its batch on the
        # stream (computed while the step runs).
        scheduler = ReferenceScheduler(
            client.retrying(),
            remote.info.limits,
            remote.info.eos_token_ids,
            overlap=args.overlap,
            pipe=pipe,
            grammars=grammars,
        )
        streaming = len(prompts) == 1 and sys.stdout.isatty() and not args.json
        printed = [""]

        def on_token(req: Request, token: int) -> None:  # incremental detokenization
            text = tok.decode(req.output_ids)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(printed[0]) :])
                sys.stdout.flush()
                printed[0] = text

        reqs = [
            scheduler.add_request(
                tok.encode(t),
                max_new_tokens=args.max_new_tokens,
                sampling=sampling,
                ignore_eos=args.ignore_eos,
                on_token=on_token if streaming else None,
                speculate=args.speculate,
                ngram=args.ngram,
                controls=controls,
                json_schema=schema,
                lora=lora,
                logprobs=args.logprobs,
            )
            for t, lora in zip(texts, loras, strict=True)
        ]
        scheduler.run()
        if streaming:
            print()
        else:
            print_results(reqs, tok.decode, args, sys.stdout)
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

    gen = sub.add_parser("generate", help="prompts -> text through the reference scheduler")
    gen.add_argument("prompts", nargs="*", help="prompts (default: one per line on stdin)")
    gen.add_argument(
        "--target",
        default=None,
        help="host:port of a running executor (default: start one in-process)",
    )
    gen.add_argument(
        "--prefill-target",
        default=None,
        metavar="HOST:PORT",
        help="disaggregated: prefill each prompt on this executor, push its KV to --target "
        "and decode there",
    )
    gen.add_argument(
        "--kv-peer-address",
        default=None,
        metavar="HOST:PORT",
        help="with --prefill-target: --target as the prefill executor reaches it (default: "
        "--target)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument(
        "--seed", dest="sampling_seed", type=int, default=None, help="per-request sampling seed"
    )
    gen.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the model's chat template"
    )
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the model's EOS tokens"
    )
    gen.add_argument(
        "--tokenizer",
        default=None,
        help="model spec whose tokenizer to use (default: the server's)",
    )
    gen.add_argument(
        "--overlap",
        action="store_true",
        help="overlap scheduling: send step N+1 over a ForwardStream before step N's tokens "
        "return (future-token references); same output",
    )
    gen.add_argument(
        "--speculate",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: K draft tokens per step by prompt lookup, verified in one "
        "step (greedy output unchanged; switched off per request while drafts are rarely "
        "accepted); 0 = off; not with --overlap",
    )
    gen.add_argument(
        "--ngram",
        type=int,
        default=DEFAULT_NGRAM,
        metavar="N",
        help="with --speculate: the n-gram size prompt lookup matches",
    )
    add_control_arguments(gen)
    add_output_arguments(gen)
    gen.add_argument("--ready-timeout", type=float, default=300.0)
    gen.add_argument("--log-level-generate", default="warning", help="log level on stderr")
    gen.add_argument("--config", help="TOML file for the embedded server")
    # --seed above is the requests' sampling seed (dest sampling_seed); the executor's own seed
    # keeps its default here.
    settings.add_arguments(gen, ExecutorConfig, exclude=frozenset({"seed", "lora"}))
    _add_tls_arguments(gen)
    add_generate_lora(gen)
    gen.set_defaults(func=cmd_generate)

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
        _add_tls_arguments(p)
    score.set_defaults(func=cmd_score)
    embed.set_defaults(func=cmd_embed)

    info = sub.add_parser("info", help="print a running executor's GetInfo as JSON")
    info.add_argument("--target", default=DEFAULT_TARGET)
    _add_tls_arguments(info)
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
    _add_tls_arguments(config)
    config.set_defaults(func=cmd_config)
    add_lora_commands(sub, _add_tls_arguments)
    add_weight_commands(sub, DEFAULT_TARGET, _add_tls_arguments, _client)
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


if __name__ == "__main__":
    sys.exit(main())
