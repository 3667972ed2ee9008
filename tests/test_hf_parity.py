"""Correctness against Hugging Face transformers on the same weights (float32).

Prefill logits agree to max |diff| <= 1e-3, and a 32-token greedy continuation matches
token for token; a difference is accepted only at a near-tie (the two top transformers
logits within 1e-3), after which the sequences are no longer comparable.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from executor.batch_prep import make_extend_batch
from executor.client.scheduler import generate
from executor.config import ExecutorConfig
from executor.forward_batch import ForwardBatch
from executor.model_executor import ModelExecutor
from executor.models.hf_loader import save_hf_directory
from executor.models.loader import load_model, packaged_smollm2_path
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights
from executor.step.outputs import ForwardOutput

transformers = pytest.importorskip("transformers")

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


def check_parity(ex: ModelExecutor, hf: torch.nn.Module, prompts: list[list[int]]) -> Counter[str]:
    """Prefill logits and greedy tokens against transformers; the paths our steps took."""
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
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        diff = float((ours[0] - ref).abs().max())
        assert diff <= LOGIT_TOL, f"prompt {row}: prefill logits differ by {diff}"
    ours_gen = generate(forward, ex.limits, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, ours_tokens in zip(prompts, ours_gen, strict=True):
        ref_tokens, gaps = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_greedy_matches(ours_tokens, ref_tokens, gaps)
    return paths


@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-qwen2"])
def test_tiny_random_matches_transformers(tmp_path: Path, cache_dir: Path, model: str) -> None:
    config = TINY_CONFIGS[model]
    save_hf_directory(tmp_path / model, config, tiny_random_weights(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / model, dtype=torch.float32
    ).eval()
    ex = ModelExecutor(
        ExecutorConfig(
            model=str(tmp_path / model),
            max_reqs=8,
            kv_slots=1024,
            cache_dir=str(cache_dir),
            dtype="float32",
        )
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (1, 7, 40)]
    check_parity(ex, hf, prompts)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(cache_dir: Path) -> None:
    path = packaged_smollm2_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n",
        "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    ]
    prompts = [tok(t).input_ids for t in texts]
    base = ExecutorConfig(
        model="smollm2",
        max_reqs=8,
        kv_slots=2048,
        max_context_len=1024,
        cache_dir=str(cache_dir),
        dtype="float32",
    )
    loaded = load_model(
        "smollm2",
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_positions=1024,
        cache_dir=cache_dir,
    )
    assert check_parity(ModelExecutor(base, loaded), hf, prompts).keys() == {"eager"}
    # The graph paths on the same weights: full-graph DECODE and piecewise EXTEND through the
    # stand-in. (The compiled backend gives the stand-in's tokens, tests/test_compiled_graphs.py;
    # compiling SmolLM2 here would cost minutes of a shared 2-core machine.)
    graphs = base.replace(  # one bucket each (3 requests pad to 4; prompts fit in 32)
        graph_mode="both",
        graph_backend="standin",
        graph_batch_sizes="4",
        piecewise_token_sizes="32",
        max_context_len=256,  # one KV bucket
    )
    paths = check_parity(ModelExecutor(graphs, loaded), hf, prompts)
    assert paths["full_graph"] and paths["piecewise"], paths
