"""The reference scheduler's speculative decoding: when a request drafts, and its VERIFY batch.

A request added with `speculate=K` decodes with VERIFY steps: its last token plus K draft
slots, the drafts filled in by the executor's prompt lookup (`ngram_draft`, n-gram size per
request), so one step may yield up to K + 1 tokens. Greedy output is the same as without
speculation; what changes is how many steps it takes.

The switch-off policy (`SpeculationPolicy`), per request:
- `draft_len` is K, capped so the step never writes past the request's budget (its last new
  token is never fed back): a request needs no slots beyond prompt + max_new_tokens - 1, so
  admission reserves exactly what it does without speculation;
- a step drafts only when prompt lookup would find the request's last n tokens earlier in its
  tokens (`NgramIndex`, on the host; `only_on_match`): otherwise the executor's drafts would
  only repeat the last token, and a plain DECODE step is cheaper than that VERIFY step;
- after each VERIFY step the request records how many drafts were accepted; once it has
  `min_steps` VERIFY steps, the mean over its last `window` steps decides: below
  `min_accepted` accepted drafts per step, drafting is switched off (the request then decodes
  with plain DECODE steps, which are cheaper than a VERIFY step with nothing accepted);
- a switched-off request tries again after `retry_after` plain steps, and the wait doubles
  each time it is switched off again (`retry_after` 0: never again), so a request whose text
  stops being predictable pays at most `min_steps` poor VERIFY steps per back-off.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from executor.batch_prep import make_extend_batch
from executor.core.forward_batch import ForwardBatch, ForwardMode, SamplingParams
from executor.core.limits import BatchLimits

if TYPE_CHECKING:
    from executor.client.requests import Request

DEFAULT_NGRAM = 3


@dataclass(frozen=True)
class SpeculationPolicy:
    """When a speculating request keeps drafting (the module docstring has the rule)."""

    min_steps: int = 4  # VERIFY steps before acceptance is judged (and after each retry)
    window: int = 8  # the moving average's length, in VERIFY steps
    min_accepted: float = 0.5  # accepted drafts per VERIFY step below which drafting stops
    retry_after: int = 32  # plain steps before drafting again; doubles each time; 0: never
    only_on_match: bool = True  # a step drafts only when prompt lookup finds its n-gram

    def __post_init__(self) -> None:
        if self.min_steps < 1 or self.window < self.min_steps:
            raise ValueError(
                f"need 1 <= min_steps <= window, got {self.min_steps} and {self.window}"
            )
        if self.min_accepted < 0 or self.retry_after < 0:
            raise ValueError("min_accepted and retry_after must be >= 0")


@dataclass
class DraftState:
    """One request's drafting: its settings, the policy's memory and its counters."""

    k: int  # drafts per VERIFY step asked for (speculate=K)
    ngram: int
    policy: SpeculationPolicy
    sent: int = 0  # drafts in the step being built / in flight
    recent: deque[int] = field(default_factory=deque)  # accepted drafts, last `window` steps
    wait: int = 0  # plain steps left before drafting again
    switch_offs: int = 0
    # Counters: VERIFY steps, drafts scored, drafts accepted, plain steps while switched off.
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0
    no_match_steps: int = 0  # plain steps because the lookup would find nothing
    index: NgramIndex | None = None

    def draft_len_for(self, req: Request) -> int:
        """This step's k for `req`: `draft_len`, and 0 when the lookup would find no match."""
        k = self.draft_len(req.max_new_tokens - len(req.output_ids))
        if k and self.policy.only_on_match:
            if self.index is None:
                self.index = NgramIndex(self.ngram, req.prompt_ids)
            if not self.index.has_match(req.output_ids):
                self.no_match_steps += 1
                return 0
        return k

    @property
    def drafting(self) -> bool:
        return self.wait == 0

    def draft_len(self, remaining: int) -> int:
        """Drafts for the next step given `remaining` new tokens the request may still take:
        the step yields at most k + 1 tokens, so k <= remaining - 1."""
        return min(self.k, remaining - 1) if self.drafting else 0

    def record(self, drafted: int, accepted: int) -> None:
        """After a generating step: `drafted` drafts were scored (0: none were sent, a plain
        step or a k = 0 row), `accepted` of them kept."""
        if drafted == 0:
            if self.wait > 0:  # switched off: count down to the next try
                self.plain_steps += 1
                self.wait -= 1
            return  # a k = 0 row at the budget's end says nothing about acceptance
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.recent.append(accepted)
        if len(self.recent) > self.policy.window:
            self.recent.popleft()
        judged = len(self.recent) >= self.policy.min_steps
        if judged and sum(self.recent) / len(self.recent) < self.policy.min_accepted:
            self._switch_off()

    def _switch_off(self) -> None:
        self.switch_offs += 1
        self.recent.clear()
        retry = self.policy.retry_after
        # Never again: a wait no request outlives.
        self.wait = retry << (self.switch_offs - 1) if retry else 1 << 62


