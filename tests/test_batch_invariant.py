"""`batch_invariant`: a request's prompt logprobs and its logits at every decode step are bitwise
the same run alone, in a batch of 8 mixed requests, in a batch of 32, with its prompt chunked
differently, and on the full-graph and piecewise paths (padded to a bucket, every graph
backend) as eagerly; what it cannot run with is refused at start-up, naming both settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attention.sdpa import sdpa
from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.core.extras_types import RowOutputs

TARGET = 1  # the request followed, in row 1
PROMPT = [(37 * j + 11) % 500 + 3 for j in range(41)]
STEPS = 4
ROW_SLOTS = 128  # row r's tokens go to slots r*128 ...


def _prompt(row: int) -> list[int]:
    return [(31 * row + 7 * j) % 480 + 5 for j in range(3 + (row * 5) % 61)]


def _slots(row: int, start: int, n: int) -> list[int]:
    return [row * ROW_SLOTS + start + j for j in range(n)]


def _run(
    ex: Any, others: int, cut: int = 0, paths: set[tuple[str, bool]] | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The target's prompt logprobs and its logits over STEPS greedy decode steps, beside
    `others` requests (rows 2..); `cut`: its prompt prefilled in two chunks, alone first.
    `paths`: gets (path, padded to a bucket) of every EXTEND and DECODE step."""

    def step(batch: Any, **kw: Any) -> Any:
        out = ex.forward(batch, **kw)
        if paths is not None:
            s = out.stats
            padded = (
                s.padded_batch_size > batch.batch_size or s.padded_num_tokens > batch.num_tokens
            )
            paths.add((str(s.path), padded))
        return out

    # The target last: its rows sit at another place in every GEMM tile.
    rows = {r: _prompt(r) for r in range(2, 2 + others)} | {TARGET: PROMPT}
    prompt_lp: list[torch.Tensor] = []
    if cut:  # the first chunk alone, the second with everyone's prompts
        ask = RowOutputs(row=TARGET, prompt_logprobs=True, next_prompt_token=PROMPT[cut])
        first = make_extend_batch(
            input_ids=[PROMPT[:cut]],
            req_pool_indices=[TARGET],
            out_cache_loc=[_slots(TARGET, 0, cut)],
        )
        out = step(dataclasses.replace(first, row_outputs=(ask,)))
        prompt_lp.append(out.extras.prompt_logprobs.values)
    starts = {r: (cut if r == TARGET else 0) for r in rows}
    batch = make_extend_batch(
        input_ids=[p[starts[r] :] for r, p in rows.items()],
        req_pool_indices=list(rows),
        out_cache_loc=[_slots(r, starts[r], len(p) - starts[r]) for r, p in rows.items()],
        prefix_lens=[starts[r] for r in rows],
        prefix_cache_loc=[_slots(r, 0, starts[r]) for r in rows],
    )
    ask = RowOutputs(row=TARGET, prompt_logprobs=True)
    out = step(dataclasses.replace(batch, row_outputs=(ask,)), return_logits=True)
    prompt_lp.append(out.extras.prompt_logprobs.values)
    logits = [out.logits[-1]]
    lens = {r: len(p) for r, p in rows.items()}
    tokens = out.logits.argmax(-1).tolist()
    for _ in range(STEPS - 1):
        for r in rows:
            lens[r] += 1
        batch = make_decode_batch(
            input_ids=tokens,
            req_pool_indices=list(rows),
            seq_lens=[lens[r] for r in rows],
            out_cache_loc=[r * ROW_SLOTS + lens[r] - 1 for r in rows],
        )
        out = step(batch, return_logits=True)
        logits.append(out.logits[-1])
        tokens = out.logits.argmax(-1).tolist()
    ex.forward(
        dataclasses.replace(
            make_idle_batch(),
            released_req_pool_indices=torch.tensor(list(rows)),
        )
    )
    return torch.cat(prompt_lp), logits


def _executor(
    make_executor: Callable[..., Any],
    invariant: bool,
    dtype: str,
    kernel: str = "auto",
    model: str = "tiny-random",
    **settings: str,
) -> Any:
    """`settings`: graph settings (graph_mode, graph_backend, buckets; none: eager), device=
    and attention_backend= (default: the CPU's torch_paged)."""
    settings = {"graph_mode": "none", "attention_backend": "torch_paged"} | settings
    return make_executor(
        model=model,
        dtype=dtype,
        linear_kernel=kernel,
        batch_invariant=invariant,
        max_reqs=40,
        kv_slots=40 * ROW_SLOTS + 64,
        max_context_len=ROW_SLOTS,
        **settings,
    )


