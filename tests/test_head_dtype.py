"""`lm_head_dtype=float32`: on a bfloat16 model the LM head (and the logits) in float32, on the
eager path and both graph paths, untied and tied heads. The head adds no rounding of its own:
its logits are the float32 product of the step's (bfloat16) final hidden states and the head's
weights, where a bfloat16 head's are off by bfloat16 rounding; so they are closer to the float32
model's than a bfloat16 head's, which the test measures too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.core.extras_types import HiddenAsk, RowOutputs
from executor.core.forward_batch import ForwardBatch, ForwardMode
from executor.model_executor import ModelExecutor

PROMPTS = [[5, 17, 42, 7, 99, 3, 64, 12, 8, 31, 77, 2], [9, 4, 120, 33, 1, 6, 250]]
DECODE_STEPS = 3


ASK = (RowOutputs(1, hidden=HiddenAsk()), RowOutputs(2, hidden=HiddenAsk()))


def logits_of_steps(ex: ModelExecutor) -> tuple[torch.Tensor, torch.Tensor, set[str]]:
    """Prefill both prompts in one EXTEND, then a few DECODE steps of fixed tokens: the
    logits of every step stacked [steps * 2, vocab] float32, the final hidden states they
    came from (float32), and the paths the steps took."""
    hidden: list[torch.Tensor] = []

    def forward(fb: ForwardBatch) -> torch.Tensor:
        out = ex.forward(replace(fb, row_outputs=ASK), return_logits=True)
        assert out.logits is not None and out.extras is not None
        assert out.extras.hidden_states is not None
        hidden.append(out.extras.hidden_states.values)
        paths.add(out.stats.path)
        return out.logits

    paths: set[str] = set()
    lens = [len(p) for p in PROMPTS]
    slots = [list(range(1, 1 + lens[0])), list(range(100, 100 + lens[1]))]
    fb = make_extend_batch(input_ids=PROMPTS, req_pool_indices=[1, 2], out_cache_loc=slots)
    logits = [forward(fb)]
    seq = list(lens)
    for step in range(DECODE_STEPS):
        locs = [seq[0] + 1, 100 + seq[1]]
        seq = [n + 1 for n in seq]
        fb = make_decode_batch(
            input_ids=[11 + step, 23 + step],
            req_pool_indices=[1, 2],
            out_cache_loc=locs,
            seq_lens=seq,
        )
        logits.append(forward(fb))
    return torch.cat(logits).float(), torch.cat(hidden).float(), paths


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-qwen2"])  # untied, tied head
@pytest.mark.parametrize("graph_mode", ["none", "both"])
def test_float32_head_on_a_bfloat16_model_is_closer_to_the_float32_model(
    make_executor: Callable[..., ModelExecutor], model: str, graph_mode: str
) -> None:
    def run(**kw: object) -> tuple[torch.Tensor, torch.Tensor, set[str]]:
        return logits_of_steps(make_executor(model=model, graph_mode=graph_mode, **kw))

    ref, _, _ = run(dtype="float32")
    bf16, bf16_hidden, paths = run(dtype="bfloat16")
    head, hidden, head_paths = run(dtype="bfloat16", lm_head_dtype="float32")
    assert head_paths == paths
    if graph_mode == "both":
        assert "eager" not in paths, paths
    ex = make_executor(model=model, dtype="bfloat16")
    weight = (ex.model.embed_tokens if ex.model.lm_head is None else ex.model.lm_head).weight
    # The float32 head: the float32 product of the bfloat16 hidden states and weights.
    exact = hidden @ weight.float().T
    torch.testing.assert_close(head, exact, rtol=0, atol=1e-4)
    # The bfloat16 head: off by bfloat16 rounding (within a few ulps of the logits).
    exact_bf16 = bf16_hidden @ weight.float().T
    err = (bf16 - exact_bf16).abs()
    assert float(err.max()) > 1e-3
    assert bool((err <= exact_bf16.abs() * 2.0**-6 + 1e-2).all())
    # And so, on average, closer to the float32 model's logits.
    assert float((head - ref).abs().mean()) < float((bf16 - ref).abs().mean())


def test_the_choice_is_reported_and_a_bad_value_refused(
    make_executor: Callable[..., ModelExecutor],
) -> None:
    choices = {c.setting: c for c in make_executor(dtype="bfloat16").info.choices}
    assert (choices["lm_head_dtype"].value, choices["lm_head_dtype"].reason) == (
        "bfloat16",
        "auto: the model's dtype",
    )
    ex = make_executor(dtype="bfloat16", lm_head_dtype="float32")
    choices = {c.setting: c for c in ex.info.choices}
    assert (choices["lm_head_dtype"].value, choices["lm_head_dtype"].reason) == (
        "float32",
        "configured",
    )
    assert ex.model.head_dtype is torch.float32
    with pytest.raises(ValueError, match="lm_head_dtype must be one of auto, float32"):
        ExecutorConfig(lm_head_dtype="float64")


@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-qwen2"])  # untied, tied head
def test_float32_head_in_a_verify_step(
    make_executor: Callable[..., ModelExecutor], model: str
) -> None:
    """A VERIFY step's logits (one per draft position) come from the float32 head too: closer
    to the float32 model's than a bfloat16 head's."""
    prompt, drafts = PROMPTS[0], [64, 12, 8, 31]

    def verify_logits(**kw: object) -> torch.Tensor:
        ex = make_executor(model=model, **kw)
        n = len(prompt)
        ex.forward(
            make_extend_batch(
                input_ids=[prompt[:-1]], req_pool_indices=[1], out_cache_loc=[list(range(1, n))]
            )
        )
        fb = make_extend_batch(
            input_ids=[[prompt[-1], *drafts]],
            req_pool_indices=[1],
            out_cache_loc=[list(range(n, n + 1 + len(drafts)))],
            prefix_lens=[n - 1],
        )
        out = ex.forward(replace(fb, forward_mode=ForwardMode.VERIFY), return_logits=True)
        assert out.logits is not None and out.logits.shape[0] == 1 + len(drafts)
        assert out.stats.mode == "verify"
        return out.logits.float()

    ref = verify_logits(dtype="float32")
    bf16 = verify_logits(dtype="bfloat16")
    head = verify_logits(dtype="bfloat16", lm_head_dtype="float32")
    assert not torch.equal(head, bf16)
    assert float((head - ref).abs().mean()) < float((bf16 - ref).abs().mean())