class NgramIndex:
    """The n-grams a request's tokens (prompt, then output) hold, except the last one: whether
    prompt lookup would find the last n tokens earlier (the executor's rule,
    `executor/speculative/ngram.py`), known on the host in O(n) a token. Without a match the
    executor's drafts only repeat the last token, and a plain DECODE step is cheaper."""

    def __init__(self, n: int, prompt: Sequence[int]) -> None:
        self.n, self.tokens = n, list(prompt)
        self.prompt_len = len(self.tokens)
        self.seen: set[tuple[int, ...]] = set()
        self.indexed = 0  # windows starting below this are in `seen`

    def has_match(self, output: Sequence[int]) -> bool:
        self.tokens.extend(output[len(self.tokens) - self.prompt_len :])
        n, tokens = self.n, self.tokens
        last = len(tokens) - n  # the suffix's start; earlier windows have a token after them
        while self.indexed < last:
            self.seen.add(tuple(tokens[self.indexed : self.indexed + n]))
            self.indexed += 1
        return last > 0 and tuple(tokens[last:]) in self.seen


def check_speculate(speculate: int, ngram: int, limits: BatchLimits, overlap: bool) -> None:
    """A request's settings against the executor's limits (ValueError)."""
    if speculate < 0 or speculate > limits.max_draft_tokens:
        raise ValueError(
            f"speculate must be in 0..{limits.max_draft_tokens} (the executor's "
            f"max_draft_tokens), got {speculate}"
        )
    if speculate and not 1 <= ngram <= limits.max_ngram:
        raise ValueError(
            f"ngram must be in 1..{limits.max_ngram} (the executor's max_ngram), got {ngram}"
        )
    if speculate and overlap:
        raise ValueError(
            "speculation and overlap scheduling do not compose yet in the reference "
            "scheduler (it does not pipeline VERIFY steps); use one or the other"
        )


def fit_draft_lens(ks: list[int], max_tokens: int) -> list[int]:
    """Draft lengths cut (from the last row back) so the batch's k + 1 tokens per row fit."""
    ks = list(ks)
    excess = len(ks) + sum(ks) - max_tokens
    for i in range(len(ks) - 1, -1, -1):
        if excess <= 0:
            break
        cut = min(ks[i], excess)
        ks[i] -= cut
        excess -= cut
    return ks


def plan_verify(decode: Sequence[Request], max_tokens: int) -> ForwardBatch | None:
    """The decode step of `decode` as one VERIFY batch when any of them drafts now (rows that
    do not get k = 0: a k = 0 VERIFY row equals a DECODE row, seeded draws included); None
    when none drafts (a plain DECODE is cheaper). Sets each request's `draft.sent`."""
    ks = [r.draft.draft_len_for(r) if r.draft is not None else 0 for r in decode]
    ks = fit_draft_lens(ks, max_tokens)
    for r, k in zip(decode, ks, strict=True):
        if r.draft is not None:
            r.draft.sent = k
    if not any(ks):
        return None
    return make_verify_batch(
        last_tokens=[r.output_ids[-1] for r in decode],
        req_pool_indices=[r.row for r in decode],
        prefix_lens=[r.num_computed for r in decode],
        slots=[
            r.slots[r.num_computed : r.num_computed + k + 1]
            for r, k in zip(decode, ks, strict=True)
        ],
        ngrams=[r.draft.ngram if r.draft is not None else 0 for r in decode],
        sampling=[r.sampling for r in decode],
    )


def make_verify_batch(
    last_tokens: Sequence[int],
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    slots: Sequence[Sequence[int]],
    ngrams: Sequence[int],
    sampling: Sequence[SamplingParams],
) -> ForwardBatch:
    """A VERIFY batch: per row its last token and len(slots) - 1 draft places, which the
    executor fills by prompt lookup (`ngram_draft`; rows with no drafts get 0)."""
    fb = make_extend_batch(
        input_ids=[[t] + [0] * (len(s) - 1) for t, s in zip(last_tokens, slots, strict=True)],
        req_pool_indices=list(req_pool_indices),
        out_cache_loc=[list(s) for s in slots],
        prefix_lens=list(prefix_lens),
        sampling=list(sampling),
    )
    ngram = [n if len(s) > 1 else 0 for n, s in zip(ngrams, slots, strict=True)]
    return dataclasses.replace(
        fb,
        forward_mode=ForwardMode.VERIFY,
        ngram_draft=torch.tensor(ngram, dtype=torch.int32),
    )


def token_runs(out: object, bs: int) -> list[list[tuple[int, float | None]]]:
    """Each row's new tokens with their logprobs (None where the step returned none):
    VERIFY's accepted drafts and bonus, otherwise the one token."""
    lengths = getattr(out, "accepted_lengths", None)
    if lengths is None:
        tokens = out.next_token_ids.tolist()  # type: ignore[attr-defined]
        lp = getattr(out, "next_token_logprobs", None)
        logprobs = [None] * len(tokens) if lp is None else lp.tolist()
        return [[(t, p)] for t, p in zip(tokens, logprobs, strict=True)]
    flat = out.accepted_tokens.tolist()  # type: ignore[attr-defined]
    lp = getattr(out, "accepted_logprobs", None)
    flat_lp = [None] * len(flat) if lp is None else lp.tolist()
    runs, at = [], 0
    for n in lengths.tolist()[:bs]:
        runs.append(list(zip(flat[at : at + n], flat_lp[at : at + n], strict=True)))
        at += n
    return runs
