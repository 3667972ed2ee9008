"""The host-side shapes of the sampling controls: what a batch carries, before any device work.

`SamplingControls` is one request's controls (the proto's `SamplingControls`, same names and
rules); `RowControl` sets them on a row of the batch; `VocabMask` is one step's grammar mask;
`DeferredMask` is a mask that follows its batch on a stream, which sampling waits for.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from executor.core.errors import BatchValidationError

MASK_BITS = 32  # tokens per vocab-mask word
# What ForwardStats.control_rows counts, by name.
CONTROL_ROWS = ("penalties", "logit_bias", "min_tokens", "token_ids", "vocab_mask")


def mask_words(vocab_size: int) -> int:
    """Words per vocab-mask row."""
    return (vocab_size + MASK_BITS - 1) // MASK_BITS


@dataclass(frozen=True)
class SamplingControls:
    """One request's controls; defaults are neutral. The rules are the proto's."""

    repetition_penalty: float = 1.0  # 0 on the wire reads as 1 (off)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    banned_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    prompt_len: int = 0  # 0: the row's seq_len after the batch that sets the controls

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def uses_token_mask(self) -> bool:
        return bool(self.banned_token_ids or self.allowed_token_ids)

    @property
    def neutral(self) -> bool:
        return not (
            self.uses_penalties or self.logit_bias or self.min_tokens > 0 or self.uses_token_mask
        )


@dataclass(frozen=True)
class RowControl:
    """Set (replace) the controls of `row`, a row of the batch that carries it."""

    row: int
    controls: SamplingControls


@dataclass(frozen=True)
class VocabMask:
    """One step's vocabulary bitmask: `words` [m, mask_words] int32 (bit j of word w allows
    token 32*w + j); `rows` [m] positions in the batch, or None for every request in order."""

    words: torch.Tensor
    rows: torch.Tensor | None = None


class DeferredMaskTimeout(Exception):
    """The deferred mask did not come in time: the step fails, nothing is applied."""


class WaitBudget(Protocol):
    """How long one stream may keep the device waiting for its masks (the server's)."""

    def grant(self, timeout_s: float) -> float:
        """The longest this wait may last (at most `timeout_s`)."""
        ...

    def spend(self, seconds: float, cut: bool) -> None:
        """A wait lasted `seconds`; `cut`: it ended because the grant ran out first."""
        ...


@dataclass
class DeferredMask:
    """A batch's vocab mask that arrives after the batch (ForwardStream): the stream reader
    calls :meth:`fulfill` (or :meth:`fail`, when the mask is refused or can no longer come),
    sampling calls :meth:`wait`. Thread-safe; the first fulfil or fail wins."""

    batch_id: int
    _ready: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _mask: VocabMask | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)
    budget: WaitBudget | None = field(default=None, repr=False, compare=False)  # its stream's

    @property
    def settled(self) -> bool:
        """The mask (or its failure) came: `wait` returns at once."""
        return self._ready.is_set()

    def fulfill(self, mask: VocabMask) -> bool:
        """Hand over the mask; False if one was already given (this one is dropped)."""
        with self._lock:
            if self._ready.is_set():
                return False
            self._mask = mask
            self._ready.set()
            return True

    def fail(self, error: BaseException) -> bool:
        """Wake the waiter with `error` instead of a mask, so the device thread stops waiting
        at once (a refused mask, a stream that failed or ended); False if already settled."""
        with self._lock:
            if self._ready.is_set():
                return False
            self._error = error
            self._ready.set()
            return True

    def wait(self, timeout_s: float) -> VocabMask:
        budget = self.budget
        limit = timeout_s if budget is None else budget.grant(timeout_s)
        t0 = time.monotonic()
        came = self._ready.wait(limit)
        if budget is not None:
            budget.spend(time.monotonic() - t0, cut=not came and limit < timeout_s)
        if not came and limit < timeout_s:
            raise DeferredMaskTimeout(
                f"batch_id {self.batch_id}: vocab_mask_deferred: its deferred_mask did not come "
                f"within the {limit * 1000:.0f} ms left of its stream's mask-wait budget "
                "(deferred_mask_budget_s): the stream keeps the device waiting too long; "
                "nothing applied"
            )
        if not came:
            raise DeferredMaskTimeout(
                # Led by the batch id, as every stream failure's status message is.
                f"batch_id {self.batch_id}: vocab_mask_deferred: its deferred_mask did not "
                f"come within {timeout_s * 1000:.0f} ms (GetInfo.deferred_mask_timeout_ms); "
                "nothing applied"
            )
        if self._error is not None:
            raise self._error
        assert self._mask is not None
        return self._mask


def check_id_list(field_name: str, ids: tuple[int, ...], vocab_size: int, cap: int) -> None:
    """Refuse a token-id list longer than `cap` or holding an id outside the vocabulary."""
    if len(ids) > cap:
        raise BatchValidationError(field_name, f"has {len(ids)} entries; must be <= {cap}")
    for t in ids:
        if not 0 <= t < vocab_size:
            raise BatchValidationError(field_name, f"token id {t} is not in 0..{vocab_size - 1}")
