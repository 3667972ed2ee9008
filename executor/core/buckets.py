"""The bucket policy, in one place: which sizes get a captured graph, pad-to-bucket, and the
shape bounds of eager steps.

Full-graph DECODE is captured per batch size (and, for a `graph_kv_bounded` attention
backend, per KV-length bucket); piecewise EXTEND per token count. A batch runs in the smallest
bucket that holds it, its tail padded (the registry's padding policies make padded lanes
harmless). Everything else calls these functions; nothing else knows the lists. The KV-length
ladder lives here, not in `attention/`, because the DECODE runner is what chooses a graph per
KV bucket and hands the bucket to the backend (attention never imports the executor).
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


def _ladder(first: int, last: int, factor: int) -> list[int]:
    """first, first * factor, ... below `last`, then `last`."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= factor
    return [*sizes, last]


def _powers_of_two(first: int, last: int) -> list[int]:
    if last < 1:
        raise ValueError(f"the largest bucket must be >= 1, got {last}")
    return normalize_buckets(_ladder(first, last, 2))


# KV-length buckets of captured DECODE graphs: powers of 4 from here up to max_context_len.
SMALLEST_KV_BUCKET = 256


def kv_buckets(max_context_len: int) -> list[int]:
    """The KV-length bounds a `graph_kv_bounded` backend's DECODE graphs are captured at, so a
    batch gathers what its contexts need, not `max_context_len` keys per request: powers of 4
    from `SMALLEST_KV_BUCKET`, with max_context_len itself included."""
    if max_context_len < 1:
        raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
    return _ladder(SMALLEST_KV_BUCKET, max_context_len, 4)


def kv_bucket(seq_len_bound: int | None, max_context_len: int) -> int:
    """The KV bucket of a batch whose longest request is at most `seq_len_bound` tokens
    (None: unknown, the largest)."""
    bound = max_context_len if seq_len_bound is None else min(seq_len_bound, max_context_len)
    bucket = pad_to_bucket(max(1, bound), kv_buckets(max_context_len))
    assert bucket is not None  # the ladder ends at max_context_len
    return bucket


# Steps per octave of a length bound: lengths round up to a sixteenth of their power of two.
LENGTH_BOUND_STEPS = 8


def length_bound(max_len: int, cap: int) -> int:
    """The shape bound of a length, at most `cap`: `max_len` rounded up to a multiple of a
    sixteenth of its next power of two (1, 2, ..., 16, 18, 20, ..., 32, 36, ..., 128, 144, ...).
    At most 1/8 over `max_len`, so a gather sized by it reads at most 12.5% padding (a power
    of two read up to 2x: 256 keys per request for 129-token contexts, where this reads 144),
    with 8 distinct bounds per octave (about 100 up to 8192)."""
    power = next_power_of_2(max_len)
    step = max(1, power // (2 * LENGTH_BOUND_STEPS))
    return min(-(-max_len // step) * step, cap)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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
