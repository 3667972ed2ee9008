"""Errors the executor raises for what it refuses. The gRPC layer maps each to a status code."""

from __future__ import annotations


class BatchValidationError(ValueError):
    """A batch breaks a rule; nothing was changed. Maps to INVALID_ARGUMENT.

    `field` names the ForwardBatch field (or `field[i]` for one entry) and `rule` says what
    it must satisfy, so a scheduler author can act on the message alone.
    """

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


class BatchTooLargeError(BatchValidationError):
    """A batch exceeds the executor's size limits (requests or tokens). Maps to RESOURCE_EXHAUSTED."""


class ToggleRefusedError(RuntimeError):
    """A runtime toggle the executor cannot honour in its current state (e.g.
    `needs_cpu_seq_lens=off` with a backend that reads host lengths); nothing was changed.
    Maps to FAILED_PRECONDITION."""


class StartupCancelled(Exception):
    """Start-up was asked to stop (a shutdown signal while loading or capturing graphs): the
    executor stops at the next graph bucket and is never used."""


class RuntimeConfigError(ValueError):
    """A runtime-config update with a malformed value (unknown log level, ratio outside 0..1);
    nothing was changed. Maps to INVALID_ARGUMENT."""
