"""Host memory in a mapping of its own (`ops.host_pages`): the CPU's KV cache."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from executor.graphs.idle_gate import IdleGate
from executor.kv_cache import KVPool
from executor.model_executor import ModelExecutor
from executor.weights.memory import resident_bytes
from ops import host_pages
from ops.host_pages import HostPages

MIB = 1 << 20
MakeExecutor = Callable[..., ModelExecutor]


def test_pages_read_zero_and_a_commit_backs_them_without_changing_a_byte() -> None:
    pages = HostPages(64 * MIB)
    assert not pages.bytes.any()  # nothing written: zero (the pages read are not backed)
    pages.bytes[:4096] = 7
    before = resident_bytes()
    pages.commit(background=True)  # while this thread writes into it
    pages.bytes[-4096:] = 9
    pages.wait()
    if not pages.committed:
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident_bytes() - before >= 0.9 * 60 * MIB
    assert int(pages.bytes[:4096].sum()) == 7 * 4096 and int(pages.bytes[-4096:].sum()) == 9 * 4096
    assert int(pages.bytes.sum()) == 16 * 4096  # nothing else written


def test_a_release_gives_the_pages_back_in_place_and_they_read_zero() -> None:
    pages = HostPages(64 * MIB)
    view = pages.view(torch.float32, (16, MIB))
    view.fill_(1.5)  # every page backed
    address = view.data_ptr()
    assert pages.resident_bytes() == 64 * MIB
    before = resident_bytes()
    assert pages.release() == 64 * MIB  # what it gave back
    assert before - resident_bytes() >= 0.9 * 64 * MIB and pages.resident_bytes() == 0
    assert view.data_ptr() == address and not view.any()
    view[3, 5] = 2.0  # usable at once, the same view
    pages.commit()
    assert float(view.sum()) == 2.0


def test_a_release_stops_a_background_commit_under_way_and_a_commit_backs_them_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release while the idle-time commit runs does not back the rest only to drop it."""
    populated: list[int] = []
    madvise = host_pages._madvise
    started = threading.Event()

    def slow(address: int, length: int, advice: int) -> int:
        if advice == host_pages.MADV_POPULATE_WRITE:
            populated.append(length)
            started.set()
            time.sleep(0.02)
        return madvise(address, length, advice)

    monkeypatch.setattr(host_pages, "_madvise", slow)
    pages = HostPages(128 * MIB)  # 32 chunks: at least 0.64 s of populate here
    pages.commit(background=True)
    assert started.wait(5)
    freed = pages.release()
    assert len(populated) < 128 * MIB // host_pages.COMMIT_CHUNK // 2  # stopped, not finished
    assert freed in (sum(populated), 0)  # what the chunks backed (0: no populate advice here)
    assert not pages.committed and pages._thread is None and not pages.bytes.any()
    populated.clear()
    pages.commit()  # the resume: every chunk, the stop forgotten
    if not pages.committed:
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert sum(populated) == 128 * MIB


def test_the_cpu_kv_cache_is_one_zero_mapping_laid_out_as_a_compile_workers() -> None:
    kv = KVPool(1000, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    assert kv.pages is not None and kv.pages.nbytes == kv.nbytes
    assert kv.k.shape == kv.v.shape == (4, 1001, 2, 8) and kv.k.dtype == torch.bfloat16
    assert kv.k.untyped_storage().data_ptr() == kv.v.untyped_storage().data_ptr()
    assert not kv.k.any() and not kv.v.any()
    kv.k[1, 2] = 1.0
    assert not kv.v.any()  # two halves, apart
    traced = KVPool(1000, 4, 2, 8, torch.bfloat16, torch.device("cpu"), zeroed=False)
    assert traced.pages is None  # a compile worker's: allocated, never written
    for ours, theirs in ((kv.k, traced.k), (kv.v, traced.v)):  # what a compiled step's key holds
        assert ours.stride() == theirs.stride()
        assert ours.storage_offset() == theirs.storage_offset()


def test_a_background_commit_inside_an_idle_gate_waits_while_a_step_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The populate holds the memory-map lock a step's allocations wait for: a server's
    commit (`KVPool.commit_pages` inside the runner's `IdleGate`) goes on only between steps."""
    chunks: list[int] = []
    madvise = host_pages._madvise

    def counted(address: int, length: int, advice: int) -> int:
        chunks.append(length)
        return madvise(address, length, advice)

    monkeypatch.setattr(host_pages, "_madvise", counted)
    gate, inside, go = IdleGate(), threading.Event(), threading.Event()

    @contextlib.contextmanager
    def yielding() -> Iterator[None]:
        with gate.yielding():
            inside.set()  # the gate counts steps from here on
            assert go.wait(5)  # the step below starts before the first chunk
            yield

    pages = HostPages(64 * MIB)
    pages.commit(background=True, yielding=yielding)
    assert inside.wait(5)
    gate.step_started()
    go.set()
    time.sleep(0.2)
    assert chunks == [] and not pages.committed  # a step runs: nothing populated
    gate.step_ended()
    pages.wait()  # after the linger, the whole commit
    if not pages.committed:
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert sum(chunks) == 64 * MIB and max(chunks) == host_pages.COMMIT_CHUNK
    assert gate.waits >= 1 and not gate._on


def test_an_executors_kv_pages_are_committed_inside_its_runners_idle_gate(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []
    monkeypatch.setattr(KVPool, "commit_pages", lambda self, yielding: calls.append(yielding))
    ex = make_executor()
    assert calls == [ex.runner.idle_gate.yielding]
