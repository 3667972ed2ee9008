"""Host<->device copies and syncs per step, before and after issue 15's staged copy.

After: each step's `StepStats` (`h2d_copies`, `h2d_syncs`, `d2h_syncs`) and the bytes the
staging moved, from `ops.host_transfer.host_transfers`, for four steps: a prefill, an EXTEND
on a shared prefix, a greedy DECODE, and a sampled DECODE with logprobs and top-5.

Before: the uploads the previous step made, replayed through the same counted door
(`ops.host_transfer.to_device`) on the same completed batch: one upload per device field
of the batch and per sampling field (`ForwardBatch.to` / `SamplingBatch.to`, pageable memory,
so a sync each on CUDA), then the row-table write's three blocking uploads
(`ReqToTokenPool.write_batch` without staged cells); and one device-to-host transfer for the
tokens plus one for the logprobs when asked (the previous `Sampler`). Counts do not depend
on the model or the device, so this runs on CPU with the tiny random model.

    python benchmarks/step_transfers.py

Last, what the staging costs on the host: the median `stage` phase (row-table cells, the
packed copy, the device views; `StepStats.timings_ns`) over 200 bs-1 DECODE steps. On CPU
the "device" copy is a memcpy, so this is the Python cost of packing; run the same command on
an older commit for the comparison in docs/performance.md.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import structlog

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.core.clock import StepClock
from executor.core.forward_batch import ForwardBatch, SamplingParams
from executor.core.step_batch import StepBatch
from executor.model_executor import ModelExecutor
from ops.host_transfer import host_transfers, to_device


def _steps() -> list[tuple[str, ForwardBatch]]:
    sampled = [SamplingParams(temperature=0.8, top_k=20, seed=7)] * 4
    return [
        (
            "EXTEND prefill, bs 4 x 32 tokens",
            make_extend_batch(
                input_ids=[[3 + i] * 32 for i in range(4)],
                req_pool_indices=[1, 2, 3, 4],
                out_cache_loc=[list(range(1 + 32 * i, 33 + 32 * i)) for i in range(4)],
            ),
        ),
        (
            "EXTEND on a shared 32-token prefix, bs 1 x 8",
            make_extend_batch(
                input_ids=[[9] * 8],
                req_pool_indices=[5],
                out_cache_loc=[list(range(200, 208))],
                prefix_lens=[32],
                prefix_cache_loc=[list(range(1, 33))],
            ),
        ),
        (
            "DECODE greedy, bs 4",
            make_decode_batch(
                input_ids=[5] * 4,
                req_pool_indices=[1, 2, 3, 4],
                seq_lens=[33] * 4,
                out_cache_loc=[300, 301, 302, 303],
            ),
        ),
        (
            "DECODE sampled + logprobs + top-5, bs 4",
            make_decode_batch(
                input_ids=[6] * 4,
                req_pool_indices=[1, 2, 3, 4],
                seq_lens=[34] * 4,
                out_cache_loc=[304, 305, 306, 307],
                sampling=sampled,
                return_logprob=True,
                top_logprobs_num=5,
            ),
        ),
    ]


def _before(ex: ModelExecutor, batch: ForwardBatch) -> tuple[int, int]:
    """(host-to-device uploads, device-to-host syncs) of the previous step path."""
    sb = StepBatch(batch, StepClock())
    ex.step.complete(sb, batch)
    host = sb.host
    _, syncs0, _ = host_transfers.totals()
    for field in host.staged_fields():  # ForwardBatch.to + SamplingBatch.to, one per field
        to_device(field.tensor, ex.device, "before:" + field.name, non_blocking=True)
    write = ex.req_to_token_pool.write_batch(host)  # its three uploads, then undone
    ex.req_to_token_pool.undo(write)
    _, syncs1, _ = host_transfers.totals()
    d2h = 1 + int(host.return_logprob or host.top_logprobs_num > 0)
    return syncs1 - syncs0, d2h


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    ex = ModelExecutor(
        ExecutorConfig(model="tiny-random", max_reqs=8, kv_slots=1024, max_context_len=256)
    )
    print(f"load average: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    print(
        "| step | before: H2D uploads (all sync) | before: D2H syncs | after: H2D async copies"
        " | after: H2D syncs | after: D2H syncs | after: staged bytes |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, batch in _steps():
        before_h2d, before_d2h = _before(ex, batch)
        bytes0 = sum(host_transfers.h2d_bytes.values())
        stats = ex.forward(batch).stats
        staged = sum(host_transfers.h2d_bytes.values()) - bytes0
        print(
            f"| {name} | {before_h2d} | {before_d2h} | {stats.h2d_copies} | {stats.h2d_syncs}"
            f" | {stats.d2h_syncs} | {staged} |"
        )
    print(f"\nstage phase, bs-1 DECODE, median of 200 steps: {_stage_ms(ex):.3f} ms")


def _stage_ms(ex: ModelExecutor, steps: int = 200) -> float:
    row, prompt = 7, 16
    slots = list(range(700, 700 + prompt + steps))
    ex.forward(
        make_extend_batch(
            input_ids=[[5] * prompt], req_pool_indices=[row], out_cache_loc=[slots[:prompt]]
        )
    )
    stage = []
    for k in range(steps):
        n = prompt + k + 1
        batch = make_decode_batch(
            input_ids=[7], req_pool_indices=[row], seq_lens=[n], out_cache_loc=[slots[n - 1]]
        )
        stage.append(ex.forward(batch).stats.timings_ns["stage"] / 1e6)
    return statistics.median(stage[20:])


if __name__ == "__main__":
    main()
