"""The eager path's input registries: which inputs the model reads, and their one copy.

Eager never pads (`padded == raw`), so it needs no buffers of its own: the model reads the
step's staged device views (:mod:`ops.h2d_staging`), and those views are the eager
registry's buffers. Each input reaches the device once, in the step's one staged upload.
The registries (`eager_decode`, bs axis, for DECODE; `eager_extend`, token axis, for
EXTEND) are the graph runners' slot tables (:mod:`registry.factories`); here they declare
which of the batch's device fields the model reads, and the step's fill statistics report
what the staged upload carried for them (one copy call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.forward_batch import ForwardBatch
from registry import BufferRegistry, FillStats, build_decode_registry, build_prefill_registry

EAGER_DECODE = "eager_decode"
EAGER_EXTEND = "eager_extend"


@dataclass(frozen=True)
class EagerRegistry:
    """One mode's eager inputs: the device slots of its registry."""

    name: str
    fields: tuple[str, ...]

    def fill_stats(self, fb: ForwardBatch) -> FillStats:
        """What the staged upload carried for this registry: its fields present on `fb`,
        their bytes, and the one copy that brought them."""
        present = [t for name in self.fields if (t := getattr(fb, name)) is not None]
        if not present:
            return FillStats()
        return FillStats(
            tensors_copied=len(present),
            bytes_copied=sum(t.numel() * t.element_size() for t in present),
            copy_calls=1,
        )


def _device_slots(name: str, registry: BufferRegistry) -> EagerRegistry:
    """The slots that live on the registry's device (host mirrors are carried, not copied)."""
    fields = tuple(
        slot
        for slot in registry.slot_names()
        if registry.slot_device(registry.get_slot(slot)) == registry.device
    )
    return EagerRegistry(name, fields)


class EagerInputs:
    """The two eager registries, read from the slot tables once (on the meta device: no
    memory, since the eager path stages nothing into them)."""

    def __init__(self) -> None:
        meta = torch.device("meta")
        self.decode = _device_slots(
            EAGER_DECODE,
            build_decode_registry(
                device=meta,
                max_bs=0,
                max_num_tokens=0,
                seq_len_fill_value=0,
                needs_cpu_seq_lens=False,
                share_pool=False,
            ),
        )
        self.extend = _device_slots(
            EAGER_EXTEND,
            build_prefill_registry(device=meta, max_bs=0, max_num_tokens=0, share_pool=False),
        )

    def registry_for(self, fb: ForwardBatch) -> EagerRegistry:
        return self.extend if fb.forward_mode.is_extend() else self.decode
