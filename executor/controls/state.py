"""Per-request controls kept at the request's row, on the device, with a host mirror.

`RowControlState` holds one entry per row of the row table (row 0 unused): the penalties,
the output start and min-tokens length, the logit bias (ids and values, padded to the cap),
the min-tokens suppression set (EOS and stop ids, as a bitmask) and the allowed-token set
(allowed minus banned, as a bitmask; all ones when the request restricts nothing). Every
entry starts neutral. A step writes the rows its batch sets or releases (:meth:`apply`,
from the step's staged upload, in the order of `RowValues.staged_fields`) and can put them back (:meth:`undo`); the host mirror holds
what admission needs to decide, without reading the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor.core.controls_types import mask_words
from ops.h2d_staging import StagedField

PREFIX = "controls."


@dataclass(frozen=True)
class RowValues:
    """New values for `rows` ([n] int64), host arrays, one entry per row."""

    rows: np.ndarray
    repetition: np.ndarray  # [n] float32
    frequency: np.ndarray
    presence: np.ndarray
    prompt_len: np.ndarray  # [n] int64
    min_len: np.ndarray  # [n] int64: prompt_len + min_tokens, 0 = off
    bias_ids: np.ndarray  # [n, max_logit_bias] int64
    bias_values: np.ndarray  # [n, max_logit_bias] float32
    suppress_words: np.ndarray  # [n, W] int32
    token_words: np.ndarray  # [n, W] int32
    has_penalties: np.ndarray  # [n] bool
    has_bias: np.ndarray
    has_token_mask: np.ndarray

    # The rows, then the device tensors in the order of `DEVICE_FIELDS`, as staged fields.
    def staged_fields(self) -> list[StagedField]:
        fields = [StagedField(PREFIX + "rows", torch.from_numpy(self.rows), torch.int64)]
        for name in DEVICE_FIELDS:
            value = torch.from_numpy(getattr(self, name))
            fields.append(StagedField(PREFIX + name, value, value.dtype))
        return fields


# Each device tensor of the state, by its RowValues name.
DEVICE_FIELDS = (
    "repetition",
    "frequency",
    "presence",
    "prompt_len",
    "min_len",
    "bias_ids",
    "bias_values",
    "suppress_words",
    "token_words",
)
# The host mirror's arrays, by the same names.
_HOST = ("prompt_len", "min_len", "suppress_words", "token_words") + (
    "has_penalties",
    "has_bias",
    "has_token_mask",
)


@dataclass(frozen=True)
class StateUndo:
    rows: torch.Tensor  # device [n]
    device: dict[str, torch.Tensor]
    host_rows: np.ndarray
    host: dict[str, np.ndarray]


class RowControlState:
    def __init__(
        self, max_reqs: int, vocab_size: int, max_logit_bias: int, device: torch.device
    ) -> None:
        n, words = max_reqs + 1, mask_words(vocab_size)
        self.vocab_size = vocab_size
        self.words = words
        self.max_logit_bias = max_logit_bias
        self.device: dict[str, torch.Tensor] = {}
        neutral = self.neutral(np.arange(n, dtype=np.int64))
        for name in DEVICE_FIELDS:
            self.device[name] = torch.from_numpy(getattr(neutral, name).copy()).to(device)
        self.host: dict[str, np.ndarray] = {name: getattr(neutral, name).copy() for name in _HOST}
        self.active = np.zeros(n, dtype=bool)  # the row uses any control
        # Some row does: kept with `active` (it changes only when controls are written), so
        # a step in a server where no row uses a control looks once, without a numpy call.
        self.any_active = False

    def neutral(self, rows: np.ndarray) -> RowValues:
        """The values of a row with no controls."""
        n, b, w = len(rows), self.max_logit_bias, self.words
        zeros_f = np.zeros(n, dtype=np.float32)
        no = np.zeros(n, dtype=bool)
        return RowValues(
            rows=rows,
            repetition=np.ones(n, dtype=np.float32),
            frequency=zeros_f,
            presence=zeros_f.copy(),
            prompt_len=np.zeros(n, dtype=np.int64),
            min_len=np.zeros(n, dtype=np.int64),
            bias_ids=np.zeros((n, b), dtype=np.int64),
            bias_values=np.zeros((n, b), dtype=np.float32),
            suppress_words=np.zeros((n, w), dtype=np.int32),
            token_words=np.full((n, w), -1, dtype=np.int32),
            has_penalties=no,
            has_bias=no.copy(),
            has_token_mask=no.copy(),
        )

    def apply(
        self, values: RowValues, rows: torch.Tensor, device_values: Sequence[torch.Tensor]
    ) -> StateUndo:
        """Write `values`: on the device from their staged copies (`rows`, then one tensor per
        `DEVICE_FIELDS` name, in that order), in the host mirror from `values`; the undo."""
        undo = StateUndo(
            rows=rows,
            device={name: t.index_select(0, rows) for name, t in self.device.items()},
            host_rows=values.rows,
            host={name: a[values.rows].copy() for name, a in self.host.items()},
        )
        for name, staged in zip(DEVICE_FIELDS, device_values, strict=True):
            self.device[name].index_copy_(0, rows, staged)
        for name, a in self.host.items():
            a[values.rows] = getattr(values, name)
        self._refresh_active(values.rows)
        return undo

    def undo(self, undo: StateUndo) -> None:
        for name, t in self.device.items():
            t.index_copy_(0, undo.rows, undo.device[name])
        for name, a in self.host.items():
            a[undo.host_rows] = undo.host[name]
        self._refresh_active(undo.host_rows)

    def _refresh_active(self, rows: np.ndarray) -> None:
        h = self.host
        self.active[rows] = (
            h["has_penalties"][rows]
            | h["has_bias"][rows]
            | h["has_token_mask"][rows]
            | (h["min_len"][rows] > 0)
        )
        self.any_active = bool(self.active.any())
