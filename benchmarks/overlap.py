"""Overlap scheduling: tokens/s with and without future-token references through ForwardStream.

    .venv/bin/python benchmarks/overlap.py                          # tiny-random and SmolLM2, bs 1 and 32
    .venv/bin/python benchmarks/overlap.py --models tiny-random --sizes 1 --new-tokens 64

The server runs in its own process (`python -m executor serve`), one per model. For each
batch size the reference scheduler generates `--new-tokens` tokens per request (EOS ignored,
so both runs do the same work) twice over one ForwardStream each:

- plain: send step N, wait for its tokens, build step N+1 (one step on the stream at a time);
- overlap: step N+1 is sent, built from future references, before step N's tokens are read.

Both runs must give the same tokens (checked). Besides tokens/s it reports, from the steps'
own timings, the device time per step (`total`: validate .. sample) and the device idle time
per step: wall time per step minus device time per step, i.e. what the device waited for the
scheduler (encode, network, decode, scheduling). The queue wait per step shows the other side:
in overlap the next step is already queued while one runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import time
from dataclasses import dataclass

from served import cpu_description, served  # benchmarks/served.py (the script's folder)

from executor.client.grpc_client import ExecutorClient, ForwardSession
from executor.client.scheduler import ReferenceScheduler
from executor.core.forward_batch import ForwardBatch
from executor.core.outputs import ForwardOutput

PROMPT_LEN = 16


@dataclass
class Run:
    seconds: float
    tokens: list[list[int]]
    steps: list[ForwardOutput]

    def per_step_ms(self, key: str) -> float:
        return statistics.mean(s.stats.timings_ns.get(key, 0) for s in self.steps) / 1e6


class RecordingPipe:
    """A ForwardSession that keeps every answer (their step timings)."""

    def __init__(self, session: ForwardSession) -> None:
        self.session = session
        self.answers: list[ForwardOutput] = []

    def send(self, batch: ForwardBatch) -> None:
        self.session.send(batch)

    def recv(self) -> ForwardOutput:
        out = self.session.recv()
        self.answers.append(out)
        return out


def generate_once(
    client: ExecutorClient, bs: int, new_tokens: int, overlap: bool, depth: int = 2
) -> Run:
    limits = client.info().info.limits
    session = client.open_stream()
    pipe = RecordingPipe(session)

    def lockstep(batch: ForwardBatch) -> ForwardOutput:
        pipe.send(batch)
        return pipe.recv()

    scheduler = ReferenceScheduler(
        lockstep, limits, overlap=overlap, pipe=pipe, overlap_depth=depth
    )
    reqs = [
        scheduler.add_request(
            [(31 * r + j) % 400 + 5 for j in range(PROMPT_LEN)],
            max_new_tokens=new_tokens,
            ignore_eos=True,
        )
        for r in range(bs)
    ]
    t0 = time.perf_counter()
    scheduler.run()
    seconds = time.perf_counter() - t0
    session.close()
    return Run(seconds, [r.output_ids for r in reqs], pipe.answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-random,smollm2")
    parser.add_argument("--sizes", default="1,32")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument(
        "--server-threads",
        type=int,
        default=0,
        help="torch (OpenMP) threads of the server; 0 = torch's default (one per core). On a "
        "CPU device the overlapped scheduler competes with the device for the same cores",
    )
    parser.add_argument(
        "--repeats", type=int, default=6, help="plain/overlap pairs, alternating (tok/s: best)"
    )
    parser.add_argument("--cache-dir", default="")
    parser.add_argument(
        "--server-args",
        default="",
        help="more `serve` flags, e.g. '--graph-mode decode --graph-backend compiled_step "
        "--graph-batch-sizes 1,32' (DECODE steps as one compiled graph each)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    model_name, cpu_flags = cpu_description()
    print(f"machine: {model_name} ({os.cpu_count()} cores; {cpu_flags}); load {os.getloadavg()}")
    print(f"prompt {PROMPT_LEN} tokens, {args.new_tokens} new tokens per request, "
          f"{args.repeats} alternating plain/overlap pairs (tok/s and ms: the best run of "
          "each mode; speed-up: median (range) of the pairs' ratios)\n")  # fmt: skip
    print(f"server threads: {args.server_threads or 'default'}; server args: {args.server_args}\n")
    print("| model | bs | plain tok/s | overlap tok/s | speed-up (paired) | device ms/step plain | "
          "device ms/step overlap | idle ms/step plain | idle ms/step overlap | "
          "queue ms/step overlap |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        flags = [
            "--model", model, "--max-reqs", "64", "--kv-slots", "16384",
            "--max-context-len", "1024", *shlex.split(args.server_args),
        ]  # fmt: skip
        if args.cache_dir:
            flags += ["--cache-dir", args.cache_dir]
        # The server's torch threads (OpenMP): leave the scheduler a core.
        env = {"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else None
        with served(flags, env=env) as server:
            client = server.client
            for bs in sizes:
                generate_once(client, bs, 4, overlap=True)  # warm both code paths
                # Plain and overlap alternate (ABBA...), so a drift in the machine's speed
                # lands on both; the speed-up is the median of the pairs' ratios.
                pairs: list[tuple[Run, Run]] = []
                for i in range(args.repeats):
                    order = (False, True) if i % 2 == 0 else (True, False)
                    done = {m: generate_once(client, bs, args.new_tokens, overlap=m) for m in order}
                    pairs.append((done[False], done[True]))
                for plain, over in pairs:
                    if plain.tokens != over.tokens:
                        raise SystemExit(f"{model} bs {bs}: overlap changed the tokens")
                ratios = sorted(p.seconds / o.seconds for p, o in pairs)
                plain = min((p for p, _ in pairs), key=lambda r: r.seconds)
                over = min((o for _, o in pairs), key=lambda r: r.seconds)
                rate = [bs * args.new_tokens / r.seconds for r in (plain, over)]
                idle = [
                    r.seconds * 1e3 / len(r.steps) - r.per_step_ms("total") for r in (plain, over)
                ]
                print(
                    f"| {model} | {bs} | {rate[0]:.0f} | {rate[1]:.0f} | "
                    f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | "
                    f"{plain.per_step_ms('total'):.2f} | {over.per_step_ms('total'):.2f} | "
                    f"{idle[0]:.2f} | {idle[1]:.2f} | {over.per_step_ms('queue'):.2f} |",
                    flush=True,
                )
    print(f"\nload after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
