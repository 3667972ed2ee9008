"""The settings matrix: every combination either serves a greedy generation or is refused at
start-up (a ValueError naming the settings), never fails after "ready".

`try_combination` starts an in-process executor the way `serve` does (the model config read
and checked, the executor built and warmed up, the background capture started: "ready"),
then generates greedily, waits for the background capture and generates again on what it
installed. `tests/test_settings_matrix.py` runs a covering subset; `benchmarks/
settings_matrix.py` the whole product (compiled graph backends included, tp 2 too).
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from executor.client.scheduler import generate
from executor.config import ExecutorConfig
from executor.core.toggles import CaptureState
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights

AXES: dict[str, tuple[str, ...]] = {
    "attention_backend": ("auto", "torch_native", "torch_paged", "triton"),
    "graph_mode": ("auto", "none", "decode", "extend", "both"),
    "graph_backend": ("auto", "standin", "compiled", "compiled_step", "cuda"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "quantization": ("auto", "none", "int8", "int4", "gguf"),
}
PROMPTS = [[5, 17, 33, 2, 400, 12], [9, 8]]
NEW_TOKENS = 4
CAPTURE_TIMEOUT_S = 600.0  # a background compile of tiny-random on a loaded 2-core machine


@dataclass
class Outcome:
    combination: dict[str, str]
    tp_size: int
    kind: str  # served | refused | failed
    detail: str = ""  # the refusal's message, or what failed
    tokens: list[list[int]] = field(default_factory=list)

    def __str__(self) -> str:
        settings = " ".join(f"{k}={v}" for k, v in self.combination.items())
        return f"[{self.kind}] tp={self.tp_size} {settings}: {self.detail[:300]}"


def tiny_gguf(directory: Path) -> Path:
    """tiny-random written as a Q8_0 GGUF (its own blocks: `quantization=gguf` runs them)."""
    import gguf

    from tests.gguf_writer import write_gguf

    path = directory / "tiny-q8_0.gguf"
    if not path.exists():
        config = TINY_CONFIGS["tiny-random"]
        write_gguf(
            path, config, tiny_random_weights(config), qtype_2d=gguf.GGMLQuantizationType.Q8_0
        )
    return path


def config_for(combination: dict[str, str], cache_dir: Path, tp_size: int = 1) -> ExecutorConfig:
    """Small sizes, the CPU, tiny-random (as a GGUF file for `quantization=gguf`)."""
    model = (
        str(tiny_gguf(cache_dir)) if combination.get("quantization") == "gguf" else "tiny-random"
    )
    return ExecutorConfig(
        model=model,
        device="cpu",
        max_reqs=4,
        kv_slots=512,
        max_context_len=64,
        max_tokens_per_batch=64,
        piecewise_token_sizes="16,64",
        cache_dir=str(cache_dir),
        tp_size=tp_size,
        **combination,  # type: ignore[arg-type]
    )


def try_combination(combination: dict[str, str], cache_dir: Path) -> Outcome:
    """Start, serve and check one combination at tp 1, in this process."""
    from executor.model_executor import ModelExecutor
    from executor.models.loader import read_model_config

    outcome = Outcome(dict(combination), 1, "refused")
    try:  # start-up: what `serve` does before "ready"
        config = config_for(combination, cache_dir)
        read_model_config(config)
        ex = ModelExecutor(config)
        ex.warmup()
    except ValueError as e:  # a refusal
        outcome.detail = str(e)
        return outcome
    except Exception:
        outcome.kind, outcome.detail = "failed", "start-up crashed: " + traceback.format_exc()
        return outcome
    try:  # after "ready"
        ex.control.start_background()
        outcome.tokens = _generate(ex)
        if not ex.control.wait_for_capture(CAPTURE_TIMEOUT_S):
            raise AssertionError(f"the background capture did not end in {CAPTURE_TIMEOUT_S} s")
        if ex.toggles.capture is CaptureState.FAILED:
            raise AssertionError(f"the background capture failed: {ex.toggles.capture_error}")
        failed = [r.failed for r in ex.control.capture_reports if r.failed]
        if failed:
            raise AssertionError(f"graph buckets failed to capture: {failed}")
        again = _generate(ex)
        outcome.kind, outcome.detail = "served", f"graph_mode={ex.toggles.graph_mode}"
        outcome.tokens += again
    except Exception:
        outcome.kind, outcome.detail = "failed", "after ready: " + traceback.format_exc()
    finally:
        ex.close()
    return outcome


def try_combination_tp(combination: dict[str, str], cache_dir: Path, tp_size: int) -> Outcome:
    """The same at `tp_size` ranks (spawned processes, `tests.tp_util`): served or refused."""
    from executor.models.loader import read_model_config
    from tests.tp_util import generate_tp

    outcome = Outcome(dict(combination), tp_size, "refused")
    try:
        config = config_for(combination, cache_dir, tp_size)
        read_model_config(config)
    except ValueError as e:
        outcome.detail = str(e)
        return outcome
    runs = [{"max_new_tokens": NEW_TOKENS, "ignore_eos": True}]
    try:
        [(tokens, paths)] = generate_tp(config, PROMPTS, runs)
    except AssertionError as e:
        text = str(e)
        if "ValueError" in text and "ModelExecutor(" in text:  # refused while starting a rank
            outcome.detail = text.strip().splitlines()[-1]
            return outcome
        outcome.kind, outcome.detail = "failed", text
        return outcome
    outcome.kind, outcome.detail, outcome.tokens = "served", f"paths {paths}", tokens
    return outcome


def _generate(ex: object) -> list[list[int]]:
    tokens = generate(
        ex.forward,  # type: ignore[attr-defined]
        ex.limits,  # type: ignore[attr-defined]
        PROMPTS,
        max_new_tokens=NEW_TOKENS,
        ignore_eos=True,
    )
    if [len(t) for t in tokens] != [NEW_TOKENS] * len(PROMPTS):
        raise AssertionError(f"generated {tokens}")
    return tokens


def product(axes: dict[str, Sequence[str]]) -> Iterator[dict[str, str]]:
    """Every combination of `axes`' values."""
    names = list(axes)
    for values in itertools.product(*(axes[n] for n in names)):
        yield dict(zip(names, values, strict=True))


def pairwise(axes: dict[str, Sequence[str]]) -> list[dict[str, str]]:
    """A small set of combinations in which every pair of values of two axes occurs at least
    once (greedy: each new combination covers the most pairs not yet covered)."""
    names = list(axes)
    uncovered = {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in axes[a]
        for vb in axes[b]
    }
    chosen: list[dict[str, str]] = []
    candidates = list(product(axes))
    while uncovered:

        def gain(c: dict[str, str]) -> int:
            return sum((a, c[a], b, c[b]) in uncovered for a, b in itertools.combinations(names, 2))

        best = max(candidates, key=gain)
        chosen.append(best)
        for a, b in itertools.combinations(names, 2):
            uncovered.discard((a, best[a], b, best[b]))
    return chosen
