"""`model-executor generate`'s per-request sampling controls: the flags and their parsing
(OpenAI / vLLM meanings; the executor checks the values and names the field it refuses)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from executor.client.cli_output import logprobs_mode
from executor.core.controls_types import SamplingControls
from executor.core.forward_batch import SamplingParams


def add_control_arguments(parser: argparse.ArgumentParser) -> None:
    ctl = parser.add_argument_group("sampling controls (OpenAI / vLLM meanings, per request)")
    ctl.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide positive logits (multiply negative ones) of every token already in the "
        "prompt or output by this (HF/vLLM); 1 = off",
    )
    ctl.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract this times a token's count in the output (OpenAI, -2..2)",
    )
    ctl.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtract this from every token already in the output (OpenAI, -2..2)",
    )
    ctl.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (OpenAI); repeatable",
    )
    ctl.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="no EOS (nor the request's stop ids) before this many new tokens (vLLM)",
    )
    ctl.add_argument("--ban-ids", metavar="ID,ID,...", help="token ids never sampled")
    ctl.add_argument(
        "--allow-ids", metavar="ID,ID,...", help="sample only these token ids (and EOS if listed)"
    )
    ctl.add_argument(
        "--json-schema",
        metavar="FILE",
        help="constrain the output to JSON that this JSON schema accepts (xgrammar; the "
        "request stops once the JSON is complete)",
    )


def _id_list(flag: str, text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected token ids as ID,ID,..., got {text!r}") from None


def _logit_bias(entries: Sequence[str]) -> tuple[tuple[int, float], ...]:
    bias: dict[int, float] = {}
    for entry in entries:
        token, sep, value = entry.partition("=")
        try:
            tid, b = int(token), float(value)
        except ValueError:
            raise ValueError(f"--logit-bias: expected ID=BIAS, got {entry!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias: expected ID=BIAS, got {entry!r}")
        if tid in bias:
            raise ValueError(f"--logit-bias: token {tid} is given twice")
        bias[tid] = b
    return tuple(sorted(bias.items()))


def sampling_controls(args: argparse.Namespace) -> SamplingControls | None:
    """The request controls `generate`'s flags ask for (OpenAI / vLLM meanings); None: none.
    Values are checked by the executor (INVALID_ARGUMENT names the field and its range)."""
    controls = SamplingControls(
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        logit_bias=_logit_bias(args.logit_bias),
        min_tokens=args.min_tokens,
        banned_token_ids=_id_list("--ban-ids", args.ban_ids),
        allowed_token_ids=_id_list("--allow-ids", args.allow_ids),
    )
    return None if controls.neutral else controls


def json_schema(path: str | None) -> str | None:
    """The text of `--json-schema FILE`, checked to be JSON."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
        json.loads(text)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--json-schema {path}: {exc}") from None
    return text


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The per-request sampling of `generate`'s flags (temperature, top-p/k, min-p, seed,
    logprobs mode)."""
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        logprobs_mode=logprobs_mode(args),
    )
