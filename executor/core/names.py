"""Every string the wire, the metrics and the config share: paths, modes, fill registries,
graph backends, the host-lengths policy.

Each enum value *is* the string the wire, the metrics and the config already use, so an enum
member compares equal to (and formats as) that string. Dashboards and alerts read these
names: they never change.
"""

from __future__ import annotations

from enum import StrEnum

from executor.core.forward_batch import ForwardMode


class Path(StrEnum):
    """The path one step ran (`ForwardStats.path`, the `path` metric label)."""

    EAGER = "eager"
    EAGER_NO_COPY = "eager_no_copy"
    FULL_GRAPH = "full_graph"
    PIECEWISE = "piecewise"
    SIMULATED = "simulated"  # the stand-in accelerator (`simulated_step_ms`): no model ran


class GraphMode(StrEnum):
    """Which graph paths are on (the `graph_mode` toggle; `auto` is resolved at start-up)."""

    NONE = "none"
    DECODE = "decode"
    EXTEND = "extend"
    BOTH = "both"

    @property
    def decode_graphs(self) -> bool:
        """DECODE batches replay a full graph when they fit a bucket."""
        return self in (GraphMode.DECODE, GraphMode.BOTH)

    @property
    def piecewise(self) -> bool:
        """EXTEND batches run the piecewise graphs when they fit a bucket."""
        return self in (GraphMode.EXTEND, GraphMode.BOTH)

    @property
    def piecewise_mode(self) -> str | None:
        """This mode's name when it enables the piecewise path, else None (for
        `attention.decide_needs_cpu_seq_lens`)."""
        return self.value if self.piecewise else None


class SeqLensPolicy(StrEnum):
    """The `needs_cpu_seq_lens` toggle as asked: whether batches carry the host lengths."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


MODE_NAMES = {
    ForwardMode.EXTEND: "extend",
    ForwardMode.DECODE: "decode",
    ForwardMode.IDLE: "idle",
    ForwardMode.VERIFY: "verify",
}
MODES = tuple(MODE_NAMES.values())  # the `mode` label's values

# The input registries a step's fill statistics name (`fill_registry`, the `registry` label):
# the eager path's two, and the graph runners' two.
EAGER_DECODE = "eager_decode"
EAGER_EXTEND = "eager_extend"
GRAPH_DECODE = "graph_decode"
GRAPH_EXTEND = "graph_extend"
FILL_REGISTRIES = (EAGER_DECODE, EAGER_EXTEND, GRAPH_DECODE, GRAPH_EXTEND)

# What a captured graph is: a CUDA graph, an inductor-compiled callable (layer halves, or the
# whole step), or the CPU stand-in that only checks CUDA's capture rules.
GRAPH_BACKENDS = ("cuda", "compiled", "compiled_step", "standin")

# The torch.compile backend of the compiled graph backends: inductor, whose generated kernels
# fuse ops and reduce in their own order; or dynamo's `eager` backend (batch_invariant), whose
# graph calls the same torch ops, hence the same kernels, as the eager path.
INDUCTOR = "inductor"
EAGER_KERNELS = "eager"
GRAPH_COMPILERS = (INDUCTOR, EAGER_KERNELS)
