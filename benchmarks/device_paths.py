"""The GPU check's `paths` stage: every path and every attention backend against eager.

For each model (the SmolLM2-shaped one, a sliding-window one, an MoE one) and dtype
(float32, bfloat16), one executor on the device's default backend captures its graphs once
(`graph_mode both`) and then generates greedily under each path, switched between runs as
the runtime toggles switch it:

| path | settings |
|---|---|
| eager | graph_mode none |
| eager_no_copy | eager_input_no_copy on |
| full_graph | graph_mode decode |
| piecewise | graph_mode extend |
| both | graph_mode both |
| overlap | both, one step in flight, tokens fed back as future-token references |

plus the other attention backends, eagerly, on the same weights. The reference is a first
eager run that also keeps each step's top-2 logits. Every step must have run the path asked
for (DECODE steps on the full graph, EXTEND steps on the pieces), with no graph fallback,
one device-to-host read and no synchronizing upload.

Rules: float32 tokens equal the reference's exactly. In bfloat16 a path may diverge only at
a near-tie: where the reference's top-2 logits were within `NEAR_TIE_ULPS` bfloat16 ulps of
each other at the first differing token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.device_common import Context, StageResult, build, markdown_table
from executor.client.scheduler import generate
from executor.core.errors import ToggleRefusedError
from executor.core.forward_batch import ForwardBatch
from executor.core.outputs import ForwardOutput
from executor.model_executor import ModelExecutor

PATHS = {  # path -> (eager_input_no_copy, graph_mode, overlap)
    "eager": (False, "none", False),
    "eager_no_copy": (True, "none", False),
    "full_graph": (False, "decode", False),
    "piecewise": (False, "extend", False),
    "both": (False, "both", False),
    "overlap": (False, "both", True),
}
NEAR_TIE_ULPS = 2.0


def expected_path(path: str, mode: str) -> str:
    """The path a step of `mode` (decode | extend) must run under `path`'s settings."""
    no_copy, graph_mode, _ = PATHS[path]
    if mode == "decode" and graph_mode in ("decode", "both"):
        return "full_graph"
    if mode == "extend" and graph_mode in ("extend", "both"):
        return "piecewise"
    return "eager_no_copy" if no_copy else "eager"


def bf16_ulp(x: float) -> float:
    """One bfloat16 unit in the last place at |x| (8 significant bits)."""
    if not math.isfinite(x):  # no reference logits for that step
        return math.nan
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


@dataclass
class Run:
    tokens: list[list[int]]
    steps: int = 0
    paths: dict[str, int] = field(default_factory=dict)  # "<mode>:<path>" -> steps
    problems: list[str] = field(default_factory=list)
    fresh_rows: dict[int, int] = field(default_factory=dict)  # prompt length -> its row


@dataclass
class Reference:
    """The eager run, with each step's top-2 logits by (row, seq_len) and each request's row."""

    run: Run
    top2: dict[tuple[int, int], tuple[float, float]]
    rows: dict[int, int]  # request index -> row


def _recording(
    ex: ModelExecutor,
    run: Run,
    path: str,
    top2: dict[tuple[int, int], tuple[float, float]] | None,
    syncs: bool,
) -> Any:
    def forward(batch: ForwardBatch, **kwargs: Any) -> ForwardOutput:
        out = ex.forward(batch, return_logits=top2 is not None, **kwargs)
        st = out.stats
        if st.mode == "idle":
            return out
        run.steps += 1
        key = f"{st.mode}:{st.path}"
        run.paths[key] = run.paths.get(key, 0) + 1
        want = expected_path(path, st.mode)
        if st.path != want:
            run.problems.append(f"a {st.mode} step ran {st.path}, not {want}")
        if st.graph_fallback is not None:
            run.problems.append(f"graph fallback: {st.graph_fallback}")
        if syncs and top2 is None and (st.d2h_syncs, st.h2d_syncs) != (1, 0):
            run.problems.append(f"d2h_syncs={st.d2h_syncs} h2d_syncs={st.h2d_syncs} (want 1, 0)")
        rows = batch.req_pool_indices.tolist()
        seq_lens = batch.seq_lens.tolist()
        if batch.extend_seq_lens is not None:  # a whole fresh prompt: its length names its row
            for i, n in enumerate(batch.extend_seq_lens.tolist()):
                if n == seq_lens[i]:
                    run.fresh_rows[n] = rows[i]
        if top2 is not None and out.logits is not None:
            values = out.logits.float().topk(2, dim=-1).values
            for i, seq_len in enumerate(seq_lens):
                top2[(rows[i], seq_len)] = (float(values[i, 0]), float(values[i, 1]))
        return out

    return forward


def generate_on(
    ex: ModelExecutor,
    path: str,
    prompts: list[list[int]],
    new_tokens: int,
    top2: dict[tuple[int, int], tuple[float, float]] | None = None,
    *,
    syncs: bool = True,
) -> Run:
    """Generate under `path`; `syncs`: hold each step to one device-to-host read and no
    synchronizing upload (the serving backends; torch_native reads lengths on the host)."""
    no_copy, graph_mode, overlap = PATHS[path]
    ex.toggles.eager_input_no_copy = no_copy
    ex.control.set_graph_mode(graph_mode)
    run = Run([])
    forward = _recording(ex, run, path, top2, syncs)
    run.tokens = generate(
        forward, ex.limits, prompts, max_new_tokens=new_tokens, ignore_eos=True, overlap=overlap
    )
    return run


