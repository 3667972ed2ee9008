"""How the reference scheduler reaches an executor: a `forward` callable, or a pipe of steps
sent ahead and answered in order (`ForwardSession` on a ForwardStream, `InlinePipe` over a
callable), and the pipe that also takes a step's deferred vocab mask."""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from executor.core.controls_types import VocabMask
from executor.core.forward_batch import ForwardBatch


class StepResult(Protocol):
    @property
    def next_token_ids(self) -> object: ...


ForwardFn = Callable[[ForwardBatch], StepResult]


class StepPipe(Protocol):
    """Steps sent ahead and answered in order (a ForwardStream: `ForwardSession`)."""

    def send(self, batch: ForwardBatch) -> object: ...

    def recv(self) -> StepResult: ...


@runtime_checkable
class MaskPipe(StepPipe, Protocol):
    """A pipe that takes a step's vocab mask after the step (`ForwardSession`, `InlinePipe`):
    `send` a batch with `deferred_mask` set returns its batch_id for `send_mask`."""

    def send(self, batch: ForwardBatch) -> int: ...

    def send_mask(self, batch_id: int, mask: VocabMask) -> None: ...


class InlinePipe:
    """A `forward` callable as a pipe: each batch runs when sent (a batch with a deferred
    mask: when its mask comes, with the mask in the batch); its answer waits for recv."""

    def __init__(self, forward: ForwardFn) -> None:
        self.forward = forward
        self._answers: deque[StepResult] = deque()
        self._held: dict[int, ForwardBatch] = {}
        self._ids = itertools.count(1)

    def send(self, batch: ForwardBatch) -> int:
        batch_id = next(self._ids)
        if batch.deferred_mask is not None:
            self._held[batch_id] = batch
        else:
            self._answers.append(self.forward(batch))
        return batch_id

    def send_mask(self, batch_id: int, mask: VocabMask) -> None:
        batch = self._held.pop(batch_id)
        self._answers.append(
            self.forward(dataclasses.replace(batch, deferred_mask=None, vocab_mask=mask))
        )

    def recv(self) -> StepResult:
        return self._answers.popleft()
