"""The one contract every attention backend implements.

Eager steps call :meth:`AttentionBackend.init_forward_metadata` and put the returned object on
the batch (`fb.attn_metadata`). Graph runners use the capture/replay pair instead:
:meth:`init_graph_state` allocates every buffer a graph will read at its maximum size once;
:meth:`init_forward_metadata_capture` binds one bucket's slices of those buffers and fills
them through :meth:`init_forward_metadata_replay`, so what a graph saw at capture is what a
replay of the same batch gives it. A backend writes the two halves, `bind_graph_metadata` and
`fill_graph_metadata`; the runner keeps the bound object of each bucket. :meth:`forward`
stores the new tokens' K/V (`store_layer_kv`) and attends.

Class flags:
- `needs_cpu_seq_lens`: the backend reads `fb.seq_lens_cpu` / `fb.seq_lens_sum` (host
  mirrors). A backend that never does sets it False, and the executor can drop the mirror.
- `supports_graph_capture`: the backend implements the capture/replay hooks.
- `graph_kv_bounded`: under capture the backend reads a static number of keys per request
  (the graph's KV-length bound) instead of each request's own length, so DECODE graphs are
  captured per KV-length bucket as well (`executor.core.buckets.kv_buckets`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ops.kv_store import store_kv

if TYPE_CHECKING:
    from executor.core.forward_batch import ForwardBatch
    from executor.kv_cache import KVPool, ReqToTokenPool


class GraphCaptureUnsupportedError(RuntimeError):
    """The backend cannot run inside a captured graph; the runner falls back to eager."""


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention adds to plain causal softmax attention.

    - `sliding_window` W: a token at position p sees keys at positions p - W + 1 .. p (its last
      W keys, itself included; transformers' `kv_idx > q_idx - sliding_window`), and the
      backend never reads the K/V of older positions. None: every earlier key.
    - `logit_softcap` c: scores become c * tanh(scores / c) before the mask and softmax.
    """

    sliding_window: int | None = None
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be > 0, got {self.logit_softcap}")


PLAIN_LAYER = LayerAttention()


@dataclass(frozen=True)
class AttentionLayout:
    """Head geometry shared by every layer of the model, plus what each layer adds.

    `scaling` multiplies q.k (1/sqrt(head_dim) for most models; Gemma 2 sets its own).
    `layers[i]` is layer i's window and soft-cap; an empty tuple means plain attention
    everywhere.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    layers: tuple[LayerAttention, ...] = ()

    def layer(self, layer_id: int) -> LayerAttention:
        return self.layers[layer_id] if self.layers else PLAIN_LAYER

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The distinct window sizes of the model's layers, ascending."""
        return tuple(sorted({s.sliding_window for s in self.layers if s.sliding_window}))


class AttentionBackend(ABC):
    """Paged attention over `ReqToTokenPool` + `KVPool`."""

    name: ClassVar[str] = "base"
    needs_cpu_seq_lens: ClassVar[bool] = True
    supports_graph_capture: ClassVar[bool] = False
    graph_kv_bounded: ClassVar[bool] = False

    def __init__(
        self, layout: AttentionLayout, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool
    ) -> None:
        self.layout = layout
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool

    def graph_capture_refusal(self) -> str | None:
        """Why this backend instance cannot run inside a captured DECODE graph, or None."""
        if not self.supports_graph_capture:
            return f"attention backend {self.name!r} does not support graph capture"
        return None

    def compile_fingerprint(self) -> tuple[object, ...]:
        """What a step traced through this backend reads beyond its batch view: the layout,
        the cache tensors and the backend's own settings and tensors (a saved compiled step
        is keyed by it). Scratch state that changes from step to step (lists, objects) is
        not part of it."""
        pool = self.kv_pool
        own = {
            k: v
            for k, v in vars(self).items()
            if isinstance(v, bool | int | float | str | torch.Tensor)
        }
        return (self.name, self.layout, pool.k, pool.v, self.req_to_token_pool.req_to_token, own)

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

    def init_forward_metadata_capture(
        self, bs: int, num_tokens: int, fb_view: ForwardBatch, kv_bucket: int = 0
    ) -> Any:
        """The metadata object of one captured bucket: bound to slices of the graph buffers,
        then filled for `fb_view` exactly as a replay fills it. `kv_bucket` is the graph's
        KV-length bound (0 where the backend is not `graph_kv_bounded`)."""
        md = self.bind_graph_metadata(bs, num_tokens, fb_view, kv_bucket)
        self.init_forward_metadata_replay(md, bs, fb_view)
        return md

    def init_forward_metadata_replay(
        self,
        md: Any,
        bs: int,
        fb_view: ForwardBatch,
        seq_lens_cpu: torch.Tensor | None = None,
    ) -> None:
        """Refill a captured bucket's metadata `md` in place for this step's (padded) batch."""
        self.fill_graph_metadata(md, bs, fb_view, seq_lens_cpu)

    def bind_graph_metadata(
        self, bs: int, num_tokens: int, fb_view: ForwardBatch, kv_bucket: int = 0
    ) -> Any:
        """A metadata object for one bucket whose tensors are slices of the graph buffers
        allocated by `init_graph_state` (values are filled by `fill_graph_metadata`)."""
        raise GraphCaptureUnsupportedError(
            f"attention backend {self.name!r} does not support graph capture"
        )

    def fill_graph_metadata(
        self, md: Any, bs: int, fb_view: ForwardBatch, seq_lens_cpu: torch.Tensor | None
    ) -> None:
        """Write this step's runtime values into a bucket's bound buffers, in place; from
        device data only when `needs_cpu_seq_lens` is False. A DECODE graph's values are
        its rows and lengths (`fill_decode_metadata`); a backend whose graphs read more
        overrides this."""
        self.fill_decode_metadata(md, bs, fb_view.req_pool_indices, fb_view.seq_lens)

    def fill_decode_metadata(
        self, md: Any, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """Fill `md` for `bs` DECODE rows from device data only, in place (shared by eager,
        capture and replay)."""
        raise GraphCaptureUnsupportedError(
            f"attention backend {self.name!r} does not support graph capture"
        )

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


def store_layer_kv(
    kv_pool: KVPool, layer_id: int, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new tokens' K/V at `fb.out_cache_loc`; the layer's (K, V) buffers."""
    store_kv(kv_pool.k, kv_pool.v, layer_id, fb.out_cache_loc, k, v)
    return kv_pool.k_buffer(layer_id), kv_pool.v_buffer(layer_id)
