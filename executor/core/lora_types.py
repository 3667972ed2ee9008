"""The host-side shapes of LoRA adapters: what a batch carries, what GetInfo lists, and the
names and caps every side checks (the wire's rules, `RowAdapter` and `LoadLora`).

An adapter is known by its name, which a batch's `RowAdapter` entries use and the operator
chose when loading it (`--lora NAME=PATH`, the `LoadLora` call). Names are short and plain
(`NAME_RULE`): they become metric labels. A row's adapter lives at its slot, 1..max_loras
(0 is the base model).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from executor.core.errors import BatchValidationError

# The projections an adapter may target (PEFT module names), in the layer's order.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_NAME_BYTES = 128  # an adapter's name (GetInfo.max_lora_name_bytes)
MAX_PATH_BYTES = 4096  # LoadLora's path
NAME_RULE = "1 to 128 characters of A-Z a-z 0-9 . _ : / -, starting with a letter or digit"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def check_adapter_name(field: str, name: str) -> None:
    """BatchValidationError (naming `field`) unless `name` follows `NAME_RULE`."""
    if not _NAME.fullmatch(name):
        raise BatchValidationError(field, f"adapter name {name[:140]!r} must be {NAME_RULE}")


@dataclass(frozen=True)
class RowAdapter:
    """Sets the adapter of one row of a batch (for the request's life): a loaded adapter's
    name, or "" for the base model."""

    row: int
    name: str


@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter in a slot, as GetInfo lists it."""

    name: str
    path: str
    slot: int  # 1..max_loras
    rank: int  # the largest rank of its modules
    target_modules: tuple[str, ...]  # which of LORA_TARGETS it adapts
    load_seconds: float = 0.0  # reading, checking and writing it


@dataclass(frozen=True)
class LoraInfo:
    """The executor's adapters and caps (GetInfo)."""

    adapters: tuple[LoadedAdapter, ...] = ()
    max_loras: int = 0  # slots (0: LoRA off)
    max_lora_rank: int = 0
    target_modules: tuple[str, ...] = ()  # which of LORA_TARGETS this model's layers take
    max_name_bytes: int = MAX_NAME_BYTES


def parse_lora_setting(text: str) -> tuple[tuple[str, str], ...]:
    """`--lora` entries ("a=/p,b=/q") as (name, path) pairs; ValueError naming the entry."""
    pairs: list[tuple[str, str]] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, sep, path = entry.partition("=")
        if not sep or not path.strip():
            raise ValueError(f"lora: expected NAME=PATH, got {entry!r}")
        name = name.strip()
        if not _NAME.fullmatch(name):
            raise ValueError(f"lora: adapter name {name!r} must be {NAME_RULE}")
        if name in (n for n, _ in pairs):
            raise ValueError(f"lora: adapter name {name!r} is given twice")
        pairs.append((name, path.strip()))
    return tuple(pairs)
