"""Fidelity of `--quantization gguf` against the float32 path on the same GGUF file.

    PYTHONPATH=.:proto .venv/bin/python benchmarks/quant_fidelity.py [--model smollm2]

The float32 path runs the values ggml dequantizes; the gguf path runs the same blocks through
each `--quant-kernels` kernel: `qmm` (int8 activations per group of 32, as llama.cpp) and
`torch` (torch's int4 kernels, bfloat16 activations). Two measurements for each (results in
docs/performance.md):

1. Greedy decoding of the test prompts (tests/test_hf_parity.py's) for `--new-tokens` tokens:
   the share of tokens equal up to the first divergence, and at each divergence the float32
   path's top-2 logit gap and the largest |logit difference| between the paths there.
2. Perplexity of both paths on English text a package ships (Debian's base-files:
   /usr/share/common-licenses/GPL-3), in independent windows of `--window` tokens.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.models.layers import Embedding

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]
TEXT = Path("/usr/share/common-licenses/GPL-3")


def greedy(ex: ModelExecutor, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens on row 1 and the logits each was chosen from."""
    slots = list(range(1, len(prompt) + n + 1))
    out = ex.forward(
        make_extend_batch(
            input_ids=[prompt], req_pool_indices=[1], out_cache_loc=[slots[: len(prompt)]]
        ),
        return_logits=True,
    )
    tokens, logits = [], []
    for i in range(n):
        assert out.logits is not None
        logits.append(out.logits[0])
        tokens.append(int(out.logits[0].argmax()))
        if i + 1 == n:
            break
        pos = len(prompt) + i
        out = ex.forward(
            make_decode_batch(
                input_ids=[tokens[-1]],
                req_pool_indices=[1],
                seq_lens=[pos + 1],
                out_cache_loc=[slots[pos]],
            ),
            return_logits=True,
        )
    return tokens, logits


def forced_logits(ex: ModelExecutor, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """Logits after `prompt` and after each token of `forced` (teacher forcing)."""
    slots = list(range(1, len(prompt) + len(forced) + 1))
    out = ex.forward(
        make_extend_batch(
            input_ids=[prompt], req_pool_indices=[1], out_cache_loc=[slots[: len(prompt)]]
        ),
        return_logits=True,
    )
    assert out.logits is not None
    logits = [out.logits[0]]
    for i, tok in enumerate(forced[:-1]):
        pos = len(prompt) + i
        out = ex.forward(
            make_decode_batch(
                input_ids=[tok],
                req_pool_indices=[1],
                seq_lens=[pos + 1],
                out_cache_loc=[slots[pos]],
            ),
            return_logits=True,
        )
        assert out.logits is not None
        logits.append(out.logits[0])
    return logits


def all_position_logits(ex: ModelExecutor, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one EXTEND on row 1: the final norm's output for
    every token (a forward hook) through the model's own head."""
    captured: list[torch.Tensor] = []
    handle = ex.model.norm.register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    try:
        ex.forward(
            make_extend_batch(
                input_ids=[ids], req_pool_indices=[1], out_cache_loc=[list(range(1, len(ids) + 1))]
            )
        )
    finally:
        handle.remove()
    hidden = captured[-1]
    with torch.inference_mode():
        head = ex.model.lm_head
        if head is None:  # tied to a float embedding
            embed = ex.model.embed_tokens
            assert isinstance(embed, Embedding)
            return torch.nn.functional.linear(hidden, embed.weight).float()
        return head(hidden).float()


def perplexity(ex: ModelExecutor, ids: list[int], window: int) -> tuple[float, int]:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        logits = all_position_logits(ex, chunk[:-1])
        target = torch.tensor(chunk[1:])
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        count += len(target)
    return math.exp(nll / count), count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--text-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--cache-dir", default="")
    p.add_argument(
        "--gguf-dtype",
        default="auto",
        help="the gguf path's model dtype (auto: bfloat16 on CPUs with native bfloat16, where "
        "norms, rotary and attention run in bfloat16 too; float32 elsewhere)",
    )
    p.add_argument(
        "--quant-kernels", default="qmm,torch", help="comma-separated quant_kernel values"
    )
    args = p.parse_args()
    base = ExecutorConfig(
        model=args.model,
        max_reqs=4,
        kv_slots=4096,
        max_context_len=2048,
        cache_dir=args.cache_dir,
        dtype="float32",  # the reference is float32 whatever the CPU (auto may be bfloat16)
    )
    ref = ModelExecutor(base)
    tok = ref.load_tokenizer()
    ids = tok.encode(TEXT.read_text())[: args.text_tokens]
    ppl_ref, n = perplexity(ref, ids, args.window)
    print(f"perplexity on {n} tokens of {TEXT} (windows of {args.window}): float32 {ppl_ref:.4f}")
    for kernel in args.quant_kernels.split(","):
        quant = ModelExecutor(
            base.replace(quantization="gguf", dtype=args.gguf_dtype, quant_kernel=kernel)
        )
        print(f"--- gguf path, quant_kernel {quant.loaded.quant_kernel}, dtype {quant.info.dtype}")
        compare(ref, quant, tok, args.new_tokens)
        ppl_q, _ = perplexity(quant, ids, args.window)
        print(
            f"perplexity: gguf {ppl_q:.4f}, relative to float32 "
            f"{(ppl_q - ppl_ref) / ppl_ref * 100:+.2f}%"
        )


def compare(ref: ModelExecutor, quant: ModelExecutor, tok: Any, new_tokens: int) -> None:
    """Greedy tokens of both paths on the prompts, with the gap and difference at divergences."""
    print(
        f"weights: float32 {ref.loaded.weight_bytes / 2**20:.1f} MiB, "
        f"gguf {quant.loaded.weight_bytes / 2**20:.1f} MiB "
        f"({quant.loaded.weight_bytes / ref.loaded.weight_bytes:.3f} of float32)"
    )
    equal_total = 0
    for text in PROMPTS:
        prompt = tok.encode(text)
        ref_tokens, ref_logits = greedy(ref, prompt, new_tokens)
        q_tokens, _ = greedy(quant, prompt, new_tokens)
        first = next(
            (i for i, (a, b) in enumerate(zip(ref_tokens, q_tokens, strict=True)) if a != b), None
        )
        equal = new_tokens if first is None else first
        equal_total += equal
        line = f"{text!r:.40}: {equal}/{new_tokens} equal up to the first divergence"
        if first is not None:
            # Both paths on the float32 path's tokens, to compare logits at the divergence.
            q_logits = forced_logits(quant, prompt, ref_tokens[: first + 1])
            gap = ref_logits[first].topk(2).values
            diff = float((ref_logits[first] - q_logits[first]).abs().max())
            line += (
                f"; at token {first}: float32 top-2 gap {float(gap[0] - gap[1]):.3f}, "
                f"max |logit diff| {diff:.3f}"
            )
        print(line)
    share = equal_total / (new_tokens * len(PROMPTS))
    print(f"share of greedy tokens equal up to the first divergence: {share:.3f}")


if __name__ == "__main__":
    main()
