"""The serving process's heap frozen out of the cyclic collector (`executor.service.heap`)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from executor.service import heap


class Node:
    link: object = None


def cycle() -> weakref.ref[Node]:
    """A reference cycle nothing else holds: only the cyclic collector frees it."""
    node = Node()
    node.link = node
    return weakref.ref(node)


@pytest.fixture
def thawed() -> Iterator[None]:
    assert not heap.frozen()
    try:
        yield
    finally:
        heap.thaw()


def test_a_frozen_heap_is_skipped_by_collections_and_what_comes_after_is_not(
    thawed: None,
) -> None:
    garbage = cycle()  # garbage before the freeze: the freeze's own collection frees it
    kept = Node()
    kept.link = kept
    alive = weakref.ref(kept)
    heap.freeze()
    assert heap.frozen() and garbage() is None
    del kept  # a frozen cycle turned garbage: no collection walks it now
    later = cycle()
    gc.collect()
    assert alive() is not None
    assert later() is None  # made after the freeze: collected as ever
    heap.thaw()
    gc.collect()
    assert alive() is None


def test_a_refreeze_freezes_what_was_added_only_in_a_frozen_process(thawed: None) -> None:
    before = gc.get_freeze_count()
    heap.refreeze()
    assert gc.get_freeze_count() == before  # nothing frozen: nothing to do
    heap.freeze()
    frozen = gc.get_freeze_count()
    added = [Node() for _ in range(1000)]
    heap.refreeze()
    assert gc.get_freeze_count() >= frozen + len(added)


def test_neither_freeze_counts_the_frozen_objects(
    thawed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gc.get_freeze_count` walks the whole permanent generation holding the GIL (tens of ms
    for a served model's heap): the capture thread's `refreeze` must not stall steps on it."""

    def walk() -> int:
        raise AssertionError("counted the frozen objects")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    heap.freeze(collect=False)
    added = [Node() for _ in range(10)]
    heap.refreeze()
    assert heap.frozen() and len(added) == 10


def test_a_freeze_without_its_collection_keeps_the_garbage_alive_now_and_collects_later(
    thawed: None,
) -> None:
    """`serve` freezes its imports' objects without a collection, then the rest collected."""
    kept = cycle()  # garbage at the first freeze: kept for the process's life
    heap.freeze(collect=False)
    assert heap.frozen()
    gc.collect()
    assert kept() is not None
    later = cycle()  # what the start-up added: the second freeze's collection frees it
    heap.freeze()
    assert later() is None and kept() is not None


def test_a_tp_worker_freezes_again_after_each_toggle_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under tensor parallelism every rank captures in step on rank 0's toggle command, outside
    any background thread: the worker's loop runs its hook (`heap.refreeze`) after each."""
    from executor import tp_worker
    from executor.parallel import broadcast

    commands = iter(
        [
            broadcast.Command(broadcast.TOGGLES, toggles={"graph_mode": "decode"}),
            broadcast.Command(broadcast.PING),
            broadcast.Command(broadcast.STOP),
        ]
    )
    seen: list[str] = []

    class Control:
        def apply_toggles(self, **toggles: object) -> None:
            seen.append(f"toggles {toggles['graph_mode']}")

    class Comm:
        rank, size = 1, 2

        def ping(self) -> None:
            seen.append("ping")

    class Executor:
        comm, control = Comm(), Control()

    monkeypatch.setattr(broadcast, "receive", lambda comm: next(commands))
    worker: Any = Executor()
    tp_worker.run_worker(worker, after_toggles=lambda: seen.append("refreeze"))
    assert seen == ["toggles decode", "refreeze", "ping", "ping"]
