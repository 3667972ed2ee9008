"""The GPU check's `memory_release` stage: `ReleaseMemory` by tag on the device, measured.

A model of about 80 MiB of float32 weights and 64 MiB of KV (`tests.weights_util.MEDIUM`, as
`tests/test_memory_release.py` uses), run greedily, then each tag released in turn and resumed, with
and without DECODE graphs. Per release it reads what the allocator freed
(`memory_allocated`), what it gave back to the driver (`memory_reserved`) and what the driver
counts free (`mem_get_info`); the tag passes when the driver's figure rose by 90% of the tag's
bytes. When it did not, the allocator's snapshot (with allocation history recorded from the
start) names the segments still held and the code that allocated their live blocks, which is
what tells a block still referenced from a segment pinned by another tensor. On the CPU (dry
run) the resident set stands in for the driver's figure and there is no snapshot.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.device_common import Context, StageResult, markdown_table
from executor.client.scheduler import generate
from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.models.hf_loader import save_hf_directory
from executor.models.tiny_random import tiny_random_weights
from executor.weights.memory import TAGS, device_free_bytes
from tests.weights_util import MEDIUM

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 40, 41, 200]]
MIB = 2**20


def _greedy(ex: ModelExecutor) -> list[list[int]]:
    return generate(ex.forward, ex.limits, PROMPTS, max_new_tokens=6, ignore_eos=True)


def _allocator(ctx: Context) -> tuple[int, int]:
    if not ctx.cuda:
        return 0, 0
    return torch.cuda.memory_allocated(ctx.device), torch.cuda.memory_reserved(ctx.device)


def _frames(block: dict[str, Any], root: str) -> str:
    """The allocating call's innermost frames in this repository (else the innermost)."""
    frames = block.get("frames") or []
    ours = [f for f in frames if root in f.get("filename", "")] or frames
    return " < ".join(
        f"{Path(f['filename']).name}:{f['line']} {f.get('name', '')}" for f in ours[:4]
    )


def held_segments(ctx: Context, limit: int = 8) -> list[str]:
    """The largest segments that still hold live blocks, and who allocated those blocks."""
    root = str(Path(__file__).resolve().parents[1])
    snapshot = torch.cuda.memory._snapshot(ctx.device)
    segments = [s for s in snapshot["segments"] if s.get("allocated_size", 0) > 0]
    segments.sort(key=lambda s: -s["total_size"])
    lines = []
    for s in segments[:limit]:
        live = [b for b in s["blocks"] if b["state"] == "active_allocated"]
        lines.append(
            f"- segment {s['total_size'] / MIB:.1f} MiB, pool {s.get('segment_pool_id')}, "
            f"{s['allocated_size'] / MIB:.2f} MiB live in {len(live)} blocks"
        )
        for b in sorted(live, key=lambda b: -b["size"])[:3]:
            lines.append(f"  - {b['size'] / MIB:.2f} MiB: {_frames(b, root)}")
    return lines


def _variant(
    ctx: Context, path: Path, graph_mode: str, keep: list[ModelExecutor]
) -> tuple[list[list[Any]], list[str], bool]:
    overrides: dict[str, Any] = {}
    if graph_mode != "none":
        overrides = {"graph_batch_sizes": "1,4", "graph_backend": "cuda" if ctx.cuda else "standin"}
    ex = ModelExecutor(
        ExecutorConfig(
            model=str(path),
            device=str(ctx.device),
            dtype="float32",
            max_reqs=8,
            kv_slots=8192,
            max_context_len=256,
            cache_dir=str(ctx.cache_dir),
            graph_mode=graph_mode,
            **overrides,
        )
    )
    keep.append(ex)  # alive through the next variant: its memory shares the allocator's cache
    before = _greedy(ex)
    # A CPU's KV pages are committed in the executor's idle time (`KVPool.commit_pages`): the
    # releases are measured once they are all resident, as a server's are once it was idle.
    if ex.kv_pool.pages is not None:
        ex.kv_pool.pages.wait()
    rows: list[list[Any]] = []
    notes: list[str] = []
    ok = True
    # Twice: the second release frees what the resume re-allocated into the cache's segments.
    for cycle, tag in ((c, t) for c in (1, 2) for t in TAGS):
        if cycle == 2 and tag == TAGS[0]:
            ex.weights.resume(TAGS, from_update=False)
            _greedy(ex)
        nbytes = ex.weights.memory.nbytes(tag)
        free0, (alloc0, reserved0) = device_free_bytes(ex.device), _allocator(ctx)
        ex.weights.release((tag,))
        freed = device_free_bytes(ex.device) - free0
        alloc1, reserved1 = _allocator(ctx)
        passed = freed >= 0.9 * nbytes
        ok = ok and passed
        rows.append(
            [
                graph_mode,
                cycle,
                tag,
                f"{nbytes / MIB:.1f}",
                f"{(alloc0 - alloc1) / MIB:.1f}" if ctx.cuda else "-",
                f"{(reserved0 - reserved1) / MIB:.1f}" if ctx.cuda else "-",
                f"{freed / MIB:.1f}",
                "ok" if passed else "SHORT",
            ]
        )
        if not passed and ctx.cuda:
            notes.append(f"{graph_mode}, release {cycle} of {tag}: segments still held")
            notes += held_segments(ctx)
    ex.weights.resume(TAGS, from_update=False)
    after = _greedy(ex)
    if after != before:
        ok = False
        notes.append(f"{graph_mode}: greedy tokens after the resume differ: {after} vs {before}")
    if graph_mode != "none":  # captured again after each resume, every bucket
        runner = ex.runner.decode_graphs
        report = getattr(runner, "report", None)
        if report is None or report.failed or not report.captured:
            ok = False
            why = report.failed if report is not None else "no DECODE runner"
            notes.append(f"{graph_mode}: the capture after the last resume failed: {why}")
    return rows, notes, ok


def stage(ctx: Context) -> StageResult:
    if ctx.cuda:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "medium"
        save_hf_directory(path, MEDIUM, tiny_random_weights(MEDIUM))
        rows, notes, ok = [], [], True
        keep: list[ModelExecutor] = []
        for mode in ("none", "decode"):
            r, n, good = _variant(ctx, path, mode, keep)
            rows, notes, ok = rows + r, notes + n, ok and good
    header = [
        "graphs",
        "release",
        "tag",
        "MiB",
        "allocator freed",
        "reserved returned",
        "free rose",
        "",
    ]
    lines = markdown_table(header, rows) + notes
    figures = ", ".join(f"{r[0]} #{r[1]} {r[2]} {r[6]}/{r[3]}" for r in rows)
    details = {"rows": rows, "notes": notes}
    return StageResult("PASS" if ok else "FAIL", f"freed (MiB): {figures}", lines, details)
