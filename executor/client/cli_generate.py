"""`model-executor generate`: prompts -> text through the reference scheduler, on a running
executor (`--target`) or an embedded one; streaming, chat, overlap, speculation, sampling
controls, grammars, LoRA, logprobs, and disaggregated prefill (`--prefill-target`)."""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from typing import Any

from executor.client.cli_controls import (
    add_control_arguments,
    json_schema,
    sampling_controls,
    sampling_params,
)
from executor.client.cli_lora import add_generate_lora, prompt_loras
from executor.client.cli_output import add_output_arguments, check_output_arguments, print_results
from executor.client.cli_session import add_tls_arguments, prompt_texts, session
from executor.client.speculation import DEFAULT_NGRAM
from executor.config import ExecutorConfig
from executor.service import settings


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
        client, remote, tok = session(args, stack)
        texts = prompt_texts(args, tok, prompts)
        sampling = sampling_params(args)
        pipe = None
        if args.overlap:  # steps in flight on a ForwardStream, tokens fed back by reference
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
                routed_experts=args.routed_experts,
            )
            for t, lora in zip(texts, loras, strict=True)
        ]
        scheduler.run()
        if streaming:
            print()
        else:
            print_results(reqs, tok.decode, args, sys.stdout)
    return 0


def add_generate_command(sub: Any) -> None:
    """The `generate` subparser (`sub`: the CLI's subparsers)."""
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
    add_tls_arguments(gen)
    add_generate_lora(gen)
    gen.set_defaults(func=cmd_generate)