@pytest.mark.parametrize(
    ("dtype", "kernel", "model"),
    [
        ("float32", "onednn", "tiny-random"),
        ("float32", "aten", "tiny-random"),
        ("bfloat16", "aten", "tiny-random"),
        # sliding windows (8 keys on layers 0 and 2) and soft-capped logits
        ("float32", "auto", "tiny-random-gemma2"),
    ],
)
def test_a_requests_logprobs_and_logits_do_not_depend_on_its_batch(
    make_executor: Callable[..., Any],
    dtype: str,
    kernel: str,
    model: str,
    record_property: Callable[[str, Any], None],
) -> None:
    for invariant in (True, False):
        ex = _executor(make_executor, invariant, dtype, kernel, model)
        alone = _run(ex, 0)
        runs = {"batch of 8": _run(ex, 7), "batch of 32": _run(ex, 31), "chunked": _run(ex, 0, 17)}
        for name, (prompt_lp, logits) in runs.items():
            lp_diff = (prompt_lp - alone[0]).abs().max().item()
            logit_diff = max(
                (a - b).abs().max().item() for a, b in zip(logits, alone[1], strict=True)
            )
            if invariant:
                assert torch.equal(prompt_lp, alone[0]), (name, lp_diff)
                for step, (a, b) in enumerate(zip(logits, alone[1], strict=True)):
                    assert torch.equal(a, b), (name, step, (a - b).abs().max().item())
            else:  # how far they are apart without the setting (reported, not judged)
                record_property(
                    f"{dtype} {kernel} off, {name}", f"{lp_diff:.3g} / {logit_diff:.3g}"
                )
                print(
                    f"batch_invariant off, {dtype} {kernel}, {name}: max |diff| prompt logprobs "
                    f"{lp_diff:.3g}, logits {logit_diff:.3g}"
                )


# Buckets every run pads into: DECODE bs 1 -> 2, 8 -> 16, 32 -> 40; EXTEND 41 tokens (or a chunk
# of 17) -> 64, the batches of 8 (237 tokens) and 32 (1061) -> 2048 (256 in the small set). The
# compiled backends trace each bucket's tiled GEMMs unrolled: they get the runs alone and in a
# batch of 8 only. Runs: (other requests, the target's first chunk).
PADDED = {"graph_batch_sizes": "2,16,40", "piecewise_token_sizes": "64,2048"}
PADDED_SMALL = {"graph_batch_sizes": "2,16", "piecewise_token_sizes": "64,256"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "buckets", "runs"),
    [
        ("standin", PADDED, ((0, 0), (7, 0), (31, 0), (7, 17))),
        ("compiled", PADDED_SMALL, ((0, 0), (7, 0))),
        ("compiled_step", PADDED_SMALL, ((0, 0), (7, 0))),
        pytest.param(
            "cuda",
            PADDED,
            ((0, 0), (7, 0), (31, 0), (7, 17)),
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_the_graph_paths_give_the_eager_paths_logprobs_and_logits(
    make_executor: Callable[..., Any],
    backend: str,
    buckets: dict[str, str],
    runs: tuple[tuple[int, int], ...],
) -> None:
    """Full graph (DECODE) and piecewise (EXTEND) steps, padded to their buckets, give a
    request's prompt logprobs and logits bit for bit as the eager path does it alone; the
    compiled backends compile with dynamo's eager backend (the eager kernels); CUDA graphs
    replay the Triton path's kernels."""
    on = {"device": "cuda", "attention_backend": "triton"} if backend == "cuda" else {}
    alone = _run(_executor(make_executor, True, "float32", **on), 0)
    ex = _executor(
        make_executor, True, "float32", graph_mode="both", graph_backend=backend, **buckets, **on
    )
    for others, cut in runs:
        paths: set[tuple[str, bool]] = set()
        prompt_lp, logits = _run(ex, others, cut, paths=paths)
        assert paths == {("piecewise", True), ("full_graph", True)}, (others, cut, paths)
        assert torch.equal(prompt_lp, alone[0]), (others, cut, (prompt_lp - alone[0]).abs().max())
        for step, (a, b) in enumerate(zip(logits, alone[1], strict=True)):
            assert torch.equal(a, b), (others, cut, step, (a - b).abs().max().item())


@pytest.mark.slow
def test_the_setting_is_reported_and_graphs_turn_on_at_runtime(
    make_executor: Callable[..., Any],
) -> None:
    """auto stays eager (the reason says why); graphs turned on while serving give the eager
    steps' logits."""
    ex = _executor(make_executor, True, "float32", graph_mode="auto", **PADDED_SMALL)
    choices = {c.setting: (c.value, c.reason) for c in ex.info.choices}
    assert choices["batch_invariant"][0] == "on"
    assert choices["graph_mode"][0] == "none"
    assert "batch_invariant" in choices["graph_mode"][1]
    eager = _run(ex, 0)
    ex.control.set_graph_mode("both")
    paths: set[tuple[str, bool]] = set()
    graphs = _run(ex, 0, paths=paths)
    assert paths == {("piecewise", True), ("full_graph", True)}
    assert torch.equal(graphs[0], eager[0])
    assert all(torch.equal(a, b) for a, b in zip(graphs[1], eager[1], strict=True))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"attention_backend": "torch_native"}, "attention_backend=torch_native"),
        ({"quantization": "int8"}, "quantization=int8"),
        ({"max_loras": 2}, "LoRA"),
        ({"model": "tiny-random-qwen3-moe"}, "an MoE model"),
    ],
)
def test_what_it_cannot_run_with_is_refused_at_start_up(
    make_executor: Callable[..., Any], overrides: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=f"batch_invariant and {named}"):
        make_executor(batch_invariant=True, **overrides)


