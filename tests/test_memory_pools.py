"""Each tag's memory moved into a pool of its own (`executor.weights.memory.move_storages`, what
`TaggedMemory.own_pools` does on CUDA), and the pools retired, never destroyed
(`ops.allocator`): the logic on the CPU, with stand-ins for CUDA's memory pools. The CUDA
release itself is
`test_memory_release.py::test_release_gives_memory_back_before_answering_and_resume_restores_it`."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import ClassVar

import torch
from torch import nn

from executor.weights.memory import allocating_in, move_storages, new_pool
from ops import allocator


class Routed:
    """Counts the allocations made inside it (a stand-in for `torch.cuda.use_mem_pool`)."""

    def __init__(self) -> None:
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.entered += 1
        yield


def storages(module: nn.Module) -> list[tuple[torch.Tensor, int]]:
    seen: dict[int, tuple[torch.Tensor, int]] = {}
    for t in module.state_dict(keep_vars=True).values():
        s = t.untyped_storage()
        seen.setdefault(s.data_ptr(), (t, s.nbytes()))
    return list(seen.values())


def test_moved_weights_keep_their_values_their_ties_and_their_views() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64, bias=True))
    model[1].weight = model[0].weight  # tied, as an LM head to its embedding
    half = model[1].bias[:32]  # a view into a storage that moves
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = storages(model)
    assert len(moved) == 2  # the tied weight is one storage
    routed = Routed()
    move_storages(moved, routed, keep=True)
    assert routed.entered == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        model[0].weight[3, 5] = 7.0
        model[1].bias[1] = -2.0
    assert model[1].weight[3, 5] == 7.0  # still tied
    assert half[1] == -2.0  # the view follows its storage
    x = torch.tensor([3])
    assert torch.equal(model(x), model[1](model[0](x)))


def test_a_moved_kv_cache_comes_back_zeroed_at_its_size() -> None:
    k = torch.full((4, 8, 2), 3.0)
    view = k[1]
    nbytes = k.untyped_storage().nbytes()
    routed = Routed()
    move_storages([(k, nbytes)], routed, keep=False)
    assert routed.entered == 1
    assert k.untyped_storage().nbytes() == nbytes and k.shape == (4, 8, 2)
    assert not k.any() and not view.any()


def test_off_cuda_there_is_no_pool_and_allocations_go_where_they_did() -> None:
    cpu = torch.device("cpu")
    assert new_pool(cpu) is None
    with allocating_in(None)():
        t = torch.ones(3)
    assert t.sum() == 3


# --- ops.allocator: pools retired, never destroyed -------------------------------------------
class Pool:
    """A stand-in MemPool: records when it is destroyed (the real one's destructor empties its
    cache, which aborts the process while CUDA's allocator sees a capture under way)."""

    destroyed: ClassVar[list[str]] = []

    def __init__(self, name: str) -> None:
        self.name = name

    def __del__(self) -> None:
        Pool.destroyed.append(self.name)


class Owner:
    pass


def keeper_and_releases() -> tuple[allocator.PoolKeeper, list[tuple[int, str]]]:
    released: list[tuple[int, str]] = []
    Pool.destroyed = []
    return allocator.PoolKeeper(lambda index, pool: released.append((index, pool.name))), released


def test_a_discarded_pool_is_released_at_once_and_never_destroyed() -> None:
    keeper, released = keeper_and_releases()
    owner = Owner()
    a = keeper.keep(Pool("a"), owner, 0)
    keeper.keep(Pool("b"), owner, 1)
    keeper.discard(a)
    gc.collect()
    assert released == [(0, "a")] and len(keeper) == 1 and keeper.retired == 1
    assert Pool.destroyed == []  # the allocator frees its segments; the object lives on


def test_a_pool_whose_owner_is_gone_is_released_at_the_next_reap() -> None:
    keeper, released = keeper_and_releases()
    owner, other = Owner(), Owner()
    keeper.keep(Pool("a"), owner, 0)
    keeper.keep(Pool("b"), other, 0)
    del owner  # the collector frees an executor anywhere: inside a capture, say
    gc.collect()
    assert released == [] and Pool.destroyed == []  # nothing runs in the collector
    assert keeper.reap() == 1 and released == [(0, "a")] and len(keeper) == 1
    assert keeper.reap() == 0 and released == [(0, "a")]
    del keeper
    gc.collect()
    assert "a" not in Pool.destroyed  # a retired pool outlives even its keeper


def test_pools_held_at_exit_are_never_destroyed() -> None:
    keeper, released = keeper_and_releases()
    pool = Pool("kept")
    alive = weakref.ref(pool)
    keeper.keep(pool, Owner(), 0)
    del pool
    keeper.leave_to_exit()
    gc.collect()
    assert len(keeper) == 0 and alive() is not None and Pool.destroyed == [] and released == []
