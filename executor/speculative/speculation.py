"""`Speculation`: VERIFY as a step feature (`executor.core.features`), in the step's order.

admit (host rules, before anything changes) -> launch (drafts written into the input ids on
the device, future references resolved) -> draw (accept, bonus; in the step's one
device-to-host copy) -> commit (the rows truncated to what was accepted,
`ReqToTokenPool.truncate`, the step's last act).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from executor.controls.slot_tokens import SlotTokens
from executor.core.errors import BatchValidationError
from executor.core.features import FeatureStep
from executor.core.forward_batch import ForwardBatch, ForwardMode
from executor.core.limits import BatchLimits
from executor.core.outputs import ForwardOutput, StepStats
from executor.core.step_batch import StepBatch
from executor.kv_cache import ReqToTokenPool
from executor.speculative.ngram import Drafter, NgramDrafter
from executor.speculative.verify import verify_drafts
from ops.future_tokens import resolve_future_tokens
from ops.sampling import SamplingPlan


def check_verify(fb: ForwardBatch, limits: BatchLimits, *, tp_size: int) -> None:
    """The VERIFY rules beyond an EXTEND's (validated before): BatchValidationError."""
    if tp_size > 1:
        raise BatchValidationError("forward_mode", "VERIFY needs tp_size 1 (this executor has tp)")
    assert fb.extend_seq_lens is not None
    lens = fb.extend_seq_lens.numpy()
    most = limits.max_draft_tokens + 1
    if len(lens) and int(lens.max()) > most:
        i = int(np.argmax(lens > most))
        raise BatchValidationError(
            f"extend_seq_lens[{i}]",
            f"VERIFY: the input token plus at most max_draft_tokens ({limits.max_draft_tokens}) "
            f"drafts, got {int(lens[i])}",
        )
    for name in ("prefix_cache_loc", "input_embeds"):
        if getattr(fb, name) is not None:
            raise BatchValidationError(name, "is not allowed in VERIFY")
    if fb.top_logprobs_num > 0:
        raise BatchValidationError("top_logprobs_num", "must be 0 in VERIFY")
    if fb.row_controls or fb.vocab_mask is not None or fb.deferred_mask is not None:
        raise BatchValidationError(
            "forward_mode", "VERIFY does not take sampling controls or vocab masks"
        )
    if fb.ngram_draft is not None:
        n = fb.ngram_draft
        if n.dtype not in (torch.int32, torch.int64) or n.dim() != 1 or n.shape[0] != fb.batch_size:
            raise BatchValidationError(
                "ngram_draft", f"must be an int tensor of {fb.batch_size} entries"
            )
        bad = (n < 0) | (n > limits.max_ngram)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise BatchValidationError(
                f"ngram_draft[{i}]",
                f"must be in 0..max_ngram ({limits.max_ngram}), got {int(n[i])}",
            )


def resolve_held_prefix(fb: ForwardBatch, resident_lens: np.ndarray) -> ForwardBatch:
    """VERIFY rows whose extend_prefix_lens is -1 continue from every token their row holds
    now (the steps before this one applied, so a pipelining scheduler need not know their
    accepted lengths): the prefix and seq_lens are filled in from the row table, on the host.
    Other batches, and rows with an explicit prefix, are returned as they are."""
    if not isinstance(fb.forward_mode, ForwardMode) or not fb.forward_mode.is_verify():
        return fb  # validation refuses a mode it does not know
    if fb.extend_prefix_lens is None:
        return fb
    prefix = fb.extend_prefix_lens
    if not isinstance(prefix, torch.Tensor) or not bool((prefix == -1).any()):
        return fb
    if fb.extend_seq_lens is None or fb.extend_seq_lens.shape != prefix.shape:
        return fb  # validation names what is wrong
    rows = fb.req_pool_indices.numpy().astype(np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= len(resident_lens)):
        return fb
    lens = resident_lens[rows].astype(np.int64)
    if fb.released_req_pool_indices is not None:  # released first: such a row holds nothing
        lens = np.where(np.isin(rows, fb.released_req_pool_indices.numpy()), 0, lens)
    held = torch.from_numpy(lens)
    resolved = torch.where(prefix == -1, held, prefix.long())
    seq_lens = torch.where(prefix == -1, resolved + fb.extend_seq_lens.long(), fb.seq_lens.long())
    return dataclasses.replace(fb, extend_prefix_lens=resolved, seq_lens=seq_lens)


