"""LoRA on SmolLM2-135M in float32 against transformers + peft: each row's greedy tokens.

    python benchmarks/lora_parity.py                  # eager and both graph paths (stand-in)
    python benchmarks/lora_parity.py --new-tokens 16

The suite's version of this check runs on a random tiny llama (tests/test_lora.py); this one
runs the packaged SmolLM2 (its GGUF, dequantized to float32 by transformers and by the
executor alike). Two adapters built with peft over the transformers model (ranks 8 and 16,
different targets and alphas, seeded non-zero A and B) are saved as PEFT files; one executor
loads both and runs one batch of rows on the first adapter, the second and the base model. A
row passes when its greedy tokens equal peft's, or first differ where peft's top-2 logits are
within the parity tolerance (a near-tie). Exits 1 if any row fails.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

from executor.client.scheduler import generate
from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.models.loader import packaged_smollm2_path
from tests.lora_util import SPECS
from tests.parity_util import LOGIT_TOL, hf_greedy

TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
)


def write_adapter(base: torch.nn.Module, out: Path, config: dict, seed: int) -> Path:
    """peft's LoRA over a copy of `base`, its A and B replaced by seeded random values."""
    model = get_peft_model(copy.deepcopy(base), LoraConfig(**config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) / param.shape[1] ** 0.5)
    model.save_pretrained(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--cache-dir", default="")
    args = ap.parse_args()
    path = packaged_smollm2_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompts = [tok(t).input_ids for t in TEXTS]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapters = {s.name: write_adapter(hf, root / s.name, s.config, s.seed) for s in SPECS}
        rows = [(p, name) for p in prompts for name in ("", *adapters)]
        refs = []
        for prompt, name in rows:
            model = PeftModel.from_pretrained(copy.deepcopy(hf), adapters[name]) if name else hf
            refs.append(hf_greedy(model.eval(), prompt, args.new_tokens))
        failed = 0
        for graph_mode in ("none", "both"):
            config = ExecutorConfig(
                model="smollm2",
                dtype="float32",
                quantization="none",
                max_reqs=16,
                kv_slots=2048,
                max_context_len=256,
                cache_dir=args.cache_dir or str(root / "cache"),
                graph_mode=graph_mode,
                graph_backend="standin",
                graph_batch_sizes="16",
                piecewise_token_sizes="256",
                lora=",".join(f"{n}={p}" for n, p in adapters.items()),
                max_lora_rank=16,
            )
            ex = ModelExecutor(config)
            paths: set[str] = set()

            def forward(fb, ex=ex, paths=paths, **kw):  # type: ignore[no-untyped-def]
                out = ex.forward(fb, **kw)
                paths.add(str(out.stats.path))
                return out

            t0 = time.perf_counter()
            got = generate(
                forward,
                ex.limits,
                [p for p, _ in rows],
                max_new_tokens=args.new_tokens,
                lora=[n for _, n in rows],
            )
            seconds = time.perf_counter() - t0
            for (_, name), ours, (want, gaps) in zip(rows, got, refs, strict=True):
                at = next(
                    (i for i, (a, b) in enumerate(zip(ours, want, strict=True)) if a != b), None
                )
                ok = at is None or gaps[at] <= LOGIT_TOL
                failed += not ok
                tie = "" if at is None else f" (first differs at {at}, top-2 gap {gaps[at]:.4f})"
                print(f"{graph_mode:5} {name or 'base':6} {'ok' if ok else 'FAIL'}{tie}")
            print(f"{graph_mode}: paths {sorted(paths)}, {len(rows)} rows in {seconds:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
