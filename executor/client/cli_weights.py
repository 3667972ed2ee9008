"""The weight and memory subcommands of `model-executor` (operator calls: --token-file holds
the runtime-config token):

    model-executor update-weights --target T --from PATH [--weight-version V]
    model-executor release-memory --target T [--tags weights kv_cache]
    model-executor resume-memory --target T [--tags ...] [--weights-from-update]

`update-weights` streams a local safetensors file, or a directory of them, over
UpdateWeights; each prints the answer as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from executor.weights.memory import TAGS


def add_weight_commands(
    sub: Any,
    default_target: str,
    add_tls: Callable[[argparse.ArgumentParser], None],
    client: Callable[..., Any],
) -> None:
    """Add the three subcommands to `sub` (the CLI's subparsers)."""
    update = sub.add_parser(
        "update-weights", help="stream a safetensors file or directory into a running executor"
    )
    update.add_argument(
        "--from", dest="source", required=True, help="a .safetensors file or directory"
    )
    update.add_argument("--weight-version", default="", help="what the weights are called after it")
    release = sub.add_parser("release-memory", help="give an executor's memory back by tag")
    resume = sub.add_parser("resume-memory", help="take an executor's released memory back")
    resume.add_argument(
        "--weights-from-update",
        action="store_true",
        help="leave the weights unset until an update instead of reloading the model file",
    )
    for p in (release, resume):
        p.add_argument("--tags", nargs="*", default=[], choices=TAGS, help="default: every tag")
    for p, run in ((update, _update), (release, _release), (resume, _resume)):
        p.add_argument("--target", default=default_target)
        add_tls(p)
        p.set_defaults(func=lambda args, run=run: _call(args, client, run))


def _call(args: argparse.Namespace, client: Callable[..., Any], run: Callable[..., Any]) -> int:
    import grpc

    with client(args, args.target) as c:
        try:
            answer = run(c.weights, args)
        except grpc.RpcError as exc:
            print(f"model-executor: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json.dumps(asdict(answer), indent=2))
    return 0


def _update(weights: Any, args: argparse.Namespace) -> Any:
    return weights.update_from_file(args.source, version=args.weight_version)


def _release(weights: Any, args: argparse.Namespace) -> Any:
    return weights.release(args.tags)


def _resume(weights: Any, args: argparse.Namespace) -> Any:
    return weights.resume(args.tags, from_update=args.weights_from_update)
