"""Correctness against Hugging Face transformers on the same weights (float32).

Prefill logits agree to max |diff| <= 1e-3, and a 32-token greedy continuation matches
token for token; a difference is accepted only at a near-tie (the two top transformers
logits within 1e-3), after which the sequences are no longer comparable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.models.hf_loader import save_hf_directory
from executor.models.loader import load_model
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights
from tests.parity_util import check_parity

transformers = pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize(
    "model",
    [
        "tiny-random",
        "tiny-random-qwen2",
        "tiny-random-qwen3",
        "tiny-random-qwen3-moe",
        "tiny-random-gemma2",  # transformers' default attention for Gemma 2 is eager
    ],
)
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


# transformers' tokenizer's ids (tests/test_tokenizer.py checks ours against it) of:
# "The capital of France is", "def fibonacci(n):\n" and
# "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n".
SMOLLM2_PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [1604, 3987, 46477, 24, 94, 727, 198],
    [1, 4093, 198, 5820, 1296, 14797, 30, 2, 198, 1, 520, 9531, 198],
]


# SmolLM2's greedy tokens per prompt: half the tiny models' NEW_TOKENS (a step on its weights
# costs what a tiny model's whole run does); the tiny models check the longer runs.
SMOLLM2_NEW_TOKENS = 16


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(cache_dir: Path, hf_smollm2: torch.nn.Module) -> None:
    hf, prompts = hf_smollm2, SMOLLM2_PROMPTS
    reference: dict[tuple[int, ...], Any] = {}  # transformers' answers, computed once
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
    eager = check_parity(ModelExecutor(base, loaded), hf, prompts, reference, SMOLLM2_NEW_TOKENS)
    assert eager.keys() == {"eager"}
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
    paths = check_parity(ModelExecutor(graphs, loaded), hf, prompts, reference, SMOLLM2_NEW_TOKENS)
    assert paths["full_graph"] and paths["piecewise"], paths
