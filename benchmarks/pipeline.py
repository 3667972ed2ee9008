"""The pipelined step under the stand-in accelerator: steps/s and device occupancy.

    .venv/bin/python benchmarks/pipeline.py                      # D = 2 ms, bs 1 and 32
    .venv/bin/python benchmarks/pipeline.py --step-ms 2 --steps 500 --clients 8

Two servers (`serve --model tiny-random --simulated-step-ms D`, each in its own process) run
side by side: one pipelined (`--pipeline-steps on`, what `auto` picks under the stand-in),
one not (`off`: the device thread admits and stages each batch after the step before it was
answered, the order before the pipeline). Against each:

- overlap: the reference scheduler's overlap mode over one ForwardStream (step N+1, and at
  `--depths` 3 also N+2, sent by future-token reference before N's tokens are read), bs 1 and
  bs 32, `--steps` decode steps per request;
- unary: `--clients` clients, each decoding its own request with unary `Forward` calls
  (tokens fed back), together `--steps` steps.

Each run reports steps/s (the stand-in's ceiling is 1000 / D) and the device occupancy:
the server's `model_executor_forward_occupancy` gauge scraped right after the run (the
script waits out the gauge's 10 s window before each run, so the window holds that run only),
and the same ratio from the answers' `host_gap_ns` (busy = D per step), beside each step's
admission time (its `validate` phase). The tokens of the two servers must be equal (checked).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# Run from a checkout: this tree's packages and generated stubs, and served.py beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overlap import PROMPT_LEN, generate_once
from served import cpu_description, free_port, served

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient

WINDOW_S = 10.5  # the occupancy gauge's window, and a little


@dataclass
class Run:
    steps: int
    seconds: float
    gaps_ns: list[int]
    tokens: list[list[int]]
    validate_ns: list[int]  # each step's admission (the `validate` phase)
    gauge: float = float("nan")

    def occupancy(self, step_ms: float) -> float:
        busy = len(self.gaps_ns) * step_ms * 1e6
        return busy / (busy + sum(self.gaps_ns))


def overlap_run(client: ExecutorClient, bs: int, steps: int, depth: int = 2) -> Run:
    """The reference scheduler's overlap mode over one ForwardStream (`overlap.py`'s run),
    `depth` steps sent and not yet read."""
    run = generate_once(client, bs, steps, overlap=True, depth=depth)
    gaps = [a.stats.host_gap_ns for a in run.steps]
    validate = [a.stats.timings_ns.get("validate", 0) for a in run.steps]
    return Run(len(run.steps), run.seconds, gaps, run.tokens, validate)


def unary_run(target: str, clients: int, steps: int) -> Run:
    """`clients` threads, each with its own channel, row and slots, `steps // clients` steps."""
    per = steps // clients
    results: list[tuple[list[int], list[int], list[int]]] = [([], [], [])] * clients
    start = threading.Barrier(clients + 1)

    def one(i: int) -> None:
        # Rows and slots apart from the overlap runs' (their scheduler allocates from 1 up).
        row, base = 40 + i, 20_000 + i * (PROMPT_LEN + per + 1)
        tokens, gaps, validate = [], [], []
        with ExecutorClient(target) as client:
            prompt = [(17 * i + j) % 400 + 5 for j in range(PROMPT_LEN)]
            out = client.forward(
                make_extend_batch(
                    input_ids=[prompt],
                    req_pool_indices=[row],
                    out_cache_loc=[list(range(base, base + PROMPT_LEN))],
                )
            )
            tokens.append(int(out.next_token_ids[0]))
            start.wait()
            for k in range(per - 1):
                out = client.forward(
                    make_decode_batch(
                        input_ids=[tokens[-1]],
                        req_pool_indices=[row],
                        seq_lens=[PROMPT_LEN + k + 1],
                        out_cache_loc=[base + PROMPT_LEN + k],
                    )
                )
                tokens.append(int(out.next_token_ids[0]))
                gaps.append(out.stats.host_gap_ns)
                validate.append(out.stats.timings_ns.get("validate", 0))
        results[i] = (tokens, gaps, validate)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    gaps = [g for _, gs, _ in results for g in gs]
    validate = [v for _, _, vs in results for v in vs]
    return Run(len(gaps), seconds, gaps, [t for t, _, _ in results], validate)


def gauge(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    found = re.search(r"^model_executor_forward_occupancy ([0-9.eE+-]+)$", text, re.M)
    return float(found.group(1)) if found else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--sizes", default="1,32")
    parser.add_argument(
        "--depths", default="2,3", help="the stream's steps sent and not yet read (overlap_depth)"
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--cache-dir", default="")
    args = parser.parse_args()
    model_name, cpu_flags = cpu_description()
    print(f"machine: {model_name} ({os.cpu_count()} cores; {cpu_flags}); load {os.getloadavg()}")
    ceiling = 1000 / args.step_ms
    print(f"stand-in D = {args.step_ms:g} ms (ceiling {ceiling:.0f} steps/s); {args.steps} steps "
          f"per run; occupancy: the gauge after the run / from the answers' host gaps\n")  # fmt: skip
    print("| pipeline | workload | steps/s | share of ceiling | occupancy (gauge) | "
          "occupancy (answers) | host gap p50 us | validate p50 us |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    tokens: dict[str, list[list[list[int]]]] = {}
    for mode in ("on", "off"):
        metrics_port = free_port()
        flags = [
            "--model", "tiny-random", "--simulated-step-ms", str(args.step_ms),
            "--pipeline-steps", mode, "--max-reqs", "64", "--kv-slots", "32768",
            "--max-context-len", str(PROMPT_LEN + args.steps + 8),
            "--metrics-port", str(metrics_port), "--queue-size", "256",
        ]  # fmt: skip
        if args.cache_dir:
            flags += ["--cache-dir", args.cache_dir]
        with served(flags) as server:
            target = f"127.0.0.1:{server.port}"
            overlap_run(server.client, 1, 8)  # warm both paths
            runs: list[tuple[str, Run]] = []
            for depth in (int(d) for d in args.depths.split(",")):
                for bs in (int(s) for s in args.sizes.split(",")):
                    time.sleep(WINDOW_S)
                    run = overlap_run(server.client, bs, args.steps, depth)
                    run.gauge = gauge(metrics_port)
                    runs.append((f"overlap stream, bs {bs}, {depth} in flight", run))
            time.sleep(WINDOW_S)
            run = unary_run(target, args.clients, args.steps)
            run.gauge = gauge(metrics_port)
            runs.append((f"unary, {args.clients} clients", run))
        tokens[mode] = [r.tokens for _, r in runs]
        for name, run in runs:
            rate = run.steps / run.seconds
            gap, validate = statistics.median(run.gaps_ns), statistics.median(run.validate_ns)
            print(
                f"| {mode} | {name} | {rate:.0f} | {rate / ceiling:.0%} | {run.gauge:.3f} | "
                f"{run.occupancy(args.step_ms):.3f} | {gap / 1000:.0f} | {validate / 1000:.0f} |",
                flush=True,
            )
    if tokens["on"] != tokens["off"]:
        raise SystemExit("the pipeline changed the tokens")
    print(f"\ntokens equal pipelined and not; load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
