"""A stream of random, valid batches, as a scheduler would send them, for equality tests."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass, field

import torch

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.core.forward_batch import ForwardBatch, SamplingParams
from executor.core.limits import BatchLimits


@dataclass
class _Request:
    row: int
    slots: list[int]  # KV slot of each resident position
    last_token: int


@dataclass
class BatchGenerator:
    """Random valid batches over a scheduler-like view of rows, slots and resident lengths.

    Sizes grow with the step number, so registries sized by early batches are outgrown.
    EXTEND batches mix fresh prompts, continued (chunked) prefills and, with
    `prefix_cache_loc`, new requests reusing another request's prefix slots. Finished
    requests' rows are released on the next batch (`released_req_pool_indices`), as the
    executor's slot-owner map requires before their slots are reused.
    """

    seed: int
    limits: BatchLimits
    max_request_len: int = 300  # requests finish before this (inside max_context_len)
    max_batch_size: int = 8  # most requests per EXTEND (DECODE grows with the step number)
    embeds_ratio: float = 0.1  # EXTEND batches that carry input_embeds instead of ids
    idle_ratio: float = 0.07
    rng: random.Random = field(init=False)
    free_rows: list[int] = field(init=False)
    free_slots: list[int] = field(init=False)
    refs: Counter[int] = field(default_factory=Counter)
    reqs: dict[int, _Request] = field(default_factory=dict)
    kinds: Counter[str] = field(default_factory=Counter)
    released: list[int] = field(default_factory=list)  # finished rows the executor still holds

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.free_rows = list(range(1, self.limits.max_reqs + 1))
        self.free_slots = list(range(self.limits.kv_slots, 0, -1))

    # --- bookkeeping ---------------------------------------------------------------------
    def _finish(self, req: _Request) -> None:
        del self.reqs[req.row]
        self.free_rows.append(req.row)
        self.released.append(req.row)
        for s in req.slots:
            self.refs[s] -= 1
            if self.refs[s] == 0:
                self.free_slots.append(s)

    def _finish_random(self, keep: frozenset[int] = frozenset()) -> None:
        """Finish a random request, never one of the rows in `keep` (this batch's)."""
        self._finish(self.rng.choice([r for r in self.reqs.values() if r.row not in keep]))

    def _take(self, n: int, keep: frozenset[int] = frozenset()) -> list[int]:
        """`n` free slots; finishes requests outside `keep` when too few are free (a request
        of the batch being built must keep its slots, or a new token could reuse one)."""
        while len(self.free_slots) < n:
            self._finish_random(keep)
        out = [self.free_slots.pop() for _ in range(n)]
        for s in out:
            self.refs[s] += 1
        return out

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.limits.vocab_size) for _ in range(n)]

    def _sampling(self, bs: int) -> list[SamplingParams]:
        if self.rng.random() < 0.7:
            return []  # greedy
        return [
            SamplingParams(temperature=0.8, top_k=20, seed=self.rng.randrange(2**32))
            for _ in range(bs)
        ]

    def observe(self, fb: ForwardBatch, next_token_ids: torch.Tensor) -> None:
        for row, tok in zip(fb.req_pool_indices.tolist(), next_token_ids.tolist(), strict=True):
            self.reqs[row].last_token = tok

    # --- batches -------------------------------------------------------------------------
    def next_batch(self, step: int) -> ForwardBatch:
        fb = self._next_batch(step)
        released = self.released
        self.released = []
        if not released:
            return fb
        return dataclasses.replace(
            fb, released_req_pool_indices=torch.tensor(released, dtype=torch.int64)
        )

    def _next_batch(self, step: int) -> ForwardBatch:
        grow = 1 + step // 12
        for req in [r for r in self.reqs.values() if len(r.slots) >= self.max_request_len - 80]:
            self._finish(req)
        if self.reqs and self.rng.random() < 0.12:
            self._finish_random()
        roll = self.rng.random()
        if roll < self.idle_ratio:
            self.kinds["idle"] += 1
            return make_idle_batch()
        if roll < 0.55 and self.reqs:
            return self._decode(grow)
        return self._extend(grow)

    def _decode(self, grow: int) -> ForwardBatch:
        reqs = self.rng.sample(
            list(self.reqs.values()), self.rng.randint(1, min(len(self.reqs), grow))
        )
        slots = self._take(len(reqs), frozenset(r.row for r in reqs))
        for req, slot in zip(reqs, slots, strict=True):
            req.slots.append(slot)
        self.kinds["decode"] += 1
        return make_decode_batch(
            input_ids=[r.last_token for r in reqs],
            req_pool_indices=[r.row for r in reqs],
            seq_lens=[len(r.slots) for r in reqs],
            out_cache_loc=slots,
            sampling=self._sampling(len(reqs)),
        )

    def _extend(self, grow: int) -> ForwardBatch:
        use_pcl = self.rng.random() < 0.35
        bs = self.rng.randint(1, min(grow, self.max_batch_size))
        max_new = min(4 * grow, 64)
        chosen: set[int] = set()
        ids: list[list[int]] = []
        rows: list[int] = []
        out_locs: list[list[int]] = []
        prefix_lens: list[int] = []
        prefix_locs: list[list[int]] = []
        for _ in range(bs):
            kinds = []
            if self.free_rows:
                kinds.append("fresh")
                if use_pcl and any(r not in chosen for r in self.reqs):
                    kinds.append("shared_prefix")
            if any(r not in chosen for r in self.reqs):
                kinds.append("chunk")
            if not kinds:
                break
            kind = self.rng.choice(kinds)
            n = self.rng.randint(1, max_new)
            if kind == "chunk":
                req = self.reqs[self.rng.choice([r for r in self.reqs if r not in chosen])]
                prefix = list(req.slots)
            else:
                row = self.free_rows.pop(self.rng.randrange(len(self.free_rows)))
                prefix = []
                if kind == "shared_prefix":
                    # Not a request of this batch: its new slots are written by this step.
                    donor = self.rng.choice([r for r in self.reqs.values() if r.row not in chosen])
                    prefix = donor.slots[: self.rng.randint(1, len(donor.slots))]
                    for s in prefix:
                        self.refs[s] += 1
                req = _Request(row, list(prefix), last_token=0)
                self.reqs[row] = req
            self.kinds[kind] += 1
            new = self._take(n, frozenset(chosen | {req.row}))
            req.slots.extend(new)
            chosen.add(req.row)
            ids.append(self._tokens(n))
            rows.append(req.row)
            out_locs.append(new)
            prefix_lens.append(len(prefix))
            prefix_locs.append(prefix)
        fb = make_extend_batch(
            input_ids=ids,
            req_pool_indices=rows,
            out_cache_loc=out_locs,
            prefix_lens=prefix_lens,
            prefix_cache_loc=prefix_locs if use_pcl else None,
            sampling=self._sampling(len(rows)),
        )
        self.kinds["extend"] += 1
        # Embeddings instead of ids, where the executor accepts them.
        if self.limits.allow_input_embeds and self.rng.random() < self.embeds_ratio:
            self.kinds["input_embeds"] += 1
            t = fb.num_tokens
            g = torch.Generator().manual_seed(self.rng.randrange(2**31))
            embeds = torch.randn(t, self.limits.hidden_size, generator=g)
            fb = dataclasses.replace(fb, input_ids=None, input_embeds=embeds)
        return fb
