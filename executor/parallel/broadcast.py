"""Rank 0 tells the other ranks what to run: a small pickled header, then the batch's tensors.

Every command rank 0 sends is one `Command`: `step` (a validated, completed host batch and
whether its row-table write stays), `toggles` (a runtime-config change, applied between two
steps on every rank), `ping` (the idle heartbeat: proves the workers are alive and keeps
their wait for the next command inside the collective timeout) and `stop`.

The batch travels as a header (field names, shapes, dtypes, host scalars and lists) through
`broadcast_object`, then one flat buffer per dtype through `broadcast_` (a handful of
collectives per step however many fields the batch has), on the CPU group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.forward_batch import ForwardBatch, ForwardMode, SamplingBatch
from executor.parallel.comm import TpComm

STEP, TOGGLES, PING, STOP = "step", "toggles", "ping", "stop"
COMMANDS = (STEP, TOGGLES, PING, STOP)


@dataclass
class Command:
    kind: str  # one of COMMANDS
    batch: ForwardBatch | None = None  # STEP: the completed host batch
    keep_rows: bool = True  # STEP: False for warm-up (its row-table write is undone)
    toggles: dict[str, Any] = field(default_factory=dict)  # TOGGLES: apply_toggles' arguments

    def __post_init__(self) -> None:
        if self.kind not in COMMANDS:
            raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {self.kind!r}")


# Fields never sent: set on each rank by the runner.
_LOCAL_FIELDS = ("attn_metadata", "num_token_non_padded")
_WIRE_DTYPES = {torch.bool: torch.uint8}  # gloo reduces/broadcasts bool as bytes


def _split(batch: ForwardBatch) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """(host values, [(path, tensor)]): `sampling.<name>` for the sampling batch."""
    scalars: dict[str, Any] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if f.name in _LOCAL_FIELDS:
            continue
        if isinstance(value, torch.Tensor):
            tensors.append((f.name, value))
        elif isinstance(value, SamplingBatch):
            for sf in dataclasses.fields(value):
                tensors.append((f"sampling.{sf.name}", getattr(value, sf.name)))
            scalars["sampling"] = True
        else:
            scalars[f.name] = int(value) if isinstance(value, ForwardMode) else value
    return scalars, tensors


def send(comm: TpComm, command: Command) -> None:
    """Rank 0: broadcast `command` to every rank."""
    header: dict[str, Any] = {
        "kind": command.kind,
        "keep_rows": command.keep_rows,
        "toggles": command.toggles,
    }
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    if command.batch is not None:
        scalars, tensors = _split(command.batch)
        header["scalars"] = scalars
        header["tensors"] = [(path, t.dtype, tuple(t.shape)) for path, t in tensors]
        for _, t in tensors:
            groups.setdefault(t.dtype, []).append(t.reshape(-1))
    comm.broadcast_object(header)
    for dtype in sorted(groups, key=str):
        flat = torch.cat(groups[dtype]).to(_WIRE_DTYPES.get(dtype, dtype))
        comm.broadcast_(flat.contiguous())


def receive(comm: TpComm) -> Command:
    """A worker: wait for rank 0's next command (blocks inside the collective timeout)."""
    header = comm.broadcast_object(None)
    batch = None
    if "tensors" in header:
        sizes: dict[torch.dtype, int] = {}
        for _, dtype, shape in header["tensors"]:
            sizes[dtype] = sizes.get(dtype, 0) + int(torch.Size(shape).numel())
        flats: dict[torch.dtype, torch.Tensor] = {}
        for dtype in sorted(sizes, key=str):
            buf = torch.empty(sizes[dtype], dtype=_WIRE_DTYPES.get(dtype, dtype))
            flats[dtype] = comm.broadcast_(buf).to(dtype)
        offsets = dict.fromkeys(sizes, 0)
        values: dict[str, Any] = dict(header["scalars"])
        sampling: dict[str, torch.Tensor] = {}
        for path, dtype, shape in header["tensors"]:
            n = int(torch.Size(shape).numel())
            t = flats[dtype][offsets[dtype] : offsets[dtype] + n].view(shape)
            offsets[dtype] += n
            if path.startswith("sampling."):
                sampling[path.removeprefix("sampling.")] = t
            else:
                values[path] = t
        values["forward_mode"] = ForwardMode(values["forward_mode"])
        values["sampling"] = SamplingBatch(**sampling) if values.pop("sampling", None) else None
        batch = ForwardBatch(**values)
    return Command(
        kind=header["kind"], batch=batch, keep_rows=header["keep_rows"], toggles=header["toggles"]
    )
