"""PEFT adapters with seeded, non-zero random weights, and transformers + peft's greedy
tokens for them: the reference the LoRA tests compare against.

`make_adapter` builds a LoRA model over a Hugging Face directory with peft itself, replaces
every `lora_A` / `lora_B` weight with seeded random values (peft initializes B to zero, which
would test nothing), and saves it with `save_pretrained`: the files a user would bring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.parity_util import hf_greedy

# Two adapters the tests share: ranks 8 and 16, different targets, different alphas.
ATTN_R8 = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]}
MLP_R16 = {
    "r": 16,
    "lora_alpha": 8,
    "target_modules": ["k_proj", "gate_proj", "up_proj", "down_proj"],
}


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    config: dict[str, Any]
    seed: int


SPECS = (AdapterSpec("attn8", ATTN_R8, 1), AdapterSpec("mlp16", MLP_R16, 2))


def base_model(model_dir: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(
    model_dir: Path, out: Path, config: dict[str, Any], seed: int, scale: float = 1.0
) -> Path:
    """A PEFT LoRA adapter of `model_dir` saved at `out`, with random A and B (A ~ N(0, 1/in),
    B ~ scale * N(0, 1/r) before peft's alpha / r)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base_model(model_dir), LoraConfig(**config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=g) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(scale * torch.randn(param.shape, generator=g) / param.shape[1] ** 0.5)
    model.save_pretrained(out)
    return out


def peft_model(model_dir: Path, adapter: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model(model_dir), adapter).eval()


def reference_tokens(
    model_dir: Path,
    adapters: dict[str, Path],
    prompts: Sequence[list[int]],
    loras: Sequence[str],
    n: int,
) -> list[list[int]]:
    """transformers (+ peft for a named adapter) greedy tokens of each prompt."""
    models: dict[str, torch.nn.Module] = {}
    out = []
    for prompt, name in zip(prompts, loras, strict=True):
        if name not in models:
            models[name] = peft_model(model_dir, adapters[name]) if name else base_model(model_dir)
        out.append(hf_greedy(models[name], prompt, n)[0])
    return out
