"""`ShardPlan`: which slice of every weight, head and vocabulary row one rank holds.

Megatron-style: the fused QKV and gate/up projections are column-parallel (each rank holds
a contiguous range of output rows: its attention heads, its part of the MLP), o_proj and
down_proj row-parallel (the matching input columns; the partial sums are all-reduced), the
embedding and LM head vocab-parallel (each rank holds ceil(vocab / size) rows; the last
rank's tail is zero padding that the gathered logits drop).

Query heads must divide by the size. KV heads either divide too (each rank holds
num_kv_heads / size of them) or the size is a multiple of them: then each KV head is
replicated on size / num_kv_heads consecutive ranks, the ones whose query heads use it.

Which tensors split, and how, is the model family's table (`DecoderModel.TP_SPLITS`, handed
to `build`); a tensor no row names is replicated (norms, q/k norms over head_dim, routers).
Loaders call `take` with a tensor or a lazy slice (safetensors' `get_slice`), so a rank
reads only the rows or columns it keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch

from executor.models.config import ModelConfig

# Hugging Face name pattern (fnmatch) -> (the axis it is split on, which range): column-parallel
# tensors split rows (0), row-parallel ones columns (1). Ranges: q, kv (heads), mlp
# (intermediate columns), experts (each expert's intermediate columns), vocab.
SplitRows = Mapping[str, tuple[int, str]]


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (replicated when size > the model's KV heads)
    head_start: int  # first query head of this rank
    kv_head_start: int
    head_dim: int
    intermediate_size: int  # MLP columns on this rank
    intermediate_start: int
    vocab_size: int  # the model's vocabulary
    vocab_per_rank: int  # rows of the embedding / LM head on each rank (padded)
    # Each expert's columns on this rank (a mixture of experts shards every expert alike).
    expert_intermediate_size: int = 0
    expert_intermediate_start: int = 0
    splits: tuple[tuple[str, int, str], ...] = ()  # the family's TP_SPLITS rows

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @classmethod
    def single(cls, config: ModelConfig) -> ShardPlan:
        return cls.build(config, 1, 0, {})

    @classmethod
    def build(cls, config: ModelConfig, size: int, rank: int, splits: SplitRows) -> ShardPlan:
        """The plan of `rank` in a group of `size` that splits the tensors `splits` names;
        ValueError (naming the counts) when the model cannot be split that way."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tp rank {rank} is outside a group of size {size}")
        heads, kv = config.num_heads, config.num_kv_heads
        if heads % size != 0:
            raise ValueError(
                f"tp_size {size} does not divide the model's {heads} attention heads "
                f"(tp_size must divide num_heads)"
            )
        if kv % size != 0 and size % kv != 0:
            raise ValueError(
                f"tp_size {size} and the model's {kv} KV heads do not divide either way "
                f"(tp_size must divide num_kv_heads, or be a multiple of it)"
            )
        if config.intermediate_size % size != 0:
            raise ValueError(
                f"tp_size {size} does not divide the model's intermediate_size "
                f"{config.intermediate_size}"
            )
        expert_inter = config.moe.intermediate_size if config.moe is not None else 0
        if expert_inter % size != 0:
            raise ValueError(
                f"tp_size {size} does not divide the model's moe_intermediate_size {expert_inter}"
            )
        local_heads = heads // size
        if kv >= size:
            local_kv, kv_start = kv // size, rank * (kv // size)
        else:  # replicated: ranks r share KV head r // (size / kv)
            local_kv, kv_start = 1, rank // (size // kv)
        inter = config.intermediate_size // size
        return cls(
            rank=rank,
            size=size,
            num_heads=local_heads,
            num_kv_heads=local_kv,
            head_start=rank * local_heads,
            kv_head_start=kv_start,
            head_dim=config.head_dim,
            intermediate_size=inter,
            intermediate_start=rank * inter,
            vocab_size=config.vocab_size,
            vocab_per_rank=-(-config.vocab_size // size),
            expert_intermediate_size=expert_inter // size,
            expert_intermediate_start=rank * (expert_inter // size),
            splits=tuple((pattern, axis, which) for pattern, (axis, which) in splits.items()),
        )

    def _range(self, which: str) -> tuple[int, int]:
        d = self.head_dim
        if which == "q":
            return self.head_start * d, (self.head_start + self.num_heads) * d
        if which == "kv":
            return self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d
        if which == "mlp":
            return self.intermediate_start, self.intermediate_start + self.intermediate_size
        if which == "experts":
            start = self.expert_intermediate_start
            return start, start + self.expert_intermediate_size
        return self.vocab_start, self.vocab_start + self.vocab_per_rank

    def split_rule(self, name: str) -> tuple[int, str] | None:
        """(axis, range) the family's table gives HF tensor `name`, at any size; None: the
        table names it not (kept whole on every rank)."""
        for pattern, axis, which in self.splits:
            if fnmatchcase(name, pattern):
                return axis, which
        return None

    def extent(self, which: str) -> int:
        """How many rows (or columns) of range `which` this rank holds (vocab: padded)."""
        start, stop = self._range(which)
        return stop - start

    def split_of(self, name: str) -> tuple[int, int, int] | None:
        """(axis, start, stop) of this rank's part of HF tensor `name`; None: kept whole."""
        if self.size == 1:
            return None
        rule = self.split_rule(name)
        if rule is None:
            return None
        axis, which = rule
        return (axis, *self._range(which))

    def take(self, name: str, source: Any) -> torch.Tensor:
        """This rank's part of `source` (a tensor, or a lazy slice with `get_shape()` and
        `[...]` indexing): only those rows/columns are read. Vocabulary rows past the end
        are zero padding."""
        split = self.split_of(name)
        if split is None:
            return source if isinstance(source, torch.Tensor) else source[:]
        axis, start, stop = split
        shape = (
            tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())
        )
        end = min(stop, shape[axis])
        if end >= stop:
            return source[start:stop] if axis == 0 else source[:, start:stop]
        # Vocabulary rows past the end: zero padding (the gathered logits drop them).
        pad_shape = list(shape)
        pad_shape[axis] = stop - max(start, end)
        if start >= end:
            return torch.zeros(pad_shape, dtype=_dtype(source))
        part = source[start:end] if axis == 0 else source[:, start:end]
        return torch.cat([part, torch.zeros(pad_shape, dtype=part.dtype)], dim=axis)


def _dtype(source: Any) -> torch.dtype:
    if isinstance(source, torch.Tensor):
        return source.dtype
    return source[:1].dtype  # a lazy slice: read one row for its dtype
