"""Paged attention in plain torch, vectorized over the batch: the default on CPU.

Every request's keys are gathered through `req_to_token` into one padded
`[bs, kv_bound, Hk, D]` view, a boolean mask hides what lies past each request's length
(and, for EXTEND, what lies after each query's position), and a single batched SDPA call
attends. Once the metadata is built nothing depends on data: no host reads, no
data-dependent shapes, so the same forward runs inside a captured graph.

Shapes come from host ints only: eager steps use the batch's `seq_len_bound` /
`extend_len_bound` (see `ForwardBatch`); captured graphs use the static KV-length bucket the
DECODE runner captures them at (the backend is `graph_kv_bounded`), so a captured step gathers
what its batch's contexts need, not `max_context_len` for every request. Graph capture covers
DECODE (the full-graph path); EXTEND always runs eagerly (the piecewise path runs attention
between its captured pieces).

A layer with a sliding window W reads its own metadata (`TorchPagedMetadata.windows[W]`,
built once per step for every window size of the model): keys gathered from each request's
window start, at most W per DECODE query, so K/V of older positions are never read; a
position past the request's length reads the reserved slot 0. A plain layer pays nothing for
it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from attention.base import AttentionBackend, AttentionLayout, store_layer_kv
from attention.sdpa import sdpa, soft_cap
from ops.batch_invariant import aligned_kv_bound

if TYPE_CHECKING:
    from executor.core.forward_batch import ForwardBatch
    from executor.kv_cache import KVPool, ReqToTokenPool

# Gathered K+V per chunk of requests on CPU: about what a core's share of L2/L3 keeps warm
# (benchmarks/attention_backends.py compares it with one batch-wide gather).
CPU_GATHER_BYTES = 6 << 20


@dataclass
class TorchPagedMetadata:
    """What `forward` needs, for one step (eager) or one captured bucket (graph buffers).

    `kv_slots` beyond a request's length hold whatever its row holds (always a valid slot,
    at worst the reserved slot 0); `mask` hides them. In a window's metadata key j of request
    i is position `first_i + j` (`first_i`: the window start of its first query).
    """

    kv_slots: torch.Tensor  # [bs, kv_bound] int64: KV slot of key position j of request i
    mask: torch.Tensor  # [bs, 1, q_bound, kv_bound] bool: key j visible to query row q
    # EXTEND only (DECODE has one query per request, already in batch order):
    q_index: torch.Tensor | None = None  # [bs, q_bound] int64: token of T behind each query row
    out_index: torch.Tensor | None = None  # [T] int64: each token's row in [bs * q_bound]
    # Per window size of the model's windowed layers: the same batch over the windows' keys.
    windows: dict[int, TorchPagedMetadata] = field(default_factory=dict)

    @property
    def kv_bound(self) -> int:
        return int(self.kv_slots.shape[1])

    @property
    def q_bound(self) -> int:
        return int(self.mask.shape[2])


@dataclass
class _GraphBuffers:
    """Metadata storage for every captured bucket, allocated once at the largest size."""

    kv_slots: torch.Tensor  # [max_bs * max_context_len] int64, viewed [bs, kv_bucket]
    mask: torch.Tensor  # [max_bs * max_context_len] bool, viewed [bs, 1, 1, kv_bucket]
    max_bs: int
    # Per window W: [max_bs * min(W, max_context_len)], viewed [bs, min(W, kv_bucket)].
    windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def cuda_graph_refusal(device: torch.device, max_context_len: int) -> str | None:
    """Why torch_paged refuses DECODE graphs on `device`, or None.

    Under capture the gather is sized by the graph's KV-length bucket, up to
    max_context_len keys per request per layer: gigabytes per layer per step for a large
    batch of long contexts, slower than eager (sized by the batch's own bound) and likely out
    of memory at capture. On CPU the gathers run in
    cache-sized chunks of requests and the stand-in captures nothing real, so it stays on."""
    if device.type != "cuda":
        return None
    return (
        f"torch_paged's captured DECODE gathers up to max_context_len ({max_context_len}) keys "
        "per request per layer on CUDA (GBs per step at long contexts); use "
        "attention_backend=triton (the CUDA default) for CUDA graphs, or graph_mode=extend/none"
    )


class TorchPagedBackend(AttentionBackend):
    name: ClassVar[str] = "torch_paged"
    needs_cpu_seq_lens: ClassVar[bool] = False
    supports_graph_capture: ClassVar[bool] = True
    graph_kv_bounded: ClassVar[bool] = True

    def __init__(
        self, layout: AttentionLayout, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool
    ) -> None:
        super().__init__(layout, req_to_token_pool, kv_pool)
        self.max_context_len = req_to_token_pool.max_context_len
        self.device = req_to_token_pool.req_to_token.device
        # Key positions 0..max_context_len-1; every mask compares against a prefix of it.
        self._kv_positions = torch.arange(self.max_context_len, device=self.device)
        self._graph: _GraphBuffers | None = None
        self._scratch: list[torch.Tensor | None] = [None, None]  # CPU gather targets (K, V)
        # batch_invariant (set at start-up): key lengths aligned (ops.batch_invariant) and
        # EXTEND attended one query row per SDPA row, as DECODE is, so a token's attention
        # depends on its request alone, not on the batch or on how its prompt was chunked.
        self.batch_invariant = False

    def graph_capture_refusal(self) -> str | None:
        return super().graph_capture_refusal() or cuda_graph_refusal(
            self.device, self.max_context_len
        )

    # --- eager -------------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> TorchPagedMetadata:
        bs, num_tokens = fb.batch_size, fb.num_tokens
        kv_bound = fb.seq_len_bound or self.max_context_len
        if self.batch_invariant:
            kv_bound = aligned_kv_bound(kv_bound, self.max_context_len)
        if fb.forward_mode.is_extend():
            # No bound: the step's token count (a shape), and never past the context length.
            q_bound = fb.extend_len_bound or min(num_tokens, self.max_context_len)
            md = self._empty(bs, q_bound, kv_bound)
            md.q_index = torch.empty((bs, q_bound), dtype=torch.int64, device=self.device)
            md.out_index = torch.empty(num_tokens, dtype=torch.int64, device=self.device)
            self._fill_extend(md, fb)
            for w in self.layout.sliding_windows:
                width = min(kv_bound, w + q_bound - 1)  # the first query's window to the last key
                window = self._empty(bs, q_bound, width)
                window.q_index, window.out_index = md.q_index, md.out_index
                self._fill_extend_window(window, fb, w)
                md.windows[w] = window
            return md
        md = self._empty(bs, 1, kv_bound)
        md.windows = {w: self._empty(bs, 1, min(w, kv_bound)) for w in self.layout.sliding_windows}
        self.fill_decode_metadata(md, bs, fb.req_pool_indices, fb.seq_lens)
        return md

    def _empty(self, bs: int, q_bound: int, kv_bound: int) -> TorchPagedMetadata:
        return TorchPagedMetadata(
            kv_slots=torch.empty((bs, kv_bound), dtype=torch.int64, device=self.device),
            mask=torch.empty((bs, 1, q_bound, kv_bound), dtype=torch.bool, device=self.device),
        )

    # --- graphs ------------------------------------------------------------------------
    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        n = max_bs * self.max_context_len
        kv_slots, mask = self._flat_buffers(n)
        self._graph = _GraphBuffers(
            kv_slots=kv_slots,
            mask=mask,
            max_bs=max_bs,
            windows={
                w: self._flat_buffers(max_bs * min(w, self.max_context_len))
                for w in self.layout.sliding_windows
            },
        )

    def _flat_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat (kv_slots, mask) storage of graph metadata, viewed per bucket by `bind`."""
        return (
            torch.zeros(n, dtype=torch.int64, device=self.device),
            torch.zeros(n, dtype=torch.bool, device=self.device),
        )

    def bind_graph_metadata(
        self, bs: int, num_tokens: int, fb_view: ForwardBatch, kv_bucket: int = 0
    ) -> TorchPagedMetadata:
        g = self._graph
        if g is None:
            raise RuntimeError("init_graph_state must run before capture")
        if bs > g.max_bs:
            raise ValueError(f"bucket bs={bs} exceeds max_bs={g.max_bs}")
        kv = kv_bucket or self.max_context_len
        if kv > self.max_context_len:
            raise ValueError(f"kv bucket {kv} exceeds max_context_len={self.max_context_len}")
        # Contiguous views of the flat buffers: the mask fill writes it as [bs, kv].
        windows = {}
        for w, (slots, mask) in g.windows.items():
            width = min(w, kv)
            windows[w] = TorchPagedMetadata(
                kv_slots=slots[: bs * width].view(bs, width),
                mask=mask[: bs * width].view(bs, 1, 1, width),
            )
        return TorchPagedMetadata(
            kv_slots=g.kv_slots[: bs * kv].view(bs, kv),
            mask=g.mask[: bs * kv].view(bs, 1, 1, kv),
            windows=windows,
        )

    # --- metadata fills (device-only, in place; shared by eager, capture and replay) ---
    def fill_decode_metadata(
        self,
        md: TorchPagedMetadata,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> None:
        kv_bound = md.kv_bound
        table = self.req_to_token_pool.req_to_token
        md.kv_slots.copy_(table[req_pool_indices[:bs], :kv_bound])
        # [bs, kv_bound]: key j of request i exists iff j < seq_lens[i].
        torch.lt(
            self._kv_positions[:kv_bound],
            seq_lens[:bs, None],
            out=md.mask.view(bs, kv_bound),
        )
        for w, wmd in md.windows.items():
            # The query at position seq_len - 1 sees its last w keys: from seq_len - w on.
            first = torch.clamp(seq_lens[:bs] - w, min=0)
            valid = self._window_slots(wmd, req_pool_indices[:bs], first, seq_lens[:bs])
            wmd.mask.view(bs, wmd.kv_bound).copy_(valid)

    def _window_slots(
        self,
        md: TorchPagedMetadata,
        req_pool_indices: torch.Tensor,
        first: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Fill `md.kv_slots` with positions first_i.. of each request (slot 0 past its
        length, so nothing outside the request is read); -> [bs, width] bool: position
        exists."""
        positions = first[:, None] + self._kv_positions[: md.kv_bound]  # [bs, width]
        valid = positions < seq_lens[:, None]
        in_row = torch.clamp(positions, max=self.max_context_len - 1)
        slots = self.req_to_token_pool.req_to_token[req_pool_indices[:, None], in_row]
        md.kv_slots.copy_(slots.masked_fill(~valid, 0))
        return valid

    def _fill_extend(self, md: TorchPagedMetadata, fb: ForwardBatch) -> None:
        assert md.q_index is not None and md.out_index is not None
        assert fb.extend_prefix_lens is not None and fb.extend_seq_lens is not None
        assert fb.extend_start_loc is not None
        bs, num_tokens = fb.batch_size, fb.num_tokens
        kv_bound, q_bound = md.kv_bound, md.q_bound
        table = self.req_to_token_pool.req_to_token
        md.kv_slots.copy_(table[fb.req_pool_indices, :kv_bound])
        rows = self._kv_positions[:q_bound]  # query row r of request i is token prefix_i + r
        keys = self._kv_positions[:kv_bound]
        q_pos = fb.extend_prefix_lens[:, None] + rows  # [bs, q_bound]
        # Query at position p sees keys 0..p (its prefix and the new tokens up to itself);
        # `keys < seq_len` keeps padded rows (r >= extend_len) inside the request, and
        # key 0 is always visible, so no row is fully masked.
        visible = (keys <= q_pos[:, :, None]) & (keys < fb.seq_lens[:, None, None])
        md.mask.copy_(visible.unsqueeze(1))
        torch.clamp(fb.extend_start_loc[:, None] + rows, max=num_tokens - 1, out=md.q_index)
        request = torch.repeat_interleave(
            torch.arange(bs, device=self.device), fb.extend_seq_lens, output_size=num_tokens
        )  # [T]
        token = torch.arange(num_tokens, device=self.device)
        torch.add(request * q_bound, token - fb.extend_start_loc[request], out=md.out_index)

    def _fill_extend_window(self, md: TorchPagedMetadata, fb: ForwardBatch, window: int) -> None:
        assert fb.extend_prefix_lens is not None and fb.extend_seq_lens is not None
        prefix, seq_lens = fb.extend_prefix_lens, fb.seq_lens
        first = torch.clamp(prefix + 1 - window, min=0)  # the first new token's window start
        valid = self._window_slots(md, fb.req_pool_indices, first, seq_lens)
        positions = first[:, None] + self._kv_positions[: md.kv_bound]  # [bs, width]
        # Padded query rows (r >= extend_len) repeat the request's last token, so every row
        # sees at least itself.
        rows = self._kv_positions[: md.q_bound]
        q_pos = prefix[:, None] + torch.minimum(rows, fb.extend_seq_lens[:, None] - 1)
        keys, queries = positions[:, None, :], q_pos[:, :, None]
        visible = valid[:, None, :] & (keys <= queries) & (keys > queries - window)
        md.mask.copy_(visible.unsqueeze(1))

    # --- compute -----------------------------------------------------------------------
    def chunk_rows(self, bs: int, kv_bound: int, element_size: int) -> int:
        """Requests attended per chunk: all of them on CUDA; on CPU as many as keep the
        gathered K and V within `CPU_GATHER_BYTES`, so they are still in cache when SDPA
        reads them (faster for large batches than one batch-wide gather). A function of
        shapes only, so a captured graph replays the same chunks."""
        if self.device.type != "cpu":
            return bs
        per_request = 2 * kv_bound * self.layout.num_kv_heads * self.layout.head_dim * element_size
        return max(1, min(bs, CPU_GATHER_BYTES // per_request))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        k_buffer, v_buffer = store_layer_kv(self.kv_pool, layer_id, fb, k, v)

        md: TorchPagedMetadata = fb.attn_metadata
        spec = self.layout.layer(layer_id)
        softcap = spec.logit_softcap
        if self.batch_invariant and md.q_index is not None:
            return self._extend_per_query(
                q, k_buffer, v_buffer, md, fb, spec.sliding_window, softcap
            )
        if spec.sliding_window is not None:
            md = md.windows[spec.sliding_window]
        bs, kv_bound = md.kv_slots.shape
        chunk = self.chunk_rows(bs, kv_bound, k_buffer.element_size())
        parts = [
            self._attend(q, k_buffer, v_buffer, md, start, min(bs, start + chunk), softcap)
            for start in range(0, bs, chunk)
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        num_heads, head_dim = q.shape[1], q.shape[2]
        if md.out_index is None:
            return out.reshape(bs, num_heads, head_dim)  # [bs, Hk, group, D] -> [bs, Hq, D]
        q_bound = out.shape[2]
        flat = out.transpose(1, 2).reshape(bs * q_bound, num_heads, head_dim)
        return flat[md.out_index]  # [T, Hq, D]

    def _gather(self, buffer: torch.Tensor, slots: torch.Tensor, which: int) -> torch.Tensor:
        """`buffer[slots]` ([len(slots), Hk, D]). Eager on CPU: into a reused scratch buffer (a
        fresh multi-MiB one per chunk costs page faults that rival the gather), consumed by the
        chunk's SDPA before the next gather overwrites it; traced, the compiler's buffer."""
        if self.device.type != "cpu" or torch.compiler.is_compiling():
            return buffer.index_select(0, slots)
        numel = slots.numel() * buffer.shape[1] * buffer.shape[2]
        scratch = self._scratch[which]
        if scratch is None or scratch.numel() < numel or scratch.dtype != buffer.dtype:
            scratch = torch.empty(numel, dtype=buffer.dtype, device=buffer.device)
            self._scratch[which] = scratch
        out = scratch[:numel].view(slots.numel(), buffer.shape[1], buffer.shape[2])
        return torch.index_select(buffer, 0, slots, out=out)

    def _attend(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        md: TorchPagedMetadata,
        start: int,
        end: int,
        softcap: float | None,
    ) -> torch.Tensor:
        """Requests start..end-1: [n, Hk, group, D] (DECODE) or [n, Hq, q_bound, D] (EXTEND)."""
        if md.q_index is None and torch.compiler.is_compiling() and not self.batch_invariant:
            return self._attend_decode_traced(q, k_buffer, v_buffer, md, start, end, softcap)
        n, kv_bound = end - start, md.kv_bound
        num_heads, num_kv_heads, head_dim = q.shape[1], k_buffer.shape[1], q.shape[2]
        # index_select over the flattened slots is several times faster than advanced
        # indexing with a [n, kv_bound] index on CPU.
        slots = md.kv_slots[start:end].reshape(-1)
        shape = (n, kv_bound, num_kv_heads, head_dim)
        keys = self._gather(k_buffer, slots, 0).view(shape).transpose(1, 2).to(q.dtype)
        values = self._gather(v_buffer, slots, 1).view(shape).transpose(1, 2).to(q.dtype)
        # keys, values: [n, Hk, kv_bound, D]
        mask = md.mask[start:end]
        if md.q_index is None:
            # DECODE: the query heads sharing a KV head become that head's query rows
            # (head h reads KV head h // group), so K/V are never repeated per group.
            group = num_heads // num_kv_heads
            return sdpa(
                q[start:end].view(n, num_kv_heads, group, head_dim),
                keys,
                values,
                mask,  # [n, 1, 1, kv_bound] broadcasts over heads and rows
                scale=self.layout.scaling,
                softcap=softcap,
            )
        return sdpa(
            q[md.q_index[start:end]].transpose(1, 2),  # [n, Hq, q_bound, D]
            keys,
            values,
            mask,
            scale=self.layout.scaling,
            softcap=softcap,
            enable_gqa=num_heads != num_kv_heads,
        )

    def _extend_per_query(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        md: TorchPagedMetadata,
        fb: ForwardBatch,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """EXTEND under batch_invariant: each query is one SDPA row over its request's keys
        (gathered once, shared by its queries), laid out as a DECODE query, so its reductions
        have the same shape whatever the chunk it came in and the requests beside it. A
        windowed layer masks the full key range to the window (its own metadata starts at
        the chunk's first query, which a different chunking moves). -> [T, Hq, D]."""
        assert md.q_index is not None and fb.extend_seq_lens is not None
        assert fb.extend_prefix_lens is not None
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_buffer.shape[1]
        group, kv_bound = num_heads // num_kv_heads, md.kv_bound
        out = q.new_empty(q.shape)
        lengths = fb.extend_seq_lens.tolist()  # the CPU's tensors: no device sync
        prefixes = fb.extend_prefix_lens.tolist()
        keys_at = self._kv_positions[:kv_bound]
        for i, n in enumerate(lengths):
            if n == 0:
                continue
            slots = md.kv_slots[i]
            shape = (1, kv_bound, num_kv_heads, head_dim)
            keys = k_buffer.index_select(0, slots).view(shape).transpose(1, 2).to(q.dtype)
            values = v_buffer.index_select(0, slots).view(shape).transpose(1, 2).to(q.dtype)
            mask = md.mask[i, 0, :n]  # [n, kv_bound]
            if window is not None:
                q_pos = prefixes[i] + self._kv_positions[:n]
                mask = mask & (keys_at[None, :] > q_pos[:, None] - window)
            tokens = md.q_index[i, :n]
            rows = sdpa(
                q[tokens].view(n, num_kv_heads, group, head_dim),
                keys.expand(n, -1, -1, -1),
                values.expand(n, -1, -1, -1),
                mask.view(n, 1, 1, kv_bound),
                scale=self.layout.scaling,
                softcap=softcap,
            )
            out[tokens] = rows.reshape(n, num_heads, head_dim)
        return out

    def _attend_decode_traced(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        md: TorchPagedMetadata,
        start: int,
        end: int,
        softcap: float | None,
    ) -> torch.Tensor:
        """DECODE attention written as indexing, products and sums, for a whole-step compile
        (`compiled_step`): inductor turns it into a few loops that read each key and value
        straight from the pool through `kv_slots` (no gathered [n, kv_bound, Hk, D] copies)
        and keep scores and softmax in float32, instead of a gather kernel and an SDPA call
        per layer; not under batch_invariant, which keeps the eager SDPA. -> [n, Hk, group, D]."""
        n, kv_bound = end - start, md.kv_bound
        num_kv_heads, head_dim = k_buffer.shape[1], q.shape[2]
        group = q.shape[1] // num_kv_heads
        slots = md.kv_slots[start:end]
        keys = k_buffer[slots].float()  # [n, kv_bound, Hk, D]
        values = v_buffer[slots].float()
        queries = q[start:end].view(n, 1, num_kv_heads, group, head_dim).float()
        scores = (queries * keys[:, :, :, None, :]).sum(-1) * self.layout.scaling  # [n, L, Hk, G]
        if softcap is not None:
            scores = soft_cap(scores, softcap)
        visible = md.mask[start:end].view(n, kv_bound, 1, 1)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=1)
        out = (probs[..., None] * values[:, :, :, None, :]).sum(1)  # [n, Hk, G, D]
        return out.to(q.dtype)
