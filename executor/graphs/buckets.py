"""The bucket policy, in one place: which sizes get a captured graph, and pad-to-bucket.

Full-graph DECODE is captured per batch size; piecewise EXTEND per token count. A batch runs
in the smallest bucket that holds it, its tail padded (the registry's padding policies make
padded lanes harmless). Everything else calls these functions; nothing else knows the lists.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


def default_decode_buckets(max_bs: int) -> list[int]:
    """`[1, 2, 4, 8] + range(16, max_bs + 1, 8)`, cut at max_bs, with max_bs itself included."""
    if max_bs < 1:
        raise ValueError(f"graph max batch size must be >= 1, got {max_bs}")
    sizes = [b for b in [1, 2, 4, 8, *range(16, max_bs + 1, 8)] if b <= max_bs]
    return normalize_buckets([*sizes, max_bs])


# Piecewise capture costs (layers + 1) graphs per token count, each with warm-up runs: a
# 30-layer model at 42 sizes was about 1,300 graphs. The default ladder is 10 sizes (310
# graphs at 30 layers): powers of two to 512, then steps of 1.5x, so a chunk pads by at most
# 2x below 512 tokens (where a step is cheap) and by at most 1.5x above.
PIECEWISE_LADDER = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048)


def default_piecewise_buckets(max_tokens: int) -> list[int]:
    """Token counts of `PIECEWISE_LADDER` cut at max_tokens, with max_tokens itself included."""
    if max_tokens < 1:
        raise ValueError(f"piecewise max tokens must be >= 1, got {max_tokens}")
    return normalize_buckets([s for s in PIECEWISE_LADDER if s <= max_tokens] + [max_tokens])


# On CPU a captured bucket costs a compile check and warm-up runs of real size, and replay
# saves Python overhead, not launches: fewer, coarser buckets (powers of two), and smaller
# maxima (a larger batch or chunk runs eagerly at the same speed).
CPU_GRAPH_MAX_BS = 64
CPU_PIECEWISE_MAX_TOKENS = 1024


def cpu_decode_buckets(max_bs: int) -> list[int]:
    """Powers of two up to max_bs, with max_bs itself included."""
    return _powers_of_two(1, max_bs)


def cpu_piecewise_buckets(max_tokens: int) -> list[int]:
    """Powers of two from 16 up to max_tokens, with max_tokens itself included."""
    return _powers_of_two(16, max_tokens)


def _powers_of_two(first: int, last: int) -> list[int]:
    if last < 1:
        raise ValueError(f"the largest bucket must be >= 1, got {last}")
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= 2
    return normalize_buckets([*sizes, last])


def normalize_buckets(sizes: Sequence[int]) -> list[int]:
    """Sorted, unique, positive sizes (a configured list may come in any order)."""
    if not sizes:
        raise ValueError("a bucket list must not be empty")
    bad = [s for s in sizes if s < 1]
    if bad:
        raise ValueError(f"bucket sizes must be >= 1, got {bad}")
    return sorted(set(sizes))


def pad_to_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n, or None when n exceeds the largest (the batch runs eager)."""
    if n < 1:
        raise ValueError(f"cannot pad {n} to a bucket")
    i = bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def parse_bucket_list(text: str) -> list[int] | None:
    """A config string: "" -> None (use the default), "1,2,4,8" -> [1, 2, 4, 8]."""
    text = text.strip()
    if not text:
        return None
    try:
        return normalize_buckets([int(part) for part in text.split(",") if part.strip()])
    except ValueError as e:
        raise ValueError(
            f"bucket list must be comma-separated positive integers, got {text!r}: {e}"
        ) from e
