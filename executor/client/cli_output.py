"""`model-executor generate`'s machine-readable output: `--json` (one JSON object per request
per line, in prompt order) and `--logprobs [--logprobs-mode raw|processed]` (each generated
token's logprob: the model's distribution, or the one the sampler drew from), and
`--routed-experts` (an MoE model's top-k expert ids of every token it computed)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import TextIO

from executor.client.requests import Request
from executor.core.forward_batch import LogprobsMode

LOGPROBS_MODES = {"raw": LogprobsMode.RAW, "processed": LogprobsMode.PROCESSED}


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("output")
    out.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per request per line (prompt_token_ids, token_ids, text, "
        "finish_reason; logprobs with --logprobs) instead of the text",
    )
    out.add_argument(
        "--logprobs",
        action="store_true",
        help="ask for each generated token's logprob (with --json: the `logprobs` list)",
    )
    out.add_argument(
        "--logprobs-mode",
        choices=tuple(LOGPROBS_MODES),
        default="raw",
        help="raw: the model's distribution (log-softmax of its logits); processed: the one "
        "the sampler drew from (after controls, temperature, top-k/top-p/min-p, renormalized)",
    )
    out.add_argument(
        "--routed-experts",
        action="store_true",
        help="with --json, an MoE model: `routed_experts`, per token the model computed (the "
        "prompt, then each generated token but the last) per MoE layer "
        "(GetInfo.routed_expert_layers) its top-k expert ids",
    )


def logprobs_mode(args: argparse.Namespace) -> LogprobsMode:
    return LOGPROBS_MODES[getattr(args, "logprobs_mode", "raw")]


def check_output_arguments(args: argparse.Namespace) -> str | None:
    """A reason the output flags do not combine, or None."""
    if args.logprobs and not args.json:
        return "--logprobs needs --json (the logprobs go in each request's JSON object)"
    if args.logprobs_mode != "raw" and not args.logprobs:
        return "--logprobs-mode needs --logprobs"
    if args.routed_experts and not args.json:
        return "--routed-experts needs --json (the ids go in each request's JSON object)"
    if args.routed_experts and (args.speculate or args.overlap or args.prefill_target):
        return "--routed-experts does not combine with --speculate, --overlap or --prefill-target"
    return None


def result_json(req: Request, text: str, *, logprobs: bool, routed_experts: bool = False) -> str:
    """One request's line of `generate --json`."""
    obj: dict[str, object] = {
        "prompt_token_ids": req.prompt_ids,
        "token_ids": req.output_ids,
        "text": text,
        "finish_reason": req.finish_reason,
    }
    if logprobs:
        obj["logprobs"] = req.output_logprobs
    if routed_experts:
        obj["routed_experts"] = req.output_routed_experts
    return json.dumps(obj)


def print_results(
    reqs: Sequence[Request],
    decode: Callable[[list[int]], str],
    args: argparse.Namespace,
    out: TextIO,
) -> None:
    """The finished requests, in prompt order: JSON lines with --json, else their text."""
    for i, req in enumerate(reqs):
        if args.json:
            line = result_json(
                req,
                decode(req.output_ids),
                logprobs=args.logprobs,
                routed_experts=getattr(args, "routed_experts", False),
            )
            print(line, file=out)
            continue
        if len(reqs) > 1:
            print(f"--- [{i}] {req.finish_reason}", file=out)
        print(decode(req.output_ids), file=out)
