"""The long fuzz run: `--messages` structured-fuzzed Forward and KV-plane messages, extreme
integers included (tests/fuzzer.py), against an in-process tiny-random server, then the
greedy-token check against the in-process executor.

    PYTHONPATH=.:proto .venv/bin/python benchmarks/fuzz.py --messages 100000 --seed 1

Exits 1 on any property violation (a status other than OK / INVALID_ARGUMENT /
RESOURCE_EXHAUSTED, for KV also FAILED_PRECONDITION / PERMISSION_DENIED / DATA_LOSS; a
refused message that changed the state; a wrong token afterwards; a crash ends the run).
Result recorded in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import structlog

from executor.client.grpc_client import ExecutorClient
from executor.client.scheduler import generate
from executor.model_executor import ModelExecutor
from tests.fuzzer import Fuzzer
from tests.server_util import free_port, running_server, tiny_config

PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 3, 77, 250, 12, 9, 31]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=5000, help="messages between progress lines")
    args = ap.parse_args()
    # Refusals are logged per message at info; keep the run's output to the progress lines.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    config = tiny_config(Path(tempfile.mkdtemp(prefix="fuzz-")))
    t0 = time.perf_counter()
    dead = f"127.0.0.1:{free_port()}"  # a listed peer where nothing listens
    with running_server(config, queue_size=4, kv_transfer=True, kv_peers=dead) as server:
        fuzzer = Fuzzer(server, seed=args.seed, kv_peer=dead)
        done = 0
        while done < args.messages:
            n = min(args.chunk, args.messages - done)
            for _ in range(n):
                fuzzer.one(mutate_ratio=0.75)
            done += n
            r = fuzzer.report
            print(
                f"{done} messages, {time.perf_counter() - t0:.0f} s: codes {dict(r.codes)}, "
                f"violations {len(r.violations)}",
                flush=True,
            )
        fuzzer.resync()
        fuzzer.close()
        with ExecutorClient(f"127.0.0.1:{server.port}") as client:
            serving = client.health()
            limits = client.info().info.limits
            remote = generate(client.forward, limits, PROMPTS, max_new_tokens=16, ignore_eos=True)
    local = ModelExecutor(config)
    expected = generate(local.forward, local.limits, PROMPTS, max_new_tokens=16, ignore_eos=True)
    r = fuzzer.report
    print(f"mutations: {dict(sorted(r.mutations.items()))}")
    print(f"mutations the executor accepted (still valid): {dict(r.accepted_mutations)}")
    print(f"codes: {dict(r.codes)}")
    print(f"health after: {serving}; greedy tokens equal in-process: {remote == expected}")
    print(f"violations: {len(r.violations)}")
    for v in r.violations[:20]:
        print("  " + v)
    print(f"wall: {time.perf_counter() - t0:.0f} s")
    return 0 if not r.violations and serving == "SERVING" and remote == expected else 1


if __name__ == "__main__":
    sys.exit(main())
