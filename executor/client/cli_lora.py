"""The CLI's LoRA commands: `load-lora NAME PATH`, `unload-lora NAME` (operator calls: send
the runtime-config token with --token-file) and `generate --lora NAME[,NAME...]`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict

from executor.client.cli_session import connect


def add_lora_commands(
    sub: argparse._SubParsersAction,
    add_connection: Callable[[argparse.ArgumentParser], None],
) -> None:
    load = sub.add_parser(
        "load-lora", help="load a PEFT LoRA adapter into a running executor (operator call)"
    )
    load.add_argument("name", help="the adapter's name (what requests use)")
    load.add_argument("path", help="the adapter directory on the executor's filesystem")
    unload = sub.add_parser("unload-lora", help="unload an adapter (refused while rows use it)")
    unload.add_argument("name")
    for p in (load, unload):
        p.add_argument("--target", default="127.0.0.1:50051")
        add_connection(p)
        p.set_defaults(func=cmd_lora)


def add_generate_lora(gen: argparse.ArgumentParser) -> None:
    gen.add_argument(
        "--lora",
        dest="lora_names",  # not the executor setting `lora` (NAME=PATH: env or config file)
        default="",
        metavar="NAME[,NAME...]",
        help="LoRA adapter: one name for every prompt, or one entry per prompt (an empty entry "
        "is the base model); an in-process executor loads its adapters from "
        "MODEL_EXECUTOR_LORA or the config file's lora",
    )


def prompt_loras(text: str, prompts: int) -> list[str]:
    """`--lora`'s adapter per prompt; ValueError when a list does not match the prompts."""
    names = [n.strip() for n in text.split(",")] if text else [""]
    if len(names) == 1:
        return names * prompts
    if len(names) != prompts:
        raise ValueError(f"--lora lists {len(names)} adapters for {prompts} prompts")
    return names


def cmd_lora(args: argparse.Namespace) -> int:
    import grpc

    with connect(args, args.target) as client:
        try:
            if args.command == "load-lora":
                adapter = client.load_lora(args.name, args.path)
            else:
                adapter = client.unload_lora(args.name)
        except grpc.RpcError as exc:
            print(f"model-executor: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json.dumps(asdict(adapter)))
    return 0
