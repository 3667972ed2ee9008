"""Errors the executor raises for what it refuses. The gRPC layer maps each to a status code."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass


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


# --- fault injection (tests only) -------------------------------------------------------
# Fault injection for tests: make a chosen call of a step's phase (admission, staging, the
# model's forward, the sampler, the read of its results) or of the response encoder raise, to
# prove a refused or failed step leaves nothing behind.
#
# Not reachable from the wire: no setting, environment variable or RPC arms it. A test builds a
# `FaultInjector`, hands it to `ModelExecutor.hooks.faults` (sites `admit`, `stage`, `forward`,
# `sampler`, `read`) and
# `ExecutorServicer.faults` (site `encoder`) in-process, and arms one site for a chosen call:
#
#     faults = FaultInjector()
#     executor.hooks.faults = faults
#     faults.arm("sampler", on_call=1)   # the next step's sampling raises InjectedFault
#
# Each armed fault fires once. `admit` is raised as admission begins (a refusal: nothing
# changed), `stage` after every feature applied its part, `forward` after the model ran (its
# K/V writes for the new tokens are done), `sampler` before the tokens are drawn (both in the
# launch), `read` once the results are on the host, before any commit; each after `admit` is
# undone like any failed step.
FAULT_SITES = ("admit", "stage", "forward", "sampler", "read", "encoder")


class InjectedFault(RuntimeError):
    """The error an armed site raises (a stand-in for a real bug: the answer is INTERNAL)."""


class FaultInjector:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, int] = {}  # site -> the call count that raises
        self.calls: Counter[str] = Counter()  # calls seen per site
        self.fired: list[str] = []  # sites that raised, in order

    def arm(self, site: str, on_call: int = 1) -> None:
        """Raise at `site` on its `on_call`-th call from now (1 = the next one)."""
        if site not in FAULT_SITES:
            raise ValueError(f"site must be one of {', '.join(FAULT_SITES)}, got {site!r}")
        if on_call < 1:
            raise ValueError(f"on_call must be >= 1, got {on_call}")
        with self._lock:
            self._armed[site] = self.calls[site] + on_call

    def check(self, site: str) -> None:
        """Count a call of `site`; raise InjectedFault if this is the armed one."""
        with self._lock:
            self.calls[site] += 1
            if self._armed.get(site) != self.calls[site]:
                return
            del self._armed[site]
            self.fired.append(site)
        raise InjectedFault(f"injected {site} fault (call {self.calls[site]})")


@dataclass
class TestHooks:
    """What tests install into the step (nothing in production sets them).

    `faults` raises at the step's sites (`FAULT_SITES`); `device_step_guard` wraps the
    device part of every step (its launch and its read) (tests install `executor.graphs.capture_rules.HostReadGuard` there to
    prove every host read is counted).
    """

    __test__ = False  # not a pytest class

    faults: FaultInjector | None = None
    device_step_guard: Callable[[], AbstractContextManager[object]] = nullcontext

    def check(self, site: str) -> None:
        if self.faults is not None:
            self.faults.check(site)


class KVStateError(RuntimeError):
    """A KV import or export the cache's current state forbids (a target row or slot a live
    request holds; a source slot no live request holds); nothing was changed. Maps to
    FAILED_PRECONDITION."""


class KVChecksumError(ValueError):
    """A KV chunk whose bytes do not match its checksum or its declared size: the data was
    damaged on the way; nothing was changed. Maps to DATA_LOSS."""


class LoraAdapterError(ValueError):
    """An adapter that does not fit the model (wrong shapes, an unknown target module, a rank
    over the cap, a PEFT option it cannot apply) or files that are not a PEFT LoRA adapter;
    nothing was changed. Maps to INVALID_ARGUMENT."""


class LoraStateError(RuntimeError):
    """A load or unload the adapters' state forbids (LoRA off, a name already loaded, an
    adapter live rows use); nothing was changed. Maps to FAILED_PRECONDITION."""


class LoraNotFoundError(LoraStateError):
    """An unload of a name no loaded adapter has. Maps to NOT_FOUND."""


class LoraSlotsFullError(LoraStateError):
    """A load with every adapter slot taken. Maps to RESOURCE_EXHAUSTED."""


class ModelStateError(RuntimeError):
    """A call the model's state forbids now: its memory is released, its weights await an
    update, a quantized tensor cannot take the new values, another weight or memory call is
    in progress; nothing was changed. Maps to FAILED_PRECONDITION."""


class WeightChunkError(ValueError):
    """A weight-update chunk whose checksum, size or place is wrong: the data was damaged on
    the way; nothing was changed. Maps to DATA_LOSS."""
