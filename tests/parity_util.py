"""Parity with Hugging Face transformers: our prefill logits and greedy tokens against its.

Prefill logits agree to max |diff| <= 1e-3, and a greedy continuation matches token for
token; a difference is accepted only at a near-tie (the two top transformers logits within
1e-3), after which the sequences are no longer comparable.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from executor.batch_prep import make_extend_batch
from executor.client.scheduler import generate
from executor.core.forward_batch import ForwardBatch
from executor.core.outputs import ForwardOutput
from executor.model_executor import ModelExecutor

NEW_TOKENS = 32
LOGIT_TOL = 1e-3


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from transformers, with the top-2 logit gap at each step."""
    tokens, gaps = [], []
    past = None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(n):
            out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            top2 = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            gaps.append(float(top2[0] - top2[1]))
            ids = torch.tensor([[tokens[-1]]])
    return tokens, gaps


def assert_greedy_matches(ours: list[int], ref: list[int], gaps: list[float]) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            assert gaps[i] <= LOGIT_TOL, (
                f"token {i}: ours {a}, transformers {b}, top-2 gap {gaps[i]:.2e} is no near-tie"
            )
            return


def check_parity(
    ex: ModelExecutor,
    hf: torch.nn.Module,
    prompts: list[list[int]],
    reference: dict[tuple[int, ...], Any] | None = None,
    new_tokens: int = NEW_TOKENS,
) -> Counter[str]:
    """Prefill logits and `new_tokens` greedy tokens against transformers; the paths our steps
    took. `reference`: transformers' answers per prompt, filled on the first call and reused
    by the next (another executor on the same weights, the same `new_tokens`)."""
    reference = {} if reference is None else reference

    def theirs(prompt: list[int]) -> Any:  # (last prefill logits, greedy tokens, top-2 gaps)
        key = tuple(prompt)
        if key not in reference:
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt])).logits[0, -1].float()
            reference[key] = (logits, *hf_greedy(hf, prompt, new_tokens))
        return reference[key]

    paths: Counter[str] = Counter()

    def forward(fb: ForwardBatch, **kwargs: Any) -> ForwardOutput:
        out = ex.forward(fb, **kwargs)
        paths[out.stats.path] += 1
        return out

    slot = 1
    for row, prompt in enumerate(prompts, start=1):
        fb = make_extend_batch(
            input_ids=[prompt],
            req_pool_indices=[row],
            out_cache_loc=[list(range(slot, slot + len(prompt)))],
        )
        slot += len(prompt)
        ours = forward(fb, return_logits=True).logits
        assert ours is not None
        ref = theirs(prompt)[0]
        diff = float((ours[0] - ref).abs().max())
        assert diff <= LOGIT_TOL, f"prompt {row}: prefill logits differ by {diff}"
    ours_gen = generate(forward, ex.limits, prompts, max_new_tokens=new_tokens, ignore_eos=True)
    for prompt, ours_tokens in zip(prompts, ours_gen, strict=True):
        _, ref_tokens, gaps = theirs(prompt)
        assert_greedy_matches(ours_tokens, ref_tokens, gaps)
    return paths
