"""Rank 0 tells the other ranks what to run: a JSON header, then the batch's tensors.

Every command rank 0 sends is one `Command`: `step` (a validated, completed host batch and
whether its row-table write stays), `toggles` (a runtime-config change, applied between two
steps on every rank), `kv_read` / `kv_write` (the KV data plane: every rank reads its heads
of a chunk for rank 0 to gather, or writes its heads of a checked import, `payload` holding
every rank's bytes), `lora` (an adapter load or unload: every rank writes its cut of the slot,
`executor.lora.adapters`), `weights` (a weight update's or memory call's part on every rank,
`executor.weights.ranks`; `payload`: a stream's tensors), `ping` (the idle heartbeat: proves
the workers are alive and keeps their wait for the next command inside the collective
timeout) and `stop`.

The batch travels as a header (field names, shapes, dtypes, host scalars and lists) encoded
as JSON and broadcast as bytes, then one flat buffer per dtype through `broadcast_` (a
handful of collectives per step however many fields the batch has), on the CPU group.
No Python objects travel on this path: a worker decodes only JSON and raw tensor bytes,
and every field it accepts is named here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.core.extras_types import HiddenAsk, Pooling, RowOutputs
from executor.core.forward_batch import ForwardBatch, ForwardMode, SamplingBatch
from executor.parallel.comm import TpComm

STEP, TOGGLES, PING, STOP = "step", "toggles", "ping", "stop"
KV_READ, KV_WRITE, LORA = "kv_read", "kv_write", "lora"
WEIGHTS = "weights"
COMMANDS = (STEP, TOGGLES, PING, STOP, KV_READ, KV_WRITE, LORA, WEIGHTS)


@dataclass
class Command:
    kind: str  # one of COMMANDS
    batch: ForwardBatch | None = None  # STEP: the completed host batch
    keep_rows: bool = True  # STEP: False for warm-up (its row-table write is undone)
    toggles: dict[str, Any] = field(default_factory=dict)  # TOGGLES: apply_toggles' arguments
    kv: dict[str, Any] = field(default_factory=dict)  # KV_READ / KV_WRITE: slots, chunk, row
    payload: torch.Tensor | None = None  # KV_WRITE: every rank's staged bytes (uint8, flat)
    lora: dict[str, Any] = field(default_factory=dict)  # LORA: op, name, path, slot
    weights: dict[str, Any] = field(default_factory=dict)  # WEIGHTS: the call's header

    def __post_init__(self) -> None:
        if self.kind not in COMMANDS:
            raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {self.kind!r}")


# Fields never sent: set on each rank by the runner, or rank 0's alone (the workers do not
# sample: no sampling controls or vocab masks reach them).
_LOCAL_FIELDS = (
    "attn_metadata",
    "num_token_non_padded",
    "row_controls",
    "vocab_mask",
    "deferred_mask",
    "row_adapters",  # rank 0's: the workers get the per-token `lora_slots`
)
_WIRE_DTYPES = {torch.bool: torch.uint8}  # gloo reduces/broadcasts bool as bytes
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.bool, torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16)
}


def _ask_to_json(a: RowOutputs) -> dict[str, Any]:
    out = dataclasses.asdict(a)
    if a.hidden is not None:
        out["hidden"]["pooling"] = int(a.hidden.pooling)
    return out


def _ask_from_json(d: dict[str, Any]) -> RowOutputs:
    h = d.get("hidden")
    hidden = None
    if h is not None:
        hidden = HiddenAsk(Pooling(int(h["pooling"])), h["layer"], bool(h["bfloat16"]))
    return RowOutputs(
        row=int(d["row"]),
        prompt_logprobs=bool(d["prompt_logprobs"]),
        logprob_start_len=int(d["logprob_start_len"]),
        next_prompt_token=d["next_prompt_token"],
        score_token_ids=tuple(int(t) for t in d["score_token_ids"]),
        hidden=hidden,
        routed_experts=bool(d.get("routed_experts", False)),  # every rank runs it eagerly
    )


def _split(batch: ForwardBatch) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """(JSON-able host values, [(path, tensor)]): `sampling.<name>` for the sampling batch."""
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
        elif f.name == "row_outputs":
            scalars[f.name] = [_ask_to_json(a) for a in value]
        else:
            scalars[f.name] = int(value) if isinstance(value, ForwardMode) else value
    return scalars, tensors


def send(comm: TpComm, command: Command) -> None:
    """Rank 0: broadcast `command` to every rank."""
    header: dict[str, Any] = {
        "kind": command.kind,
        "keep_rows": command.keep_rows,
        "toggles": command.toggles,
        "kv": command.kv,
        "lora": command.lora,
        "weights": command.weights,
        "payload": 0 if command.payload is None else int(command.payload.numel()),
    }
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    if command.batch is not None:
        scalars, tensors = _split(command.batch)
        header["scalars"] = scalars
        header["tensors"] = [
            (path, str(t.dtype).removeprefix("torch."), list(t.shape)) for path, t in tensors
        ]
        for _, t in tensors:
            groups.setdefault(t.dtype, []).append(t.reshape(-1))
    comm.broadcast_bytes(json.dumps(header).encode())
    for dtype in sorted(groups, key=str):
        flat = torch.cat(groups[dtype]).to(_WIRE_DTYPES.get(dtype, dtype))
        comm.broadcast_(flat.contiguous())
    if command.payload is not None:
        comm.broadcast_(command.payload.contiguous())


def receive(comm: TpComm) -> Command:
    """A worker: wait for rank 0's next command (blocks inside the collective timeout)."""
    header = json.loads(comm.broadcast_bytes(None))
    batch = None
    if "tensors" in header:
        specs = [(path, _DTYPES[dtype], tuple(shape)) for path, dtype, shape in header["tensors"]]
        sizes: dict[torch.dtype, int] = {}
        for _, dtype, shape in specs:
            sizes[dtype] = sizes.get(dtype, 0) + int(torch.Size(shape).numel())
        flats: dict[torch.dtype, torch.Tensor] = {}
        for dtype in sorted(sizes, key=str):
            buf = torch.empty(sizes[dtype], dtype=_WIRE_DTYPES.get(dtype, dtype))
            flats[dtype] = comm.broadcast_(buf).to(dtype)
        offsets = dict.fromkeys(sizes, 0)
        values: dict[str, Any] = dict(header["scalars"])
        sampling: dict[str, torch.Tensor] = {}
        for path, dtype, shape in specs:
            n = int(torch.Size(shape).numel())
            t = flats[dtype][offsets[dtype] : offsets[dtype] + n].view(shape)
            offsets[dtype] += n
            if path.startswith("sampling."):
                sampling[path.removeprefix("sampling.")] = t
            else:
                values[path] = t
        values["forward_mode"] = ForwardMode(values["forward_mode"])
        values["sampling"] = SamplingBatch(**sampling) if values.pop("sampling", None) else None
        values["row_outputs"] = tuple(_ask_from_json(a) for a in values.get("row_outputs", []))
        batch = ForwardBatch(**values)
    payload = None
    if header.get("payload"):
        payload = comm.broadcast_(torch.empty(int(header["payload"]), dtype=torch.uint8))
    return Command(
        kind=header["kind"],
        batch=batch,
        keep_rows=header["keep_rows"],
        toggles=header["toggles"],
        kv=header.get("kv", {}),
        payload=payload,
        lora=header.get("lora", {}),
        weights=header.get("weights", {}),
    )
