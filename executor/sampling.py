"""Turn a step's logits into next tokens (and logprobs), with one counted host transfer.

The sampler writes the step's one output, `ForwardOutput`; the step adds its stats.
"""

from __future__ import annotations

import ctypes

import torch

from executor.core.forward_batch import SamplingBatch
from executor.core.outputs import ForwardOutput
from executor.host_checks import sampling_holds
from ops.host_transfer import to_host_packed
from ops.sampling import ALL_GREEDY, SamplingPlan, sample_tokens, seeded_uniform

_NO_UNIFORMS: dict[torch.device, torch.Tensor] = {}


def _no_uniforms(device: torch.device) -> torch.Tensor:
    """The empty uniforms of an all-greedy step, one per device (never written)."""
    empty = _NO_UNIFORMS.get(device)
    if empty is None:
        empty = _NO_UNIFORMS[device] = torch.zeros(0, device=device)
    return empty


class Sampler:
    """Greedy, temperature, top-k, top-p, min-p; per-request seeds; optional logprobs.

    Logprobs are those of the model's distribution (log-softmax of the raw logits), before
    temperature and truncation, as most serving stacks report them.
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
        is one (`executor.host_checks`), else by torch."""
        if host_sampling.is_shared_greedy():
            return ALL_GREEDY
        found = (ctypes.c_int64 * 7)()
        if sampling_holds(host_sampling, host_sampling.temperatures.numel(), found):
            if not found[0]:
                return ALL_GREEDY
            return SamplingPlan(
                all_greedy=False,
                any_top_k=bool(found[1]),
                all_top_k=bool(found[2]),
                max_top_k=found[3],
                any_top_p=bool(found[4]),
                any_min_p=bool(found[5]),
                any_seeded=bool(found[6]),
            )
        return SamplingPlan.from_host(
            host_sampling.temperatures,
            host_sampling.top_ks,
            host_sampling.top_ps,
            host_sampling.min_ps,
            host_sampling.has_seed,
        )

    def sample(
        self,
        logits: torch.Tensor,
        plan: SamplingPlan,
        device_sampling: SamplingBatch,
        seq_lens: torch.Tensor,
        *,
        return_logprob: bool,
        top_logprobs_num: int,
        raw_logits: torch.Tensor | None = None,
        extra: list[torch.Tensor] | None = None,
    ) -> tuple[ForwardOutput, list[torch.Tensor]]:
        """logits [bs, V] float32 on the device, after the sampling controls; `raw_logits`:
        the model's own, for the logprobs (None: the same); `plan` from :meth:`plan`;
        `seq_lens` (device) keys the seeded draws. `extra` device tensors travel in the same
        host transfer; their host copies come back in order."""
        extra = extra or []
        uniforms = None
        if not plan.all_greedy:
            uniforms = torch.rand(logits.shape[0], generator=self.generator, device=logits.device)
            if plan.any_seeded:
                seeded = seeded_uniform(device_sampling.seeds, seq_lens)
                uniforms = torch.where(device_sampling.has_seed, seeded, uniforms)
        ids = sample_tokens(
            logits,
            device_sampling.temperatures,
            device_sampling.top_ks,
            device_sampling.top_ps,
            device_sampling.min_ps,
            uniforms if uniforms is not None else _no_uniforms(logits.device),
            plan,
        )
        if return_logprob or top_logprobs_num > 0:
            raw = logits if raw_logits is None else raw_logits
            return self._with_logprobs(raw, ids, return_logprob, top_logprobs_num, extra)
        host_ids, *host_extra = to_host_packed([ids, *extra], "sampled_tokens")
        return ForwardOutput(next_token_ids=host_ids, device_token_ids=ids), host_extra

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor, ids: torch.Tensor, chosen: bool, k: int, extra: list[torch.Tensor]
    ) -> tuple[ForwardOutput, list[torch.Tensor]]:
        """The tokens and every logprob output in one packed transfer (float64 holds token
        ids exactly), so a step with logprobs syncs once, as one without."""
        logprobs = torch.log_softmax(logits, dim=-1)
        parts = [ids.unsqueeze(1).double(), logprobs.gather(1, ids.unsqueeze(1)).double()]
        if k > 0:
            top_vals, top_ids = logprobs.topk(k, dim=-1)
            parts += [top_vals.double(), top_ids.double()]
        host, *host_extra = to_host_packed([torch.cat(parts, dim=1), *extra], "sampled_tokens")
        out = ForwardOutput(next_token_ids=host[:, 0].long(), device_token_ids=ids)
        if chosen:
            out.next_token_logprobs = host[:, 1].float()
        if k > 0:
            out.top_logprobs = host[:, 2 : 2 + k].float()
            out.top_logprob_ids = host[:, 2 + k :].long()
        return out, host_extra