def reference(ex: ModelExecutor, prompts: list[list[int]], new_tokens: int) -> Reference:
    top2: dict[tuple[int, int], tuple[float, float]] = {}
    run = generate_on(ex, "eager", prompts, new_tokens, top2)
    # Every prompt has its own length, so the prefill's extend lengths name each row.
    rows = {r: run.fresh_rows[len(p)] for r, p in enumerate(prompts) if len(p) in run.fresh_rows}
    return Reference(run, top2, rows)


def compare(ref: Reference, run: Run, prompts: list[list[int]], dtype: str) -> tuple[int, str]:
    """(requests identical, verdict): "" when the run passes, else why not."""
    same, worst = 0, ""
    for r, (want, got) in enumerate(zip(ref.run.tokens, run.tokens, strict=True)):
        if want == got:
            same += 1
            continue
        t = next(i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b)
        first, second = ref.top2.get((ref.rows.get(r, -1), len(prompts[r]) + t), (math.nan,) * 2)
        gap = first - second
        where = f"request {r} token {t}: {want[t]} -> {got[t]}, reference top-2 gap {gap:.3g}"
        if dtype == "float32":
            worst = worst or f"float32 tokens differ at {where}"
        elif not gap <= NEAR_TIE_ULPS * bf16_ulp(first):
            worst = worst or f"not a near-tie at {where} (> {NEAR_TIE_ULPS:g} ulps)"
    return same, worst


def prompts_for(vocab: int, dry_run: bool) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    lengths = (5, 17, 33) if dry_run else (5, 17, 33, 64, 100)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def check_model(ctx: Context, model: str, dtype: str) -> tuple[list[list[Any]], list[str], dict]:
    """Rows of the table, failures, details for one model and dtype."""
    new_tokens = 6 if ctx.dry_run else 24
    ex = build(ctx, model, dtype)
    prompts = prompts_for(ex.limits.vocab_size, ctx.dry_run)
    reports = ex.control.set_graph_mode("both")  # capture once, up front
    capture = {
        r.kind: {"captured": r.captured, "failed": r.failed, "poisoned": r.poisoned}
        for r in reports
    }
    failures = [
        f"{model} {dtype}: capture {k} failed {v['failed']}"
        for k, v in capture.items()
        if v["failed"] or v["poisoned"]
    ]
    ref = reference(ex, prompts, new_tokens)
    rows: list[list[Any]] = []
    details: dict[str, Any] = {"capture": capture, "paths": {}}
    runs = {path: generate_on(ex, path, prompts, new_tokens) for path in PATHS}
    for name in ctx.other_backends:
        other = build(ctx, model, dtype, ex.loaded, attention_backend=name)
        syncs = name != "torch_native"
        runs[f"eager/{name}"] = generate_on(other, "eager", prompts, new_tokens, syncs=syncs)
        if name == "torch_paged" and ctx.cuda:  # refuses DECODE graphs on CUDA, with a reason
            try:
                other.control.set_graph_mode("decode")
                failures.append(f"{model}: torch_paged accepted DECODE graphs on CUDA")
            except ToggleRefusedError:
                pass
    for name, run in runs.items():
        same, verdict = compare(ref, run, prompts, dtype)
        ok = not verdict and not run.problems
        if not ok:
            failures.append(f"{model} {dtype} {name}: {verdict or run.problems[0]}")
        rows.append(
            [
                model,
                dtype,
                name,
                f"{same}/{len(prompts)}",
                run.steps,
                _paths(run),
                "ok" if ok else "FAIL",
            ]
        )
        details["paths"][name] = {"same": same, "paths": run.paths, "problems": run.problems[:5]}
    return rows, failures, details


def _paths(run: Run) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(run.paths.items()))


def stage(ctx: Context) -> StageResult:
    rows: list[list[Any]] = []
    failures: list[str] = []
    details: dict[str, Any] = {}
    for model in ctx.models:
        # The dry run proves the plumbing (bfloat16's rule has a unit test): float32 only.
        dtypes = ("float32",) if ctx.dry_run else ("float32", "bfloat16")
        for dtype in dtypes:
            try:
                r, f, d = check_model(ctx, model, dtype)
            except Exception as e:  # one model's crash must not hide the others' results
                r, f, d = [], [f"{model} {dtype}: {type(e).__name__}: {e}"], {"error": str(e)}
            rows += r
            failures += f
            details[f"{model}/{dtype}"] = d
            if ctx.cuda:
                torch.cuda.empty_cache()
    lines = markdown_table(
        ["model", "dtype", "path", "identical", "steps", "paths taken", "verdict"], rows
    )
    lines += [f"- {f}" for f in failures]
    runs = len(rows)
    figures = f"{runs - len(failures)}/{runs} path x model x dtype runs match eager"
    if failures:
        figures += f"; first failure: {failures[0]}"
    return StageResult("FAIL" if failures or not rows else "PASS", figures, lines, details)
