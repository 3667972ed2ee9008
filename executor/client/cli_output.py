"""`model-executor generate`'s machine-readable output: `--json` (one JSON object per request
per line, in prompt order) and `--logprobs [--logprobs-mode raw|processed]` (each generated
token's logprob: the model's distribution, or the one the sampler drew from)."""

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


def logprobs_mode(args: argparse.Namespace) -> LogprobsMode:
    return LOGPROBS_MODES[getattr(args, "logprobs_mode", "raw")]


def check_output_arguments(args: argparse.Namespace) -> str | None:
    """A reason the output flags do not combine, or None."""
    if args.logprobs and not args.json:
        return "--logprobs needs --json (the logprobs go in each request's JSON object)"
    if args.logprobs_mode != "raw" and not args.logprobs:
        return "--logprobs-mode needs --logprobs"
    return None


def result_json(req: Request, text: str, *, logprobs: bool) -> str:
    """One request's line of `generate --json`."""
    obj: dict[str, object] = {
        "prompt_token_ids": req.prompt_ids,
        "token_ids": req.output_ids,
        "text": text,
        "finish_reason": req.finish_reason,
    }
    if logprobs:
        obj["logprobs"] = req.output_logprobs
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
            print(result_json(req, decode(req.output_ids), logprobs=args.logprobs), file=out)
            continue
        if len(reqs) > 1:
            print(f"--- [{i}] {req.finish_reason}", file=out)
        print(decode(req.output_ids), file=out)
