"""What recording metrics (and unsampled spans) adds to one DECODE step at batch 1 (issue 7).

For each model it times, in-process:
- `step`: one whole `ModelExecutor.forward` DECODE step at batch size 1 (median of `--steps`),
- `observe_step`: what the device worker records per step (`ExecutorMetrics.observe_step`
  with that step's real StepStats, the OTel context attach/detach and the debug-log check),
- `bookkeeping`: what `forward` itself now keeps per step for observability (the wall clock,
  the phase starts, the host-sync count) - replayed outside the step,
- `rpc scope`: what the gRPC layer adds per RPC (`Telemetry.rpc`: the latency and status-code
  metrics, the server span with the default exporter `none` - ids only, nothing recorded -
  and its `decode` / step / `encode` children),
each the median of `--iters` calls, and the sum as a share of the step.

    python benchmarks/metrics_overhead.py [--models tiny-random,smollm2] [--steps 200]
        [--iters 20000] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run from a checkout: import this tree's packages (and its generated stubs), not an
# installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import structlog
import torch
from opentelemetry import context as otel_context

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.core.outputs import StepStats
from executor.model_executor import ModelExecutor
from executor.observability.logs import debug_enabled
from executor.observability.metrics import ExecutorMetrics
from executor.observability.telemetry import Telemetry
from executor.observability.tracing import SpanScope, Tracing
from ops.host_transfer import host_transfers

PROMPT_LEN = 8


def median_us(fn: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def decode_steps(ex: ModelExecutor, steps: int) -> tuple[list[float], StepStats]:
    """`steps` DECODE steps of one request; their times (us) and the last step's stats."""
    out = ex.forward(
        make_extend_batch(
            input_ids=[[7] * PROMPT_LEN],
            req_pool_indices=[1],
            out_cache_loc=[list(range(1, PROMPT_LEN + 1))],
        )
    )
    times = []
    token = int(out.next_token_ids[0])
    for i in range(steps):
        seq = PROMPT_LEN + 1 + i
        batch = make_decode_batch(
            input_ids=[token], req_pool_indices=[1], seq_lens=[seq], out_cache_loc=[seq]
        )
        t0 = time.perf_counter_ns()
        out = ex.forward(batch)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        token = int(out.next_token_ids[0])
    return times[2:], out.stats  # the first steps warm up


def bookkeeping(stats: StepStats) -> None:
    """A replay of what ModelExecutor.forward keeps per step for observability."""
    syncs0 = host_transfers.total_syncs
    wall0 = time.time_ns()
    timings = stats.timings_ns
    started = {"validate": wall0, "stage": wall0 + timings["validate"]}
    started["forward"] = started["stage"] + timings["stage"]
    started["sample"] = started["forward"] + timings["forward"]
    _ = host_transfers.total_syncs - syncs0


def measure(model: str, args: argparse.Namespace) -> str:
    config = ExecutorConfig(
        model=model, max_reqs=4, kv_slots=PROMPT_LEN + args.steps + 8, max_context_len=1024
    )
    ex = ModelExecutor(config)
    step_times, stats = decode_steps(ex, args.steps)
    stats.timings_ns["queue"] = 20_000
    stats.started_ns["queue"] = stats.started_ns["validate"] - 20_000
    step_us = statistics.median(step_times)

    metrics = ExecutorMetrics()
    tracing = Tracing()  # the default: exporter none
    telemetry = Telemetry(metrics, tracing)
    parent = SpanScope(tracing.tracer, tracing.server_span("svc/Forward", [])).context
    context = _Context()

    def worker_side() -> None:
        token = otel_context.attach(parent)
        metrics.observe_step(stats)
        if debug_enabled():
            raise AssertionError("run with the default log level")
        otel_context.detach(token)

    def rpc_side() -> None:
        with telemetry.rpc("Forward", context) as rpc:  # type: ignore[arg-type]
            with rpc.child("decode"):
                pass
            rpc.record_step(stats, 1)
            with rpc.child("encode"):
                pass

    observe_us = median_us(worker_side, args.iters)
    book_us = median_us(lambda: bookkeeping(stats), args.iters)
    rpc_us = median_us(rpc_side, args.iters)
    total = observe_us + book_us + rpc_us
    return (
        f"| {model} | {step_us:.0f} | {observe_us:.2f} | {book_us:.2f} | {rpc_us:.2f} | "
        f"{total:.2f} | {100 * total / step_us:.2f}% |"
    )


class _Context:
    """The part of grpc.ServicerContext that Telemetry.rpc reads."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float | None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-random,smollm2")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per model")
    parser.add_argument("--iters", type=int, default=20000, help="timed calls per recording")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    print(
        f"# metrics overhead, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"threads={torch.get_num_threads()}, steps={args.steps}, iters={args.iters}"
    )
    print(
        "| model | decode step us (bs 1) | observe_step us | bookkeeping us | rpc scope us "
        "| total us | share of step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        print(measure(model.strip(), args), flush=True)


if __name__ == "__main__":
    main()
