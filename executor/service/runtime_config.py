"""Runtime toggles: what can change on a live server, and the one place that changes them.

`RuntimeConfig` is the effective state; `RuntimeConfigUpdate` a partial change (None keeps a
value) whose values are checked when it is built (RuntimeConfigError, INVALID_ARGUMENT).
`RuntimeControl.update` applies one all-or-nothing: the executor's toggles are checked first
(ToggleRefusedError, FAILED_PRECONDITION, nothing changed), then everything is applied. It
runs on the device thread, so a change lands between two batches, never inside one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import structlog

from executor.config import NEEDS_CPU_SEQ_LENS_VALUES, RUNTIME_GRAPH_MODES
from executor.core.errors import RuntimeConfigError
from executor.model_executor import ModelExecutor
from executor.observability.logs import LEVELS, current_level, set_log_level
from executor.service import heap

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RuntimeConfig:
    """The runtime toggles as they are now."""

    eager_input_no_copy: bool
    needs_cpu_seq_lens: str  # auto | on | off, as asked
    needs_cpu_seq_lens_effective: bool  # whether batches carry seq_lens_cpu now
    graph_mode: str  # none | decode | extend | both
    log_level: str  # debug | info | warning | error
    trace_sample_ratio: float  # 0..1, for RPCs without a sampled caller
    # The graph-mode toggle's capture: idle | capturing graph_mode=<mode> | failed: <reason>.
    # A runtime graph_mode that needs a capture captures in the background while the
    # current path serves; `graph_mode` changes when it is done.
    graph_capture: str = "idle"


@dataclass(frozen=True)
class RuntimeConfigUpdate:
    """A change to the runtime toggles; None keeps a value. Malformed values raise
    RuntimeConfigError here, before anything is applied."""

    eager_input_no_copy: bool | None = None
    needs_cpu_seq_lens: str | None = None
    graph_mode: str | None = None
    log_level: str | None = None
    trace_sample_ratio: float | None = None

    def __post_init__(self) -> None:
        for name, allowed in (
            ("needs_cpu_seq_lens", NEEDS_CPU_SEQ_LENS_VALUES),
            ("graph_mode", RUNTIME_GRAPH_MODES),
            ("log_level", LEVELS),
        ):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise RuntimeConfigError(
                    f"{name} must be one of {', '.join(allowed)}, got {value!r}"
                )
        ratio = self.trace_sample_ratio
        if ratio is not None and not 0.0 <= ratio <= 1.0:  # also refuses NaN
            raise RuntimeConfigError(f"trace_sample_ratio must be in 0..1, got {ratio!r}")

    def changes(self) -> dict[str, object]:
        """The fields this update sets."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


def parse_assignments(pairs: list[str]) -> RuntimeConfigUpdate:
    """`["eager_input_no_copy=true", "log_level=debug"]` -> an update (the CLI's `config set`)."""
    values: dict[str, object] = {}
    known = {f.name for f in fields(RuntimeConfigUpdate)}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known:
            raise RuntimeConfigError(
                f"expected key=value with key one of {', '.join(sorted(known))}, got {pair!r}"
            )
        raw = raw.strip()
        if key == "eager_input_no_copy":
            if raw.lower() not in ("true", "false", "1", "0", "on", "off", "yes", "no"):
                raise RuntimeConfigError(f"eager_input_no_copy must be true or false, got {raw!r}")
            values[key] = raw.lower() in ("true", "1", "on", "yes")
        elif key == "trace_sample_ratio":
            try:
                values[key] = float(raw)
            except ValueError:
                raise RuntimeConfigError(
                    f"trace_sample_ratio must be a number, got {raw!r}"
                ) from None
        else:
            values[key] = raw.lower()
    return RuntimeConfigUpdate(**values)  # type: ignore[arg-type]


class RuntimeControl:
    """Reads and changes the runtime toggles of one server.

    `update` must run on the device thread (the server submits it as a device job); `current`
    may be called from any thread and returns the state after the last whole update.
    `set_trace_sample_ratio` and `on_change` come from the server: the tracer's sampler and
    the metrics' toggle gauges.
    """

    def __init__(
        self,
        executor: ModelExecutor,
        *,
        trace_sample_ratio: float,
        set_trace_sample_ratio: Callable[[float], None],
        on_change: Callable[[RuntimeConfig], None],
    ) -> None:
        self.executor = executor
        self._trace_sample_ratio = trace_sample_ratio
        self._set_trace_sample_ratio = set_trace_sample_ratio
        self._on_change = on_change
        self._current = self._read()
        on_change(self._current)
        executor.control.graph_mode_listener = self._capture_ended

    def refresh(self) -> None:
        """Publish the toggles as they are now (after the server started a background capture
        on its own, outside an update)."""
        self._current = self._read()
        self._on_change(self._current)

    def _capture_ended(self) -> None:
        """A background graph capture ended (on its thread): publish the new state; in a
        process that froze its heap, freeze what the capture loaded (`heap.refreeze`)."""
        heap.refreeze()
        self._current = self._read()
        log.warning(
            "runtime config updated",
            changed={"graph_mode": self._current.graph_mode},
            graph_capture=self._current.graph_capture,
        )
        self._on_change(self._current)

    def _read(self) -> RuntimeConfig:
        t = self.executor.step.toggles
        return RuntimeConfig(
            eager_input_no_copy=t.eager_input_no_copy,
            needs_cpu_seq_lens=str(t.seq_lens_policy),
            needs_cpu_seq_lens_effective=t.needs_cpu_seq_lens,
            graph_mode=str(t.graph_mode),
            log_level=current_level(),  # the process's logging, as configured
            trace_sample_ratio=self._trace_sample_ratio,
            graph_capture=t.graph_capture,
        )

    def current(self) -> RuntimeConfig:
        return self._current  # replaced whole (one reference), so never half-updated

    def update(self, update: RuntimeConfigUpdate) -> RuntimeConfig:
        """Apply `update` all-or-nothing; the effective config. Raises ToggleRefusedError
        (nothing changed) where the executor cannot honour it."""
        before = self._current
        self.executor.control.apply_toggles(
            eager_input_no_copy=update.eager_input_no_copy,
            needs_cpu_seq_lens=update.needs_cpu_seq_lens,
            graph_mode=update.graph_mode,
            background_capture=True,
        )
        # Neither of these can fail: their values were checked when `update` was built.
        if update.log_level is not None:
            set_log_level(update.log_level)
        if update.trace_sample_ratio is not None:
            self._set_trace_sample_ratio(update.trace_sample_ratio)
            self._trace_sample_ratio = update.trace_sample_ratio
        after = self._current = self._read()
        old, new = asdict(before), asdict(after)
        changed = {k: [old[k], new[k]] for k in new if old[k] != new[k]}
        if "graph_mode" in changed:  # captured here (tensor parallel: every rank, in step)
            heap.refreeze()
        # NOTE: warning, so that the change shows even when it raised the level past info.
        log.warning("runtime config updated", asked=update.changes(), changed=changed)
        self._on_change(after)
        return after
