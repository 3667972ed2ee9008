"""An UpdateWeights stream's receiver (`weights_service._receive`), without a server: each
tensor is handed to the staging as soon as its last chunk is verified and copied, before the
next tensor's chunks are read; a chunk out of place, corrupted, or past the last tensor, and a
stream cut short, are refused (DATA_LOSS). The tensors land in a staging arena that the next
update reuses."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from executor.core.errors import WeightChunkError
from executor.service.weights_codec import RawChunk
from executor.service.weights_service import _receive
from executor.weights.catalog import TensorSpec
from executor.weights.staging import ALIGN, StagingArena
from ops.checksum import checksum

TENSORS = [torch.arange(300, dtype=torch.float32), torch.ones(5, 7), torch.full((2,), 3.0)]


def _plan() -> Any:
    return SimpleNamespace(
        specs=[TensorSpec(f"t{i}", t.dtype, tuple(t.shape)) for i, t in enumerate(TENSORS)]
    )


def _chunks(size: int = 256) -> list[RawChunk]:
    out = []
    for i, t in enumerate(TENSORS):
        data = t.numpy().tobytes()
        for offset in range(0, len(data), size):
            part = data[offset : offset + size]
            out.append(RawChunk(i, offset, memoryview(part), checksum(part)))
    return out


def test_each_tensor_is_yielded_once_its_chunks_are_in_before_the_next_is_read() -> None:
    chunks, read = _chunks(), []

    def requests() -> Iterator[RawChunk]:
        for c in chunks:
            read.append(c.tensor)
            yield c

    seen = []
    for i, tensor in enumerate(_receive(requests(), _plan(), StagingArena())):
        assert torch.equal(tensor, TENSORS[i])
        seen.append((i, list(read)))
    # tensor 0 (1200 bytes: 5 chunks) came before any chunk of tensor 1 was read
    assert seen[0] == (0, [0] * 5)
    assert [i for i, _ in seen] == [0, 1, 2]


@pytest.mark.parametrize("fault", ["cut short", "out of order", "corrupted", "past the end"])
def test_a_bad_stream_is_refused(fault: str) -> None:
    chunks = _chunks()
    if fault == "cut short":
        chunks = chunks[:-1]
    elif fault == "out of order":
        chunks[1], chunks[2] = chunks[2], chunks[1]
    elif fault == "corrupted":
        c = chunks[3]
        chunks[3] = RawChunk(c.tensor, c.offset, memoryview(b"\xff" + bytes(c.data[1:])), c.crc32)
    else:
        chunks.append(RawChunk(len(TENSORS), 0, memoryview(b"x"), checksum(b"x")))
    with pytest.raises(WeightChunkError) as refused:
        list(_receive(iter(chunks), _plan(), StagingArena()))
    message = str(refused.value)
    assert {
        "cut short": "ended after",
        "out of order": "expected tensor 0 at offset 256",
        "corrupted": "CRC-32",
        "past the end": "3 tensors are complete",
    }[fault] in message, message


def test_the_next_update_lands_in_the_same_memory_and_a_release_lets_it_go() -> None:
    arena = StagingArena()
    first = list(_receive(iter(_chunks()), _plan(), arena))
    held = arena.nbytes
    assert held == sum(-(-t.nbytes // ALIGN) * ALIGN for t in TENSORS)
    places = [t.data_ptr() for t in first]
    assert all(p % ALIGN == 0 for p in places)  # torch's host allocator aligns the arena
    del first
    second = list(_receive(iter(_chunks(100)), _plan(), arena))  # other chunk sizes
    assert [t.data_ptr() for t in second] == places  # no new memory, no new page faults
    assert all(torch.equal(a, b) for a, b in zip(second, TENSORS, strict=True))
    assert arena.nbytes == held
    arena.drop()
    assert arena.nbytes == 0
    assert all(torch.equal(a, b) for a, b in zip(second, TENSORS, strict=True))  # still theirs
    third = list(_receive(iter(_chunks()), _plan(), arena))
    assert arena.nbytes == held and torch.equal(third[0], TENSORS[0])


def test_an_arena_grows_for_a_larger_update_and_refuses_to_hand_out_more() -> None:
    arena = StagingArena()
    arena.begin([10])
    small = arena.nbytes
    arena.take(10)
    with pytest.raises(RuntimeError):
        arena.take(ALIGN)
    arena.begin([10, 3 * ALIGN])
    assert arena.nbytes == 4 * ALIGN > small


def test_a_release_during_an_update_leaves_its_tensors_whole() -> None:
    """A release drops the arena from the device thread while a stream is received: the
    tensors taken keep their memory, the next ones get their own."""
    arena = StagingArena()
    arena.begin([8, 8])
    first = arena.take(8)
    first[:] = 7
    arena.drop()
    second = arena.take(8)
    assert second.numel() == 8 and second.data_ptr() != first.data_ptr()
    assert bool((first == 7).all()) and arena.nbytes == 0
