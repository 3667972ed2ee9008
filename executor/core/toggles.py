"""`Toggles`: the one home of the runtime toggles' state, read by the step and the runner.

Only :class:`executor.step.graph_control.GraphControl` changes it, on the device thread between
two steps (or, for a background capture, under the step lock); everything else reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from executor.core.names import GraphMode, SeqLensPolicy


class CaptureState(StrEnum):
    """Where the graph-mode toggle's background capture is."""

    IDLE = "idle"
    CAPTURING = "capturing"
    FAILED = "failed"


@dataclass
class Toggles:
    """The runtime toggles as they are now."""

    graph_mode: GraphMode
    seq_lens_policy: SeqLensPolicy  # needs_cpu_seq_lens as asked
    needs_cpu_seq_lens: bool  # its effective value: whether batches carry seq_lens_cpu
    eager_input_no_copy: bool
    capture: CaptureState = CaptureState.IDLE
    capture_target: GraphMode | None = None  # the mode a running capture is for
    capture_error: str = ""  # why the last background capture failed

    @property
    def graph_capture(self) -> str:
        """The capture as the wire reports it: idle | capturing graph_mode=<mode> |
        failed: <reason>."""
        if self.capture is CaptureState.CAPTURING:
            return f"capturing graph_mode={self.capture_target}"
        if self.capture is CaptureState.FAILED:
            return f"failed: {self.capture_error}"
        return CaptureState.IDLE.value
