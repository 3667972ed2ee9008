"""Reading a PEFT LoRA adapter and checking it against the model, before anything changes.

A PEFT adapter directory holds `adapter_config.json` and `adapter_model.safetensors` with one
`lora_A` [r, in] and one `lora_B` [out, r] per adapted module, named
`base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight`. PEFT computes
`base(x) + scaling * B(A(x))` with `scaling = alpha / r` (`alpha / sqrt(r)` with rslora), `r`
and `alpha` per module from `rank_pattern` / `alpha_pattern` when they name it.

`read_adapter` refuses (`LoraAdapterError`, the file and the rule) what it cannot apply, in
this order, reading tensor data only once every header claim passed:
- not a LoRA adapter (`peft_type`), or a PEFT option that changes the product (DoRA,
  `lora_bias`, trained biases, `modules_to_save`, `fan_in_fan_out`, layer replication,
  trainable tokens, aLoRA, target parameters);
- a tensor that is not the A or B of a projection this model's layers take (an unknown target
  module: the LM head, the embedding, a mixture-of-experts MLP, a layer past the last);
- wrong shapes (A's input or B's output against the model's projection), A and B of
  different ranks, a rank other than the config's, a rank over the executor's cap;
- an alpha/rank it cannot apply (r < 1, a non-finite or non-numeric alpha or scaling), weights
  that are not float or not finite.
What it returns is this rank's part (the shard plan's cut of each projection), B scaled.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from executor.core.errors import LoraAdapterError
from executor.core.lora_types import LORA_TARGETS
from executor.lora.weights import Projection
from executor.models.safetensors_header import check_safetensors_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_FLOATS = {"F32", "F16", "BF16"}
_TENSOR = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight"
)
# PEFT options whose non-default value changes what the adapter computes: (key, default).
_UNSUPPORTED = (
    ("use_dora", False),
    ("lora_bias", False),
    ("fan_in_fan_out", False),
    ("modules_to_save", None),
    ("layer_replication", None),
    ("trainable_token_indices", None),
    ("alora_invocation_tokens", None),
    ("target_parameters", None),
    ("use_qalora", False),
)


@dataclass(frozen=True)
class AdapterFile:
    """An adapter as this rank applies it."""

    path: str
    rank: int  # the largest of its modules'
    targets: tuple[str, ...]  # which of LORA_TARGETS it adapts, in that order
    # (layer, part) -> (A [r, in], B [out, r] * scaling): this rank's cut, float32, host
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _refuse(path: Path, rule: str) -> LoraAdapterError:
    return LoraAdapterError(f"adapter {path}: {rule}")


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """PEFT's `get_pattern_key`: the first pattern that matches the module's name's end."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def read_config(path: Path) -> dict[str, Any]:
    """`adapter_config.json`, checked for what no projection can apply."""
    file = path / CONFIG_FILE
    if not path.is_dir() or not file.is_file():
        raise _refuse(path, f"not a PEFT adapter directory (no {CONFIG_FILE})")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise _refuse(path, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _refuse(path, f"{CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise _refuse(path, f"{CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type is {cfg.get('peft_type')!r}, not LORA")
    for key, default in _UNSUPPORTED:
        value = cfg.get(key, default)
        if value not in (default, None, False, [], {}):
            raise _refuse(path, f"{key}={value!r} is not supported (plain LoRA only)")
    if cfg.get("bias", "none") != "none":
        raise _refuse(path, f"bias={cfg.get('bias')!r} is not supported: trained biases")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise _refuse(path, f"{key} must be an object")
    return cfg


def _scaling(path: Path, cfg: dict[str, Any], module: str) -> tuple[int, float]:
    """(r, scaling) of the module named `module` ("model.layers.0.self_attn.q_proj")."""
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    rk, ak = _pattern_key(ranks, module), _pattern_key(alphas, module)
    r = ranks[rk] if rk is not None else cfg.get("r", 8)
    alpha = alphas[ak] if ak is not None else cfg.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _refuse(path, f"{module}: rank r={r!r} cannot be applied (an integer >= 1)")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _refuse(path, f"{module}: lora_alpha={alpha!r} is not a number")
    scaling = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
    if not math.isfinite(scaling):
        raise _refuse(path, f"{module}: alpha {alpha!r} / rank {r} gives scaling {scaling}")
    return r, float(scaling)


def read_adapter(
    path: Path, projections: Mapping[tuple[int, str], Projection], max_rank: int
) -> AdapterFile:
    """The adapter at `path` as this rank applies it (`projections`: what the model's layers
    take, `LoraWeights.projections`); LoraAdapterError naming the file and the rule."""
    from safetensors import safe_open

    cfg = read_config(path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise _refuse(path, f"no {WEIGHTS_FILE} (only safetensors adapters are read)")
    try:
        check_safetensors_header(weights)
    except ValueError as exc:
        raise _refuse(path, str(exc)) from None
    found: dict[tuple[int, str], dict[str, Any]] = {}
    with safe_open(str(weights), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            m = _TENSOR.fullmatch(name)
            key = (int(m.group(1)), str(m.group(2))) if m else (-1, "")
            if m is None or key not in projections:
                layers = 1 + max((k[0] for k in projections), default=-1)
                raise _refuse(
                    path,
                    f"tensor {name!r}: unknown target module (this model takes LoRA on "
                    f"{', '.join(sorted({p.target for p in projections.values()}))} of layers "
                    f"0..{layers - 1}; {', '.join(LORA_TARGETS)} of a dense layer)",
                )
            found.setdefault(key, {})[m.group(3)] = handle.get_slice(name)
        modules = {
            key: _module(path, cfg, name_slices, projections[key], max_rank)
            for key, name_slices in sorted(found.items())
        }
    if not modules:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    targets = {projections[k].target for k in modules}
    return AdapterFile(
        path=str(path),
        rank=max(a.shape[0] for a, _ in modules.values()),
        targets=tuple(t for t in LORA_TARGETS if t in targets),
        modules=modules,
    )


def _module(
    path: Path, cfg: dict[str, Any], slices: dict[str, Any], p: Projection, max_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's (A, B * scaling), this rank's cut, after every check of its headers."""
    module = f"model.layers.{p.layer}.{p.part}"
    if set(slices) != {"A", "B"}:
        missing = "B" if "A" in slices else "A"
        raise _refuse(path, f"{module}: lora_{missing} is missing")
    sa, sb = slices["A"], slices["B"]
    a_shape, b_shape = tuple(sa.get_shape()), tuple(sb.get_shape())
    out, inp = p.shape
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != inp or b_shape[0] != out:
        raise _refuse(
            path,
            f"{module}: wrong shapes, lora_A {list(a_shape)} and lora_B {list(b_shape)}; this "
            f"model's {p.target} needs lora_A [r, {inp}] and lora_B [{out}, r]",
        )
    r = a_shape[0]
    if b_shape[1] != r:
        raise _refuse(path, f"{module}: lora_A has rank {r}, lora_B {b_shape[1]}")
    want, scaling = _scaling(path, cfg, module)
    if r != want:
        raise _refuse(path, f"{module}: tensors of rank {r}, {CONFIG_FILE} says r={want}")
    if r > max_rank:
        raise _refuse(path, f"{module}: rank {r} is over the cap (max_lora_rank {max_rank})")
    for side, s in (("A", sa), ("B", sb)):
        if s.get_dtype() not in _FLOATS:
            raise _refuse(path, f"{module}: lora_{side} is {s.get_dtype()}, not a float type")
    a, b = _cut(sa, sb, p.split)
    a, b = a.float(), b.float() * scaling
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise _refuse(path, f"{module}: weights are not finite (after scaling {scaling:g})")
    return a, b


def _cut(sa: Any, sb: Any, split: tuple[int, int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A and B, reading only its part: a column-parallel projection's B rows,
    a row-parallel one's A columns."""
    if split is None:
        return sa[:], sb[:]
    axis, start, stop = split
    if axis == 0:
        return sa[:], sb[start:stop]
    return sa[:, start:stop], sb[:]
