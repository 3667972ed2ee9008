"""What the sampling controls cost per DECODE step, in-process, against the same step without.

    python benchmarks/sampling_controls.py                        # SmolLM2-135M, bs 1, 8, 32
    python benchmarks/sampling_controls.py --model tiny-random --batch-sizes 1,8 --steps 20

Every request of the batch decodes with one variant of controls (set once, at its prefill),
variants alternating step by step so that drift falls on all alike: `none`, `penalties`
(repetition 1.2, frequency 0.5, presence 0.3 over a `--context`-token history), `logit_bias`
(50 entries), `token_ids` (256 banned ids), `vocab_mask` (a new grammar-like mask every step,
half the vocabulary) and `all` of them. Reported: the medians of the step's `sample` phase
(where the controls run) and of its `total` (validate .. sample), in microseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.config import ExecutorConfig
from executor.core.controls_types import RowControl, SamplingControls, VocabMask, mask_words
from executor.core.forward_batch import ForwardBatch
from executor.model_executor import ModelExecutor

VARIANTS = ("none", "penalties", "logit_bias", "token_ids", "vocab_mask", "all")


def controls_of(variant: str, vocab: int) -> SamplingControls | None:
    penalties = {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.3}
    bias = {"logit_bias": tuple((i * 7 % vocab, 1.5) for i in range(50))}
    banned = {"banned_token_ids": tuple(range(vocab // 4, min(vocab, vocab // 4 + 256)))}
    chosen: dict[str, object] = {
        "penalties": penalties,
        "logit_bias": bias,
        "token_ids": banned,
        "all": {**penalties, **bias, **banned},
    }.get(variant, {})
    return SamplingControls(**chosen) if chosen else None  # type: ignore[arg-type]


@dataclass
class Result:
    bs: int
    sample_us: dict[str, list[float]] = field(default_factory=dict)
    total_us: dict[str, list[float]] = field(default_factory=dict)


class Rows:
    """`bs` requests per variant, prefilled once, then decoded step by step."""

    def __init__(self, ex: ModelExecutor, bs: int, context: int) -> None:
        self.ex, self.bs = ex, bs
        self.vocab = ex.limits.vocab_size
        self.words = mask_words(self.vocab)
        self.next_slot = 1
        self.rows: dict[str, list[int]] = {}
        self.lens: dict[str, list[int]] = {}
        self.last: dict[str, list[int]] = {}
        gen = torch.Generator().manual_seed(0)
        row = 1
        for variant in VARIANTS:
            rows = list(range(row, row + bs))
            row += bs
            prompts = [
                torch.randint(0, self.vocab, (context,), generator=gen).tolist() for _ in rows
            ]
            fb = make_extend_batch(
                input_ids=prompts, req_pool_indices=rows, out_cache_loc=self._slots(prompts)
            )
            c = controls_of(variant, self.vocab)
            if c is not None:
                fb = dataclasses.replace(fb, row_controls=tuple(RowControl(r, c) for r in rows))
            self.rows[variant], self.lens[variant] = rows, [context] * bs
            self.last[variant] = self.ex.forward(fb).next_token_ids.tolist()

    def _slots(self, prompts: list[list[int]]) -> list[list[int]]:
        out = []
        for p in prompts:
            out.append(list(range(self.next_slot, self.next_slot + len(p))))
            self.next_slot += len(p)
        return out

    def decode(self, variant: str, gen: torch.Generator) -> tuple[float, float]:
        self.lens[variant] = [n + 1 for n in self.lens[variant]]
        fb: ForwardBatch = make_decode_batch(
            input_ids=self.last[variant],
            req_pool_indices=self.rows[variant],
            seq_lens=self.lens[variant],
            out_cache_loc=[s[0] for s in self._slots([[0]] * self.bs)],
        )
        if variant in ("vocab_mask", "all"):
            words = torch.randint(-(2**31), 2**31, (self.bs, self.words), generator=gen)
            fb = dataclasses.replace(fb, vocab_mask=VocabMask(words=words.to(torch.int32)))
        out = self.ex.forward(fb)
        self.last[variant] = out.next_token_ids.tolist()
        t = out.stats.timings_ns
        return t["sample"] / 1e3, t["total"] / 1e3


def measure(ex: ModelExecutor, bs: int, steps: int, context: int, warmup: int = 2) -> Result:
    rows = Rows(ex, bs, context)
    gen = torch.Generator().manual_seed(1)
    result = Result(bs)
    for step in range(warmup + steps):
        order = VARIANTS if step % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            sample, total = rows.decode(variant, gen)
            if step >= warmup:
                result.sample_us.setdefault(variant, []).append(sample)
                result.total_us.setdefault(variant, []).append(total)
    return result


def table(results: list[Result]) -> str:
    med: Callable[[list[float]], float] = statistics.median
    lines = [
        "| bs | " + " | ".join(VARIANTS) + " |",
        "|---:|" + "---:|" * len(VARIANTS),
    ]
    for r in results:
        cells = [f"{med(r.sample_us[v]):.0f} / {med(r.total_us[v]):.0f}" for v in VARIANTS]
        lines.append(f"| {r.bs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    ex = ModelExecutor(
        ExecutorConfig(
            model=args.model,
            dtype=args.dtype,
            max_reqs=max(sizes) * len(VARIANTS),
            kv_slots=max(sizes) * len(VARIANTS) * (args.context + args.steps + 8) + 1,
            max_context_len=args.context + args.steps + 8,
            graph_mode="none",
        )
    )
    results = []
    for bs in sizes:
        results.append(measure(ex, bs, args.steps, args.context))
        everyone = torch.arange(1, bs * len(VARIANTS) + 1)  # free the rows for the next size
        ex.forward(dataclasses.replace(make_idle_batch(), released_req_pool_indices=everyone))
    print(
        f"{platform.machine()}, torch {torch.__version__}, model {args.model}, "
        f"dtype {ex.dtype}, context {args.context}, {args.steps} steps"
    )
    print("sample / total, us (medians)")
    print(table(results))


if __name__ == "__main__":
    main()
