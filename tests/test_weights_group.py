"""The weights group's transfers keep the sender going while the receiver stages
(`executor.weights.group`): receives and sends are posted `RECEIVE_AHEAD` tensors ahead, in
order. Checked on a process group stand-in that logs each post and wait; the transfers
themselves are `test_weight_service.py`'s (a trainer and a served executor over gloo)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from executor.core.errors import ModelStateError
from executor.weights.group import RECEIVE_AHEAD, GroupSpec, WeightsGroup


class Work:
    def __init__(self, log: list[str], n: int, fail: bool) -> None:
        self.log, self.n, self.fail = log, n, fail

    def wait(self) -> None:
        self.log.append(f"wait {self.n}")
        if self.fail:
            raise RuntimeError("a member died")


class Pg:
    """Logs each broadcast's start and wait; fills a received tensor with its index."""

    def __init__(self, fail_at: int = -1) -> None:
        self.log: list[str] = []
        self.n = 0
        self.fail_at = fail_at

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> Work:
        self.log.append(f"post {self.n}")
        tensors[0].fill_(self.n)
        work = Work(self.log, self.n, self.n == self.fail_at)
        self.n += 1
        return work


def group(pg: Pg) -> WeightsGroup:
    g = WeightsGroup.__new__(WeightsGroup)  # no rendezvous: the stand-in process group
    g.spec, g.device, g.failed, g.pg = (
        GroupSpec("127.0.0.1", 1, 1, 2),
        torch.device("cpu"),
        None,
        pg,
    )
    return g


def test_receives_are_posted_ahead_and_handed_out_in_order() -> None:
    pg = Pg()
    shapes = [((2, 3), torch.float32), ((4,), torch.int64), ((1,), torch.bfloat16)] * 2
    got = []
    for tensor in group(pg).receive(shapes, src=0):
        got.append((pg.log[-1], tensor))
    assert [t.shape for _, t in got] == [torch.Size(s) for s, _ in shapes]
    assert [t.dtype for _, t in got] == [d for _, d in shapes]
    assert [int(t.flatten()[0]) for _, t in got] == list(range(6))  # in order
    # When tensor k is handed out, tensors up to k + RECEIVE_AHEAD were already posted.
    posted = [
        sum(e.startswith("post") for e in pg.log[: pg.log.index(f"wait {k}")]) for k in range(6)
    ]
    assert posted == [min(k + RECEIVE_AHEAD + 1, 6) for k in range(6)]


def test_sends_keep_ahead_and_all_are_waited_for() -> None:
    pg = Pg()
    group(pg).send((torch.zeros(3) for _ in range(5)), src=0)
    assert sorted(pg.log) == sorted(
        [f"post {k}" for k in range(5)] + [f"wait {k}" for k in range(5)]
    )
    assert pg.log.index(f"post {RECEIVE_AHEAD}") < pg.log.index("wait 0")  # ahead
    assert pg.log[-1] == "wait 4"


def test_a_failed_receive_fails_the_group() -> None:
    g = group(Pg(fail_at=1))
    with pytest.raises(ModelStateError, match="a member died"):
        list(g.receive([((2,), torch.float32)] * 4, src=0))
    assert g.failed is not None
    with pytest.raises(ModelStateError, match="failed earlier"):
        g.broadcast(torch.zeros(1), 0)
