"""`LoraWeights`: the adapter slots of a model, attached beside its linear layers.

Every fused linear a decoder layer's block takes LoRA on (`<linear>_lora` in `blocks.py`)
gets one `LoraSite` (`executor.models.lora_layers`) holding every slot's A and B. Which
Hugging Face projections a fused linear holds, in which output columns, is the family's
`FUSED_LINEARS`; how this rank's part is cut is its shard plan (the family's `TP_SPLITS`, as
for the base weights): a column-parallel projection keeps its rows of B, a row-parallel one
its columns of A.

The base weights are never touched: an adapter lives in its own buffers, so a weight update
and an adapter compose, and a quantized base keeps its quantized weights (the adapter runs in
the activation dtype beside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.core.lora_types import LORA_TARGETS
from executor.models.config import ModelConfig
from executor.models.decoder_model import DecoderModel
from executor.models.lora_layers import LoraBatch, LoraSite
from executor.models.weights import layer_submodule
from ops.host_transfer import to_device


@dataclass(frozen=True)
class Projection:
    """One Hugging Face projection of one layer that a site adapts."""

    layer: int
    part: str  # its path in the layer: "self_attn.q_proj"
    site: LoraSite
    index: int  # its place among the site's projections
    shape: tuple[int, int]  # the whole projection's [out, in]
    split: tuple[int, int, int] | None  # this rank's cut (axis, start, stop); None: whole

    @property
    def target(self) -> str:
        return self.part.rpartition(".")[2]

    @property
    def hf_weight(self) -> str:
        return f"model.layers.{self.layer}.{self.part}.weight"


def projection_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """[out, in] of a dense layer's projection, whole (every rank's)."""
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }[target]


def _local(shape: tuple[int, int], split: tuple[int, int, int] | None) -> tuple[int, int]:
    """This rank's [out, in] of a projection cut by `split`."""
    if split is None:
        return shape
    axis, start, stop = split
    return (stop - start, shape[1]) if axis == 0 else (shape[0], stop - start)


class LoraWeights:
    """Every slot's adapters: one site per adaptable linear of every layer."""

    def __init__(self, model: DecoderModel, slots: int, rank: int) -> None:
        """Attach the sites to `model` (its `lora` mask is theirs). `slots` >= 1."""
        ref = next(model.parameters())
        device, dtype = ref.device, model.activation_dtype
        self.slots, self.rank = slots, rank
        self.batch = LoraBatch(slots, rank, device=device, dtype=dtype)
        self.device, self.dtype = device, dtype
        self.projections: dict[tuple[int, str], Projection] = {}
        self.sites: list[LoraSite] = []
        for i, layer in enumerate(model.decoder_layers):
            for path, parts in model.FUSED_LINEARS.items():
                parent_path, _, leaf = path.rpartition(".")
                parent = layer_submodule(layer, parent_path) if parent_path else layer
                if parent is None or layer_submodule(layer, path) is None:
                    continue  # this layer has no such linear (a mixture-of-experts MLP)
                if not hasattr(parent, leaf + "_lora"):
                    continue  # its block takes no LoRA
                self._attach(model, i, parent, leaf, parts)
        model.lora = self.batch

    def _attach(
        self,
        model: DecoderModel,
        layer: int,
        parent: torch.nn.Module,
        leaf: str,
        parts: tuple[str, ...],
    ) -> None:
        config, plan = model.config, model.plan
        cuts = []
        for part in parts:
            target = part.rpartition(".")[2]
            if target not in LORA_TARGETS:
                return
            shape = projection_shape(config, target)
            split = plan.split_of(f"model.layers.{layer}.{part}.weight")
            cuts.append((part, shape, split))
        ins = {_local(shape, split)[1] for _, shape, split in cuts}
        assert len(ins) == 1, f"projections of {leaf} disagree on their input: {ins}"
        outs = tuple(_local(shape, split)[0] for _, shape, split in cuts)
        site = LoraSite(self.batch, ins.pop(), outs, device=self.device, dtype=self.dtype)
        setattr(parent, leaf + "_lora", site)
        self.sites.append(site)
        for index, (part, shape, split) in enumerate(cuts):
            self.projections[(layer, part)] = Projection(layer, part, site, index, shape, split)

    @property
    def targets(self) -> tuple[str, ...]:
        """Which of LORA_TARGETS some layer of this model takes, in that order."""
        have = {p.target for p in self.projections.values()}
        return tuple(t for t in LORA_TARGETS if t in have)

    @property
    def nbytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for s in self.sites)

    def write(
        self, slot: int, modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Slot `slot` holds exactly `modules`: (layer, part) -> this rank's (A [r, in],
        B [out, r] scaled), host float tensors; every other projection's part of the slot is
        zero. On the device thread, between two steps."""
        by_site: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = {
            id(s): [None] * s.parts for s in self.sites
        }
        for key, (a, b) in modules.items():
            p = self.projections[key]
            by_site[id(p.site)][p.index] = (
                to_device(a.to(self.dtype).contiguous(), self.device, "lora_load"),
                to_device(b.to(self.dtype).contiguous(), self.device, "lora_load"),
            )
        for site in self.sites:
            site.write_slot(slot, by_site[id(site)])

    def clear(self, slot: int) -> None:
        """Slot `slot` adapts nothing (zeros)."""
        for site in self.sites:
            site.write_slot(slot, [None] * site.parts)
