"""The one contract every attention backend implements.

Eager steps call :meth:`AttentionBackend.init_forward_metadata` and put the returned object on
the batch (`fb.attn_metadata`). Graph runners use the capture/replay pair instead:
:meth:`init_graph_state` allocates every buffer a graph will read at its maximum size once;
:meth:`init_forward_metadata_capture` binds slices of them for one bucket and then fills them
through :meth:`init_forward_metadata_replay`, so capture and replay share one code path (the
seeds' "Pattern A"). :meth:`forward` stores the new tokens' K/V and attends.

Class flags:
- `needs_cpu_seq_lens`: the backend reads `fb.seq_lens_cpu` / `fb.seq_lens_sum` (host
  mirrors). A backend that never does sets it False, and the executor can drop the mirror.
- `supports_graph_capture`: the backend implements the capture/replay hooks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ops.kv_store import store_kv

if TYPE_CHECKING:
    from executor.forward_batch import ForwardBatch
    from executor.kv_cache import KVPool, ReqToTokenPool


class GraphCaptureUnsupportedError(RuntimeError):
    """The backend cannot run inside a captured graph; the runner falls back to eager."""


@dataclass(frozen=True)
class AttentionLayout:
    """Head geometry shared by every layer of the model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    """Paged attention over `ReqToTokenPool` + `KVPool`."""

    @property
    def can_capture(self) -> bool:
        """Whether this backend instance can run inside a captured graph."""
        return self.supports_graph_capture and self.graph_capture_refusal is None

    name: ClassVar[str] = "base"
    needs_cpu_seq_lens: ClassVar[bool] = True
    supports_graph_capture: ClassVar[bool] = False

    def __init__(
        self, layout: AttentionLayout, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool
    ) -> None:
        self.layout = layout
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        # Why this instance refuses graph capture although its class supports it (e.g. a
        # device where its captured gathers would not fit); None: `supports_graph_capture`.
        self.graph_capture_refusal: str | None = None
        # Metadata of every captured bucket, bound to slices of the graph buffers.
        # Keyed by (batch-size bucket, KV-length bucket).
        self._graph_metadata: dict[tuple[int, int], Any] = {}

    # --- eager -------------------------------------------------------------------------
    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> Any:
        """Build this step's metadata object; may read host mirrors if `needs_cpu_seq_lens`."""

    # --- graphs ------------------------------------------------------------------------
    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate every metadata buffer a captured graph reads, at its maximum size."""
        raise GraphCaptureUnsupportedError(
            f"attention backend {self.name!r} does not support graph capture"
        )

    def graph_kv_buckets(self) -> list[int]:
        """The KV-length buckets a DECODE graph is captured at, per batch-size bucket. `[0]`
        (one graph per batch size) for a backend whose captured work follows each request's
        real length; a backend that gathers a static KV bound under capture lists bounds, so
        a batch pays for the bucket its contexts need, not for `max_context_len`."""
        return [0]

    def graph_kv_bucket(self, seq_len_bound: int | None) -> int:
        """The KV bucket of a batch whose longest request is at most `seq_len_bound` tokens
        (None: unknown, the largest)."""
        return 0

    def init_forward_metadata_capture(
        self, bs: int, num_tokens: int, fb_view: ForwardBatch, kv_bucket: int = 0
    ) -> Any:
        """Bind this bucket's buffer slices into a metadata object, then fill them through
        replay: capture and replay share one code path (the seeds' Pattern A), so what a
        graph saw at capture is what a replay of the same batch gives it."""
        md = self.bind_graph_metadata(bs, num_tokens, fb_view, kv_bucket)
        self._graph_metadata[(bs, kv_bucket)] = md
        self.init_forward_metadata_replay(bs, fb_view, kv_bucket=kv_bucket)
        return md

    def init_forward_metadata_replay(
        self,
        bs: int,
        fb_view: ForwardBatch,
        seq_lens_cpu: torch.Tensor | None = None,
        kv_bucket: int = 0,
    ) -> None:
        """Refill the bucket's bound buffers in place for this step's (padded) batch."""
        md = self._graph_metadata.get((bs, kv_bucket))
        if md is None:
            raise KeyError(
                f"no captured bucket for bs={bs}, kv={kv_bucket} "
                f"(captured: {sorted(self._graph_metadata)})"
            )
        self.fill_graph_metadata(md, bs, fb_view, seq_lens_cpu)

    def check_decode_bucket(
        self, bs: int, num_tokens: int, fb_view: ForwardBatch, graph_state: object, max_bs: int
    ) -> None:
        """The precondition of a decode-only capture: graph state allocated, a DECODE batch
        (one token per request), a bucket within the allocated maximum."""
        if graph_state is None:
            raise RuntimeError("init_graph_state must run before capture")
        if not fb_view.forward_mode.is_decode() or num_tokens != bs:
            raise GraphCaptureUnsupportedError(
                f"attention backend {self.name!r} captures DECODE batches only "
                f"(got {fb_view.forward_mode.name} with bs={bs}, num_tokens={num_tokens})"
            )
        if bs > max_bs:
            raise ValueError(f"bucket bs={bs} exceeds max_bs={max_bs}")

    def bind_graph_metadata(
        self, bs: int, num_tokens: int, fb_view: ForwardBatch, kv_bucket: int = 0
    ) -> Any:
        """A metadata object for one bucket whose tensors are slices of the graph buffers
        allocated by `init_graph_state` (values are filled by `fill_graph_metadata`);
        `kv_bucket` is one of `graph_kv_buckets()`."""
        raise GraphCaptureUnsupportedError(
            f"attention backend {self.name!r} does not support graph capture"
        )

    def fill_graph_metadata(
        self, md: Any, bs: int, fb_view: ForwardBatch, seq_lens_cpu: torch.Tensor | None
    ) -> None:
        """Write this step's runtime values into a bucket's bound buffers, in place; from
        device data only when `needs_cpu_seq_lens` is False."""
        raise GraphCaptureUnsupportedError(
            f"attention backend {self.name!r} does not support graph capture"
        )

    def store_kv(
        self, layer_id: int, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V at `fb.out_cache_loc`; the layer's (K, V) buffers."""
        store_kv(self.kv_pool.k, self.kv_pool.v, layer_id, fb.out_cache_loc, k, v)
        return self.kv_pool.k_buffer(layer_id), self.kv_pool.v_buffer(layer_id)

    def graph_seq_len_fill_value(self) -> int:
        """`seq_lens` of a padded row: one token, read from the reserved slot 0 via row 0."""
        return 1

    # --- compute -----------------------------------------------------------------------
    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """Store K/V of the new tokens at `fb.out_cache_loc`, then attend.

        q [T, Hq, D], k and v [T, Hk, D] -> output [T, Hq, D].
        """
