"""Build frozen config dataclasses from CLI flags > MODEL_EXECUTOR_* environment > TOML file > defaults.

Flags and environment variables are derived from the dataclass fields, so every field of
`ExecutorConfig` and `ServerConfig` is settable all three ways without a second list:
field `kv_slots` is `--kv-slots` and `MODEL_EXECUTOR_KV_SLOTS`. A field's help text lives
in its metadata (`field(metadata={"help": ...})`). The environment is read when a config is
built, never at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "MODEL_EXECUTOR_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

T = TypeVar("T")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _field_type(f: dataclasses.Field[Any]) -> type:
    default = f.default if f.default is not dataclasses.MISSING else None
    return type(default) if default is not None else str


def parse_value(f: dataclasses.Field[Any], raw: str, source: str) -> Any:
    kind = _field_type(f)
    if kind is bool:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{source}: expected a boolean (1/0, true/false), got {raw!r}")
    try:
        return kind(raw)
    except ValueError as e:
        raise ValueError(f"{source}: expected {kind.__name__}, got {raw!r}") from e


def add_arguments(
    parser: argparse.ArgumentParser, cls: type, exclude: frozenset[str] = frozenset()
) -> None:
    """One flag per field; unset flags stay absent (SUPPRESS) so precedence can tell."""
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{help_text} (env {env_name(f.name)}; default {default!r})".strip()
        if f.metadata.get("repeat"):
            group.add_argument(
                flag_name(f.name),
                action="append",
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=help_text,
            )
        elif _field_type(f) is bool:
            group.add_argument(
                flag_name(f.name),
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            group.add_argument(
                flag_name(f.name),
                type=str,
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=help_text,
            )


def load_file(path: str | Path | None) -> dict[str, Any]:
    """A TOML file with optional [executor] and [server] tables (or flat keys)."""
    if not path:
        return {}
    with Path(path).open("rb") as fh:
        return tomllib.load(fh)


def build(
    cls: type[T],
    *,
    args: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
) -> T:
    """`cls(**values)` with each field from args, then env, then file, then its default."""
    args = args or {}
    env = env or {}
    file_values = file_values or {}
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(file_values) - known
    if unknown:
        raise ValueError(f"config file: unknown keys {sorted(unknown)} for {cls.__name__}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in args:
            raw = args[f.name]
            if isinstance(raw, list):  # a repeated flag: its values, comma-separated
                raw = ",".join(str(v) for v in raw)
            values[f.name] = parse_value(f, raw, flag_name(f.name)) if isinstance(raw, str) else raw
        elif env_name(f.name) in env:
            values[f.name] = parse_value(f, env[env_name(f.name)], env_name(f.name))
        elif f.name in file_values:
            value = file_values[f.name]
            if isinstance(value, list) and f.metadata.get("repeat"):  # a TOML array
                value = ",".join(str(v) for v in value)
            values[f.name] = (
                parse_value(f, str(value), f"config file key {f.name!r}")
                if isinstance(value, str)
                else value
            )
    return cls(**values)


def describe(cls: type) -> list[tuple[str, str, str, Any, str]]:
    """(field, flag, env var, default, help) for every field: the source of docs/configuration.md."""
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        rows.append(
            (f.name, flag_name(f.name), env_name(f.name), default, f.metadata.get("help", ""))
        )
    return rows
