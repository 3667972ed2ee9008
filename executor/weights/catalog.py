"""`WeightCatalog`: every checkpoint tensor a weight update may name, its whole shape, and
where this rank keeps its part; `UpdatePlan`: an update's header, checked against it.

The names are the loader's (`executor.models.weights.checkpoint_targets`): Hugging Face
checkpoint names, so a trainer sends what its state dict or a saved checkpoint holds. The
catalog is read from a parameter-less (meta) build of the model's float form, so it is the
same whether the served model packed or quantized its linears, and on every tensor-parallel
rank; each rank's rows come from its `ShardPlan`.

- A tensor maps onto one target (a parameter, or one expert's entry of a stacked one) and
  a range of its rows: the fused projections (QKV, gate/up) are their parts' rows one after
  the other, each part cut to this rank's shard first.
- A tied model's `lm_head.weight` (some checkpoints store the copy) is accepted and ignored,
  as the loader ignores it: the embedding is the head.

`plan` checks a header without reading any tensor: every refusal an update can meet from its
names, dtypes, shapes and sizes (INVALID_ARGUMENT as `BatchValidationError` naming the field,
RESOURCE_EXHAUSTED as `BatchTooLargeError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.models.config import ModelConfig
from executor.models.registry import create_model, shard_plan
from executor.models.sharding import ShardPlan
from executor.models.weights import CheckpointTarget, checkpoint_targets

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_NAME_BYTES = 256
MAX_VERSION_BYTES = 128


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as an update's header describes it: the whole checkpoint tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class CatalogEntry:
    """Where one checkpoint tensor goes on this rank."""

    name: str
    shape: tuple[int, ...]  # the whole checkpoint tensor's
    target: CheckpointTarget | None  # None: accepted and ignored (a tied head's copy)
    rows: tuple[int, int] = (0, 0)  # the rows of the target's tensor (this rank's) it fills


@dataclass(frozen=True)
class UpdatePlan:
    """A checked header: its tensors in order, each with its catalog entry."""

    version: str  # as asked ("" = the executor's count)
    specs: tuple[TensorSpec, ...]
    entries: tuple[CatalogEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


class WeightCatalog:
    """The checkpoint tensors of one model, for one rank (`plan`)."""

    def __init__(self, config: ModelConfig, plan: ShardPlan) -> None:
        self.config = config
        self.plan = plan
        # The float form's structure and whole shapes, without memory.
        meta = create_model(config, 1, device=torch.device("meta"), dtype=torch.float32)
        whole = shard_plan(config, 1, 0)  # the family's split rules, every range whole
        self.targets = checkpoint_targets(meta)
        self.entries: dict[str, CatalogEntry] = {}
        for target in self.targets:
            shape = tuple(target.tensor(meta).shape)
            row = 0
            for part in target.parts:
                full = shape
                if len(target.parts) > 1:  # a fused part: its own rows of the whole
                    rule = whole.split_rule(part)
                    if rule is None or rule[0] != 0:
                        raise ValueError(f"fused part {part!r} has no row range in TP_SPLITS")
                    full = (whole.extent(rule[1]), *shape[1:])
                rows = self._local_rows(part, full)
                self.entries[part] = CatalogEntry(part, full, target, (row, row + rows))
                row += rows
        if config.tie_word_embeddings and "lm_head.weight" not in self.entries:
            vocab = (config.vocab_size, config.hidden_size)
            self.entries["lm_head.weight"] = CatalogEntry("lm_head.weight", vocab, None)
        # A float32 checkpoint of every tensor: no update naming each at most once is larger.
        self.max_bytes = sum(4 * math.prod(e.shape) for e in self.entries.values())

    def _local_rows(self, name: str, full: tuple[int, ...]) -> int:
        split = self.plan.split_of(name)
        if split is None or split[0] != 0:
            return full[0]
        return split[2] - split[1]

    @property
    def max_tensors(self) -> int:
        return len(self.entries)

    def local_shape(self, entry: CatalogEntry) -> tuple[int, ...]:
        """This rank's part of the tensor (`ShardPlan.take` of the whole one)."""
        split = self.plan.split_of(entry.name)
        if split is None:
            return entry.shape
        axis, start, stop = split
        shape = list(entry.shape)
        shape[axis] = stop - start
        return tuple(shape)

    def plan_update(self, specs: list[TensorSpec], version: str, *, max_bytes: int) -> UpdatePlan:
        """The header `specs` + `version` checked (nothing read, nothing changed): raises
        BatchValidationError (INVALID_ARGUMENT) or BatchTooLargeError (RESOURCE_EXHAUSTED)
        naming the field and the rule."""
        check_version(version)
        if not specs:
            raise BatchValidationError("tensors", "an update names at least one tensor")
        if len(specs) > self.max_tensors:
            raise BatchTooLargeError(
                "tensors",
                f"{len(specs)} tensors, more than the model's {self.max_tensors} "
                "(weight_update_limits.max_tensors)",
            )
        seen: set[str] = set()
        entries = []
        for i, spec in enumerate(specs):
            entries.append(self._check(i, spec, seen))
        total = sum(s.nbytes for s in specs)
        if total > max_bytes:
            raise BatchTooLargeError(
                "tensors",
                f"{total} bytes, more than weight_update_limits.max_update_bytes ({max_bytes})",
            )
        return UpdatePlan(version, tuple(specs), tuple(entries))

    def _check(self, i: int, spec: TensorSpec, seen: set[str]) -> CatalogEntry:
        field = f"tensors[{i}]"
        if len(spec.name.encode()) > MAX_NAME_BYTES:
            raise BatchValidationError(
                f"{field}.name",
                f"at most {MAX_NAME_BYTES} bytes (weight_update_limits.max_name_bytes)",
            )
        entry = self.entries.get(spec.name)
        if entry is None:
            example = next(iter(self.entries))
            raise BatchValidationError(
                f"{field}.name",
                f"{spec.name!r} is not a tensor of this {self.config.architecture} model (names "
                f"are a Hugging Face checkpoint's, e.g. {example!r})",
            )
        if spec.name in seen:
            raise BatchValidationError(f"{field}.name", f"{spec.name!r} is named twice")
        seen.add(spec.name)
        if spec.dtype not in FLOAT_DTYPES:
            raise BatchValidationError(
                f"{field}.dtype",
                f"{spec.name}: must be FLOAT32, BFLOAT16 or FLOAT16, got {spec.dtype}",
            )
        if tuple(spec.shape) != entry.shape:
            raise BatchValidationError(
                f"{field}.shape",
                f"{spec.name} has shape {list(spec.shape)}, the model's is {list(entry.shape)}",
            )
        return entry


def check_version(version: str) -> None:
    """A weight_version: at most MAX_VERSION_BYTES of printable ASCII ("" = a counter)."""
    if len(version.encode()) > MAX_VERSION_BYTES or not all(" " <= c <= "~" for c in version):
        raise BatchValidationError(
            "weight_version",
            f"at most {MAX_VERSION_BYTES} bytes of printable ASCII, got {version[:40]!r}",
        )
