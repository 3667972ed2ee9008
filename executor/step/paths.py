"""The step's vocabulary: which path ran, which graph paths are on, the host-lengths policy.

Each value *is* the string the wire, the metrics and the config already use, so an enum
member compares equal to (and formats as) that string.
"""

from __future__ import annotations

from enum import StrEnum


class Path(StrEnum):
    """The path one step ran (`ForwardStats.path`, the `path` metric label)."""

    EAGER = "eager"
    EAGER_NO_COPY = "eager_no_copy"
    FULL_GRAPH = "full_graph"
    PIECEWISE = "piecewise"


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


class SeqLensPolicy(StrEnum):
    """The `needs_cpu_seq_lens` toggle as asked: whether batches carry the host lengths."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"