def check_not_verify(fb: ForwardBatch) -> None:
    if fb.ngram_draft is not None:
        raise BatchValidationError("ngram_draft", "is for VERIFY batches only")


class Speculation:
    """VERIFY as a step feature (`executor.core.features`). `vocab_size`: a drafted id
    outside the vocabulary (an unknown slot's -1, an imported id) becomes the input token, as
    an unmatched lookup does; the embedding never sees it."""

    def __init__(
        self,
        slot_tokens: SlotTokens,
        limits: BatchLimits,
        *,
        pool: ReqToTokenPool,
        future_table: torch.Tensor,
        tp_size: int,
        generator: torch.Generator,
        drafter: Drafter | None = None,
    ) -> None:
        """`generator`: the sampler's, for the bonus tokens' unseeded draws."""
        self.slot_tokens = slot_tokens
        self.generator = generator
        self.limits = limits
        self.vocab_size = limits.vocab_size
        self.pool = pool
        self.future_table = future_table
        self.tp_size = tp_size
        self.drafter: Drafter = drafter or NgramDrafter()

    def admit(self, sb: StepBatch) -> VerifyStep | None:
        """The VERIFY rules beyond an EXTEND's (BatchValidationError); None for other modes
        (which may not bring drafts' fields)."""
        if not sb.host.forward_mode.is_verify():
            check_not_verify(sb.host)
            return None
        check_verify(sb.host, self.limits, tp_size=self.tp_size)
        return VerifyStep(self)

    def prepare(
        self,
        host: ForwardBatch,
        fb: ForwardBatch,
        future_table: torch.Tensor | None,
        req_to_token: torch.Tensor,
    ) -> ForwardBatch:
        """The device batch with its references resolved and the executor's drafts in place."""
        ids = fb.input_ids
        assert ids is not None and fb.extend_start_loc is not None
        if fb.future_refs and future_table is not None:
            ids = resolve_future_tokens(ids, future_table)
        if host.ngram_draft is not None and bool((host.ngram_draft > 0).any()):
            ids = self._draft(host, fb, ids, req_to_token)
        return dataclasses.replace(fb, input_ids=ids, future_refs=0)

    def _draft(
        self, host: ForwardBatch, fb: ForwardBatch, ids: torch.Tensor, req_to_token: torch.Tensor
    ) -> torch.Tensor:
        assert host.extend_prefix_lens_cpu is not None and host.extend_seq_lens_cpu is not None
        assert host.ngram_draft is not None and fb.ngram_draft is not None
        assert fb.extend_start_loc is not None and fb.extend_seq_lens is not None
        assert fb.extend_prefix_lens is not None
        kmax = max(host.extend_seq_lens_cpu) - 1
        if kmax == 0:
            return ids
        length = max(host.extend_prefix_lens_cpu) + 1
        history = self.slot_tokens.history(req_to_token, fb.req_pool_indices, length)
        prefix = fb.extend_prefix_lens.long()
        start = fb.extend_start_loc.long()
        # The input token is not recorded yet: put it at its position.
        history = history.scatter(1, prefix.unsqueeze(1), ids[start].long().unsqueeze(1))
        sizes = sorted({int(n) for n in host.ngram_draft.tolist() if n > 0})
        drafts = self.drafter.draft(history, prefix + 1, fb.ngram_draft.long(), kmax, sizes)
        num_tokens = ids.shape[0]
        bs = fb.batch_size
        row = torch.repeat_interleave(
            torch.arange(bs, device=ids.device), fb.extend_seq_lens, output_size=num_tokens
        )
        j = torch.arange(num_tokens, device=ids.device) - start[row]
        drafted = drafts[row, (j - 1).clamp(min=0)]
        in_vocab = (drafted >= 0) & (drafted < self.vocab_size)
        use = (j >= 1) & (fb.ngram_draft[row] > 0) & in_vocab
        return torch.where(use, drafted.to(ids.dtype), ids)

    def draw(
        self,
        logits: torch.Tensor,
        host: ForwardBatch,
        fb: ForwardBatch,
        plan: SamplingPlan,
    ) -> VerifyDraw:
        """Accept and draw on the device; the accepted counts, tokens and logprobs packed as
        float64 (which holds token ids exactly) for the step's one device-to-host copy."""
        assert host.extend_seq_lens_cpu is not None and fb.extend_start_loc is not None
        assert fb.input_ids is not None and fb.positions is not None and fb.sampling is not None
        assert fb.extend_seq_lens is not None
        kmax = max(host.extend_seq_lens_cpu, default=1) - 1
        v = verify_drafts(
            logits,
            fb.input_ids,
            start=fb.extend_start_loc.long(),
            k=fb.extend_seq_lens.long() - 1,
            kmax=kmax,
            positions=fb.positions,
            sampling=fb.sampling,
            plan=plan,
            generator=self.generator,
            return_logprob=host.return_logprob,
        )
        parts = [v.accepted.unsqueeze(1).double(), v.tokens.double()]
        if v.logprobs is not None:
            parts.append(v.logprobs.double())
        drafts = int(sum(host.extend_seq_lens_cpu)) - host.batch_size
        return VerifyDraw(
            v.bonus, [torch.cat(parts, dim=1)], kmax + 1, v.logprobs is not None, drafts
        )


