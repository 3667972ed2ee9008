"""Turn a step's logits into next tokens (and logprobs), with one counted host transfer.

The sampler draws on the device (`Sampler.draw`); the step copies the draw to the host with
its other results and the draw turns the host copy into the step's `ForwardOutput`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from executor.admission.host_checks import PLAN_SIZE, sampling_holds
from executor.core.forward_batch import SamplingBatch
from executor.core.outputs import ForwardOutput, StepStats
from executor.core.step_batch import StepBatch
from ops.sampling import (
    ALL_GREEDY,
    SamplingPlan,
    argmax_rows,
    drawn,
    processed_logprobs,
    seeded_uniform,
    truncate,
)


class Sampler:
    """Greedy, temperature, top-k, top-p, min-p; per-request seeds; optional logprobs.

    A request's logprobs are RAW (the model's distribution: log-softmax of its raw logits,
    before the controls, temperature and truncation, as most serving stacks report them) or
    PROCESSED (the distribution it was drawn from: `ops.sampling.processed_logprobs`).
    """

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @staticmethod
    def plan(host_sampling: SamplingBatch) -> SamplingPlan:
        """Decide the work from the host copy of the parameters, before the device step, so
        that sampling itself reads no value (device or host) to decide anything. The shared
        all-greedy parameters need no look; others are read by the host kernel when there
        is one (`executor.admission.host_checks`), else by torch."""
        if host_sampling.is_shared_greedy():
            return ALL_GREEDY
        found = (ctypes.c_int64 * PLAN_SIZE)()
        if sampling_holds(host_sampling, host_sampling.temperatures.numel(), found):
            if not found[0]:
                return ALL_GREEDY
            return SamplingPlan(
                all_greedy=not found[7],
                any_top_k=bool(found[1]),
                all_top_k=bool(found[2]),
                max_top_k=found[3],
                any_top_p=bool(found[4]),
                any_min_p=bool(found[5]),
                any_seeded=bool(found[6]),
                any_processed=bool(found[8]),
            )
        return SamplingPlan.from_host(
            host_sampling.temperatures,
            host_sampling.top_ks,
            host_sampling.top_ps,
            host_sampling.min_ps,
            host_sampling.has_seed,
            host_sampling.processed,
        )

    def draw_step(self, sb: StepBatch, logits: torch.Tensor) -> SampledDraw:
        """A step's draw: its device sampling parameters, and the model's own logits for the
        logprobs."""
        fb, host = sb.staged_device(), sb.host
        assert fb.sampling is not None and sb.sampling is not None and sb.ran is not None
        return self.draw(
            logits,
            sb.sampling,
            fb.sampling,
            fb.seq_lens,
            return_logprob=host.return_logprob,
            top_logprobs_num=host.top_logprobs_num,
            raw_logits=sb.ran.logits,
        )

    def draw(
        self,
        logits: torch.Tensor,
        plan: SamplingPlan,
        device_sampling: SamplingBatch,
        seq_lens: torch.Tensor,
        *,
        return_logprob: bool,
        top_logprobs_num: int,
        raw_logits: torch.Tensor | None = None,
    ) -> SampledDraw:
        """logits [bs, V] float32 on the device, after the sampling controls; `raw_logits`:
        the model's own, for the logprobs (None: the same); `plan` from :meth:`plan`;
        `seq_lens` (device) keys the seeded draws. Device work only: the draw's `device`
        tensors travel in the step's one host transfer."""
        s = device_sampling
        k = top_logprobs_num
        wants_logprobs = return_logprob or k > 0
        truncated = None
        if not plan.all_greedy or (plan.any_processed and wants_logprobs):
            truncated = truncate(logits, s.temperatures, s.top_ks, s.top_ps, s.min_ps, plan)
        ids = argmax_rows(logits)
        if not plan.all_greedy:
            assert truncated is not None
            uniforms = torch.rand(logits.shape[0], generator=self.generator, device=logits.device)
            if plan.any_seeded:
                seeded = seeded_uniform(s.seeds, seq_lens)
                uniforms = torch.where(s.has_seed, seeded, uniforms)
            ids = drawn(truncated, ids, s.temperatures, uniforms)
        if not wants_logprobs:
            return SampledDraw(ids, [ids], return_logprob, k)
        # The tokens and every logprob output packed in one tensor (float64 holds token ids
        # exactly), so a step with logprobs syncs once, as one without.
        logprobs = torch.log_softmax(logits if raw_logits is None else raw_logits, dim=-1)
        if plan.any_processed:
            assert truncated is not None
            processed = processed_logprobs(truncated)
            logprobs = torch.where(s.processed.unsqueeze(1), processed, logprobs)
        parts = [ids.unsqueeze(1).double(), logprobs.gather(1, ids.unsqueeze(1)).double()]
        if k > 0:
            top_vals, top_ids = logprobs.topk(k, dim=-1)
            parts += [top_vals.double(), top_ids.double()]
        return SampledDraw(ids, [torch.cat(parts, dim=1)], return_logprob, k)


@dataclass(frozen=True, eq=False)
class SampledDraw:
    """The sampler's draw (`executor.core.features.Draw`): the ids, or the ids packed with
    their logprobs, on their way to the host."""

    ids: torch.Tensor
    device: list[torch.Tensor]
    chosen: bool  # return_logprob
    k: int  # top_logprobs_num

    def output(self, host: list[torch.Tensor], stats: StepStats) -> ForwardOutput:
        packed = host[0]
        if not self.chosen and self.k == 0:
            return ForwardOutput(next_token_ids=packed, stats=stats, device_token_ids=self.ids)
        k = self.k
        out = ForwardOutput(
            next_token_ids=packed[:, 0].long(), stats=stats, device_token_ids=self.ids
        )
        if self.chosen:
            out.next_token_logprobs = packed[:, 1].float()
        if k > 0:
            out.top_logprobs = packed[:, 2 : 2 + k].float()
            out.top_logprob_ids = packed[:, 2 + k :].long()
        return out