@pytest.mark.parametrize("keys_len", [8, 64])
def test_a_soft_capped_rows_attention_is_the_same_alone_and_beside_others(keys_len: int) -> None:
    """The soft-cap path's products with gathered (strided) keys, as torch_paged hands them
    over: a lone request's row equals the same row beside others, bitwise (on an AVX2 CPU a
    lone request's strided view went to another GEMM kernel)."""
    g = torch.Generator().manual_seed(keys_len)

    def gathered(n: int) -> torch.Tensor:  # [n, keys, Hk, D] viewed [n, Hk, keys, D]
        return torch.randn(n, keys_len, 2, 32, generator=g).transpose(1, 2)

    query, keys, values = torch.randn(8, 2, 2, 32, generator=g), gathered(8), gathered(8)
    mask = torch.ones(8, 1, 1, keys_len, dtype=torch.bool)
    mask[:, :, :, keys_len // 2 + 1 :] = False
    kw = {"scale": 0.2, "softcap": 50.0}
    together = sdpa(query, keys, values, mask, **kw)
    for i in (0, 7):
        alone = sdpa(query[i : i + 1], keys[i : i + 1], values[i : i + 1], mask[i : i + 1], **kw)
        assert torch.equal(alone[0], together[i]), i


def test_verify_steps_run_batch_invariant_and_keep_the_greedy_tokens(
    make_executor: Callable[..., Any],
) -> None:
    """VERIFY batches (EXTEND-shaped, with drafts) take the per-query attention too: greedy
    tokens with prompt-lookup drafts equal those without."""
    from executor.client.scheduler import generate

    prompts = [PROMPT[:20] * 2, _prompt(5), _prompt(9)]
    ex = _executor(make_executor, True, "float32")
    plain = generate(ex.forward, ex.limits, prompts, max_new_tokens=12, ignore_eos=True)
    ex = _executor(make_executor, True, "float32")
    drafted = generate(
        ex.forward, ex.limits, prompts, max_new_tokens=12, ignore_eos=True, speculate=3
    )
    assert drafted == plain


def test_on_cuda_only_the_triton_backend_is_taken() -> None:
    """The check reads the device's type only: CUDA's rules are checked on any machine."""
    from executor.config import ExecutorConfig
    from executor.models.batch_invariance import check_batch_invariance

    cuda = torch.device("cuda")
    for backend in ("auto", "triton"):
        check_batch_invariance(
            ExecutorConfig(batch_invariant=True, attention_backend=backend), cuda
        )
    with pytest.raises(ValueError, match=r"attention_backend=torch_paged .*on cuda, only triton"):
        check_batch_invariance(
            ExecutorConfig(batch_invariant=True, attention_backend="torch_paged"), cuda
        )
    with pytest.raises(ValueError, match="device=meta"):
        check_batch_invariance(ExecutorConfig(batch_invariant=True), torch.device("meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_a_requests_logprobs_and_logits_do_not_depend_on_its_batch(
    make_executor: Callable[..., Any], dtype: str
) -> None:
    """The Triton path: cuBLAS linears in 16-row tiles, the per-row Triton norms, decode
    splits by the request's own length, extend keys in blocks at absolute positions."""
    ex = _executor(make_executor, True, dtype, device="cuda", attention_backend="triton")
    alone = _run(ex, 0)
    runs = {"batch of 8": _run(ex, 7), "batch of 32": _run(ex, 31), "chunked": _run(ex, 0, 17)}
    for name, (prompt_lp, logits) in runs.items():
        assert torch.equal(prompt_lp, alone[0]), name
        for step, (a, b) in enumerate(zip(logits, alone[1], strict=True)):
            assert torch.equal(a, b), (name, step, (a - b).abs().max().item())
