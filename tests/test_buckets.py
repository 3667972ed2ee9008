"""The bucket policy: default lists, padding lookups, configured lists."""

from __future__ import annotations

import itertools

import pytest

from executor.core.buckets import (
    cpu_decode_buckets,
    cpu_piecewise_buckets,
    default_decode_buckets,
    default_piecewise_buckets,
    kv_bucket,
    kv_buckets,
    normalize_buckets,
    pad_to_bucket,
    parse_bucket_list,
)


def test_default_decode_buckets() -> None:
    assert default_decode_buckets(1) == [1]
    assert default_decode_buckets(8) == [1, 2, 4, 8]
    assert default_decode_buckets(10) == [1, 2, 4, 8, 10]
    assert default_decode_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_decode_buckets(45)[-2:] == [40, 45]


def test_default_piecewise_buckets() -> None:
    # A small ladder (issue 15): 10 sizes to 2048 where there were 42, so a 30-layer model
    # captures 310 piecewise graphs, not 1,302.
    full = default_piecewise_buckets(2048)
    assert full == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048]
    assert all(b / a <= 2 for a, b in itertools.pairwise(full))
    assert default_piecewise_buckets(100) == [16, 32, 64, 100]
    assert default_piecewise_buckets(3) == [3]


def test_pad_to_bucket_is_the_smallest_that_holds() -> None:
    buckets = [1, 2, 4, 8, 16]
    assert [pad_to_bucket(n, buckets) for n in range(1, 17)] == [1, 2, 4, 4, 8, 8, 8, 8, *[16] * 8]
    assert pad_to_bucket(17, buckets) is None
    with pytest.raises(ValueError):
        pad_to_bucket(0, buckets)


def test_configured_lists() -> None:
    assert parse_bucket_list("") is None
    assert parse_bucket_list("8, 1,4,4") == [1, 4, 8]
    with pytest.raises(ValueError, match="comma-separated"):
        parse_bucket_list("1,two")
    with pytest.raises(ValueError, match=">= 1"):
        normalize_buckets([0, 4])


def test_cpu_ladders_are_powers_of_two_with_the_maximum() -> None:
    assert cpu_decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert cpu_decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert cpu_piecewise_buckets(1024) == [16, 32, 64, 128, 256, 512, 1024]
    assert cpu_piecewise_buckets(10) == [10]


def test_kv_buckets_are_powers_of_4_from_256_up_to_the_context_length() -> None:
    assert kv_buckets(1024) == [256, 1024]
    assert kv_buckets(8192) == [256, 1024, 4096, 8192]
    assert kv_buckets(100) == [100]
    # A batch pads to the smallest KV bucket that holds its longest request.
    assert [kv_bucket(n, 8192) for n in (1, 256, 257, 5000, 9000)] == [256, 256, 1024, 8192, 8192]
    assert kv_bucket(None, 8192) == 8192
