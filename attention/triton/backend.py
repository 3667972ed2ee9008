"""The Triton attention backend: paged decode with split KV, paged extend; the CUDA default.

Metadata is built on the device from `req_to_token`, `seq_lens` and the extend lengths
(never from host mirrors), sized by the batch's shape bounds in eager steps and by
preallocated buffers at their maximum size for captured DECODE graphs: capture binds a
bucket's slices of those buffers, then fills them through replay.

A layer with a sliding window W reads its own `kv_indptr` / `kv_indices`
(`metadata.windows[W]`), which list only the keys of each request's window: the last W for
DECODE, from the first new token's window start for EXTEND, so K/V of older positions are
never read.

`triton` is imported when a backend is created, not when this module is imported, so
CPU installs without triton can still list the backend and get a clear error for it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar

import torch

from attention.base import AttentionBackend, AttentionLayout, store_layer_kv
from attention.triton import launch
from ops.device_scope import check_device

if TYPE_CHECKING:
    from executor.core.forward_batch import ForwardBatch
    from executor.kv_cache import KVPool, ReqToTokenPool


@dataclass
class TritonDecodeMetadata:
    kv_indptr: torch.Tensor  # [bs + 1] int32: exclusive prefix sum of seq_lens
    kv_indices: torch.Tensor  # [>= sum(seq_lens)] int64: every request's slots, back to back
    num_kv_splits: torch.Tensor  # [bs] int32: 1..launch.split_cap
    att_out: torch.Tensor  # [bs, Hq, max_kv_splits, D] float32: stage-1 partial outputs
    att_lse: torch.Tensor  # [bs, Hq, max_kv_splits] float32: their log-sum-exps
    launch: launch.DecodeLaunch
    # Per window size W of the model's windowed layers: the last min(seq_len, W) keys of each
    # request (kv_indptr, kv_indices and num_kv_splits of their own; the rest shared).
    windows: dict[int, TritonDecodeMetadata] = field(default_factory=dict)


@dataclass
class TritonExtendMetadata:
    qo_indptr: torch.Tensor  # [bs + 1] int32: prefix sum of extend_seq_lens (offsets in T)
    kv_indptr: torch.Tensor  # [bs + 1] int32: prefix sum of extend_prefix_lens
    kv_indices: torch.Tensor  # [>= sum(prefix lens)] int64: cached-prefix slots
    launch: launch.ExtendLaunch
    # batch_invariant: kv_indptr / kv_indices list every key of the request (prefix and this
    # step's tokens, all in the cache by then) and the kernel masks by absolute position, so
    # a query's keys are summed in the same blocks however its prompt was chunked. Sliding
    # windows are masks then, not shorter lists (`windows` stays empty).
    all_cached: bool = False
    # Per window size W: the prefix keys inside the first new token's window only.
    windows: dict[int, TritonExtendMetadata] = field(default_factory=dict)


@dataclass
class _GraphBuffers:
    kv_indptr: torch.Tensor  # [max_bs + 1] int32
    kv_indices: torch.Tensor  # [max_bs * max_context_len] int64
    num_kv_splits: torch.Tensor  # [max_bs] int32
    att_out: torch.Tensor  # [max_bs, Hq, max_kv_splits, D] float32
    att_lse: torch.Tensor  # [max_bs, Hq, max_kv_splits] float32
    # Per window W: (kv_indptr [max_bs + 1], kv_indices [max_bs * W], num_kv_splits [max_bs]).
    windows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )


class TritonAttnBackend(AttentionBackend):
    name: ClassVar[str] = "triton"
    needs_cpu_seq_lens: ClassVar[bool] = False
    supports_graph_capture: ClassVar[bool] = True

    @staticmethod
    def check_available(device: torch.device) -> None:
        """Raise ValueError unless this backend can run on `device`."""
        if device.type != "cuda":
            raise ValueError(
                f"attention backend 'triton' needs a CUDA device, but the executor runs on "
                f"{device.type}; use attention_backend=auto or torch_paged"
            )
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "attention backend 'triton' needs the triton package, which is not installed; "
                "use attention_backend=torch_paged or install triton"
            )

    def __init__(
        self,
        layout: AttentionLayout,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        *,
        max_kv_splits: int = launch.DEFAULT_MAX_KV_SPLITS,
        num_sms: int | None = None,
    ) -> None:
        """`num_sms` (default: the GPU's SM count, 1 off CUDA) sets how far decode splits."""
        super().__init__(layout, req_to_token_pool, kv_pool)
        # Lazily: only a created backend needs triton (tests on CPU use its interpreter).
        self.kernels: ModuleType = importlib.import_module("attention.triton.kernels")
        self.max_context_len = req_to_token_pool.max_context_len
        self.device = req_to_token_pool.req_to_token.device
        self.max_kv_splits = max_kv_splits
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(self.device).multi_processor_count
                if self.device.type == "cuda"
                else 1
            )
        self.num_sms = num_sms
        self._graph: _GraphBuffers | None = None
        # batch_invariant (set at start-up, `executor.models.batch_invariance`): decode splits
        # a request's keys by its own length only, and extend sums keys in blocks aligned to
        # absolute positions (`TritonExtendMetadata.all_cached`).
        self.batch_invariant = False

    def _decode_launch(self, bs: int) -> launch.DecodeLaunch:
        lay = self.layout
        return launch.decode_launch(
            bs,
            lay.num_heads,
            lay.num_kv_heads,
            lay.head_dim,
            self.max_kv_splits,
            self.num_sms,
            batch_invariant=self.batch_invariant,
        )

    # --- eager -------------------------------------------------------------------------
    def _check_current(self, what: str) -> None:
        """Triton launches on CUDA's current device: it must be the pool's (`cuda:N`)."""
        if self.device.type == "cuda":
            check_device(self.device, what)

    def init_forward_metadata(
        self, fb: ForwardBatch
    ) -> TritonDecodeMetadata | TritonExtendMetadata:
        self._check_current("triton attention metadata")
        bs = fb.batch_size
        kv_bound = fb.seq_len_bound or self.max_context_len
        capacity = launch.kv_indices_capacity(bs, kv_bound)
        if fb.forward_mode.is_extend():
            return self._extend_metadata(fb, capacity)
        lay = self.layout
        md = TritonDecodeMetadata(
            kv_indptr=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            kv_indices=torch.empty(capacity, dtype=torch.int64, device=self.device),
            num_kv_splits=torch.empty(bs, dtype=torch.int32, device=self.device),
            att_out=torch.empty(
                (bs, lay.num_heads, self.max_kv_splits, lay.head_dim),
                dtype=torch.float32,
                device=self.device,
            ),
            att_lse=torch.empty(
                (bs, lay.num_heads, self.max_kv_splits), dtype=torch.float32, device=self.device
            ),
            launch=self._decode_launch(bs),
        )
        for w in lay.sliding_windows:
            md.windows[w] = dataclasses.replace(
                md,
                kv_indptr=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
                kv_indices=torch.empty(
                    launch.kv_indices_capacity(bs, min(w, kv_bound)),
                    dtype=torch.int64,
                    device=self.device,
                ),
                num_kv_splits=torch.empty(bs, dtype=torch.int32, device=self.device),
                windows={},
            )
        self.fill_decode_metadata(md, bs, fb.req_pool_indices, fb.seq_lens)
        return md

    def _extend_metadata(self, fb: ForwardBatch, capacity: int) -> TritonExtendMetadata:
        assert fb.extend_prefix_lens is not None and fb.extend_seq_lens is not None
        bs = fb.batch_size
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
        qo_indptr[1:] = torch.cumsum(fb.extend_seq_lens, 0)
        # Every key (all_cached), or the cached prefix only.
        listed = fb.seq_lens if self.batch_invariant else fb.extend_prefix_lens
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
        kv_indptr[1:] = torch.cumsum(listed, 0)
        kv_indices = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.kernels.create_kv_indices(
            self.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            listed,
            kv_indptr,
            kv_indices,
        )
        max_extend_len = fb.extend_len_bound or fb.num_tokens
        md = TritonExtendMetadata(
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            launch=launch.extend_launch(
                bs, self.layout.num_heads, self.layout.head_dim, max_extend_len
            ),
            all_cached=self.batch_invariant,
        )
        if self.batch_invariant:
            return md
        for w in self.layout.sliding_windows:
            # The first new token (position prefix) sees keys from prefix + 1 - w on.
            first = torch.clamp(fb.extend_prefix_lens + 1 - w, min=0)
            lens = fb.extend_prefix_lens - first
            w_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
            w_indptr[1:] = torch.cumsum(lens, 0)
            w_indices = torch.empty(
                launch.kv_indices_capacity(bs, w), dtype=torch.int64, device=self.device
            )
            self.kernels.create_kv_indices(
                self.req_to_token_pool.req_to_token,
                fb.req_pool_indices,
                lens,
                w_indptr,
                w_indices,
                kv_start=first,
            )
            md.windows[w] = dataclasses.replace(md, kv_indptr=w_indptr, kv_indices=w_indices)
        return md

    # --- graphs (DECODE) ---------------------------------------------------------------
    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        lay = self.layout
        f32 = torch.float32
        self._graph = _GraphBuffers(
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            kv_indices=torch.zeros(
                launch.kv_indices_capacity(max_bs, self.max_context_len),
                dtype=torch.int64,
                device=self.device,
            ),
            num_kv_splits=torch.ones(max_bs, dtype=torch.int32, device=self.device),
            att_out=torch.zeros(
                (max_bs, lay.num_heads, self.max_kv_splits, lay.head_dim),
                dtype=f32,
                device=self.device,
            ),
            att_lse=torch.zeros(
                (max_bs, lay.num_heads, self.max_kv_splits), dtype=f32, device=self.device
            ),
            windows={
                w: (
                    torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
                    torch.zeros(
                        launch.kv_indices_capacity(max_bs, min(w, self.max_context_len)),
                        dtype=torch.int64,
                        device=self.device,
                    ),
                    torch.ones(max_bs, dtype=torch.int32, device=self.device),
                )
                for w in lay.sliding_windows
            },
        )

    def bind_graph_metadata(
        self, bs: int, num_tokens: int, fb_view: ForwardBatch, kv_bucket: int = 0
    ) -> TritonDecodeMetadata:  # the kernels read each request's length: one KV bucket
        g = self._graph
        if g is None:
            raise RuntimeError("init_graph_state must run before capture")
        if bs > g.num_kv_splits.shape[0]:
            raise ValueError(f"bucket bs={bs} exceeds max_bs={g.num_kv_splits.shape[0]}")
        md = TritonDecodeMetadata(
            kv_indptr=g.kv_indptr[: bs + 1],
            kv_indices=g.kv_indices,
            num_kv_splits=g.num_kv_splits[:bs],
            att_out=g.att_out[:bs],
            att_lse=g.att_lse[:bs],
            launch=self._decode_launch(bs),
        )
        for w, (indptr, indices, splits) in g.windows.items():
            md.windows[w] = dataclasses.replace(
                md,
                kv_indptr=indptr[: bs + 1],
                kv_indices=indices,
                num_kv_splits=splits[:bs],
                windows={},
            )
        return md

    def fill_decode_metadata(
        self,
        md: TritonDecodeMetadata,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> None:
        """Device-only, in place: kv_indptr, kv_indices, num_kv_splits of this (padded) batch."""
        self._check_current("triton graph metadata")
        seq_lens = seq_lens[:bs]
        md.kv_indptr[:1].zero_()
        md.kv_indptr[1:].copy_(torch.cumsum(seq_lens, 0))
        self.kernels.create_kv_indices(
            self.req_to_token_pool.req_to_token,
            req_pool_indices[:bs],
            seq_lens,
            md.kv_indptr,
            md.kv_indices,
        )
        launch.num_kv_splits(seq_lens, md.launch.split_cap, out=md.num_kv_splits)
        for w, wmd in md.windows.items():
            lens = torch.clamp(seq_lens, max=w)  # the last min(seq_len, w) keys
            wmd.kv_indptr[:1].zero_()
            wmd.kv_indptr[1:].copy_(torch.cumsum(lens, 0))
            self.kernels.create_kv_indices(
                self.req_to_token_pool.req_to_token,
                req_pool_indices[:bs],
                lens,
                wmd.kv_indptr,
                wmd.kv_indices,
                kv_start=seq_lens - lens,
            )
            launch.num_kv_splits(lens, wmd.launch.split_cap, out=wmd.num_kv_splits)

    # --- compute -----------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        self._check_current("triton attention")
        k_buffer, v_buffer = store_layer_kv(self.kv_pool, layer_id, fb, k, v)
        out = torch.empty_like(q)
        md = fb.attn_metadata
        spec = self.layout.layer(layer_id)
        window = spec.sliding_window
        if window is not None and not (isinstance(md, TritonExtendMetadata) and md.all_cached):
            md = md.windows[window]
        if isinstance(md, TritonDecodeMetadata):
            self.kernels.decode_attention(
                q,
                k_buffer,
                v_buffer,
                out,
                md.kv_indptr,
                md.kv_indices,
                md.num_kv_splits,
                md.att_out,
                md.att_lse,
                md.launch,
                self.layout.scaling,
                spec.logit_softcap,
            )
        else:
            assert isinstance(md, TritonExtendMetadata)
            self.kernels.extend_attention(
                q,
                k,
                v,
                out,
                k_buffer,
                v_buffer,
                md.qo_indptr,
                md.kv_indptr,
                md.kv_indices,
                md.launch,
                self.layout.scaling,
                spec.logit_softcap,
                window,
                all_cached=md.all_cached,
            )
        return out