@dataclass(frozen=True, eq=False)
class VerifyDraw:
    """A VERIFY step's draw (`executor.core.features.Draw`)."""

    ids: torch.Tensor  # the bonus tokens, on the device (the future-token table stores them)
    device: list[torch.Tensor]
    width: int  # kmax + 1
    logprobs: bool
    draft_tokens: int

    def output(self, host: list[torch.Tensor], stats: StepStats) -> ForwardOutput:
        packed = host[0]
        accepted = packed[:, 0].long()
        tokens = packed[:, 1 : 1 + self.width].long()
        keep = torch.arange(self.width).unsqueeze(0) <= accepted.unsqueeze(1)
        out = ForwardOutput(
            next_token_ids=tokens.gather(1, accepted.unsqueeze(1)).squeeze(1),
            stats=stats,
            device_token_ids=self.ids,
            accepted_tokens=tokens[keep],
            accepted_lengths=(accepted + 1).to(torch.int32),
        )
        if self.logprobs:
            out.accepted_logprobs = packed[:, 1 + self.width :].float()[keep]
        stats.draft_tokens = self.draft_tokens
        stats.accepted_drafts = int(accepted.sum())
        stats.accept_lengths = tuple((accepted + 1).tolist())
        return out


@dataclass(eq=False)
class VerifyStep(FeatureStep):
    """launch: drafts into the device batch's input ids; draw: acceptance instead of the
    sampler; commit: the rows truncated to what was accepted (their rejected drafts' slots
    free again), which the next admission reads: `settles_at_read`."""

    spec: Speculation
    settles_at_read = True

    def launch(self, sb: StepBatch) -> None:
        spec = self.spec
        sb.device = spec.prepare(
            sb.host, sb.staged_device(), spec.future_table, spec.pool.req_to_token
        )

    def draw(self, sb: StepBatch, logits: torch.Tensor) -> VerifyDraw:
        assert sb.sampling is not None
        return self.spec.draw(logits, sb.host, sb.staged_device(), sb.sampling)

    def commit(self, sb: StepBatch, out: ForwardOutput, host: list[torch.Tensor]) -> None:
        assert out.accepted_lengths is not None and sb.host.extend_prefix_lens_cpu is not None
        rows = sb.host.req_pool_indices.numpy().astype(np.int64)
        prefix = np.asarray(sb.host.extend_prefix_lens_cpu, dtype=np.int64)
        self.spec.pool.truncate(rows, prefix + out.accepted_lengths.numpy().astype(np.int64))
