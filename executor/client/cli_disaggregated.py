"""`model-executor generate --prefill-target A --target B`: disaggregated generation."""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack

import grpc

from executor.client.cli_controls import sampling_params
from executor.client.cli_output import print_results
from executor.client.cli_session import connect, prompt_texts, session


def generate_disaggregated(
    args: argparse.Namespace, prompts: list[str], controls: object, schema: str | None
) -> int:
    """`generate --prefill-target A --target B`: each prompt prefilled on A, its KV pushed
    from A to B, decoded on B (client/disaggregated.py)."""
    from executor.client.disaggregated import DisaggregatedScheduler, TransferFailed

    if args.target is None:
        print("generate: --prefill-target needs --target (the decode executor)", file=sys.stderr)
        return 2
    if (
        args.overlap
        or args.speculate
        or controls is not None
        or schema is not None
        or args.lora_names
        or args.logprobs
    ):
        print(
            "generate: --prefill-target does not combine with --overlap, --speculate, "
            "sampling controls, --json-schema, --logprobs or --lora",
            file=sys.stderr,
        )
        return 2
    with ExitStack() as stack:
        decode, remote, tok = session(args, stack)
        prefill = stack.enter_context(connect(args, args.prefill_target))
        prefill.wait_ready(timeout=args.ready_timeout)
        texts = prompt_texts(args, tok, prompts)
        scheduler = DisaggregatedScheduler(
            prefill, decode, args.kv_peer_address or args.target, remote.info.eos_token_ids
        )
        sampling = sampling_params(args)
        reqs = [
            scheduler.add_request(
                tok.encode(t),
                max_new_tokens=args.max_new_tokens,
                sampling=sampling,
                ignore_eos=args.ignore_eos,
            )
            for t in texts
        ]
        try:
            scheduler.run()
        except TransferFailed as exc:
            print(f"model-executor: {exc}", file=sys.stderr)
            return 1
        except grpc.RpcError as exc:  # a refused push call (a missing KV credential, ...)
            print(f"model-executor: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        print_results(reqs, tok.decode, args, sys.stdout)
    return 0
