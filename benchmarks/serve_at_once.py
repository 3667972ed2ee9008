"""Serve at once (issue 36): launch-to-first-token, steps during the background compile, and a
restart's way back to the compiled path. Default settings, the default model, each server in
its own process.

    PYTHONPATH=.:proto .venv/bin/python benchmarks/serve_at_once.py [--cache-dir DIR]

1. cold: a fresh temporary `--cache-dir` (nothing cached: the GGUF's packed form, the qmm
   kernel and every compile cache live there, and the environment's compile-cache variables
   are dropped). `serve` and `generate --target` start together; the first token is the
   generate process's answer (`--max-new-tokens 1`, its own start-up included). Then bs-1
   DECODE steps, each timed at the client, until the background capture is idle (the
   compiled path in use): back to back for `--busy-s` (the compile worker, at a low CPU
   priority, then gets mostly what the steps leave), then one every `--pace-s` (a server that
   is not saturated). Every step during the compile, and the time from launch to the
   compiled path.
2. eager: the same cache dir with `--graph-mode none`: the eager step's median.
3. warm: the same cache dir again: first token, steps while the saved compile is loaded, and
   the time to the compiled path (against the cold one: the issue's <= 10%).

`--first-token-only`: 1 and 3's first tokens, no steps (the background compile is not waited
for: the first token does not depend on it). `--model tiny-random`: the compile and restart
figures of a small model (a compile of minutes, not tens of minutes, on a busy machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.served import ROOT, cpu_description, free_port
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient

PROMPT_TOKENS = 64
DECODE_SPAN = 128  # decode steps per request before the next one starts (fixed KV bucket)
COMPILE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@dataclass
class Run:
    name: str
    first_token_s: float = 0.0
    answer: str = ""
    ready_s: float = 0.0
    compiled_s: float | None = None  # launch to the compiled path in use (None: no capture)
    during_ms: list[float] = field(default_factory=list)  # steps while a capture ran
    during_at: list[float] = field(default_factory=list)  # each one's start, s from launch
    # The same steps as the server timed them (queue + step, no RPC): a stall there is the
    # executor's, one only in `during_ms` is the transport's or this client's.
    during_server_ms: list[float] = field(default_factory=list)
    launched_utc: str = ""  # the launch, to read `during_slowest` against the server's log
    after_ms: list[float] = field(default_factory=list)  # steps after (or eager steps)
    paths_after: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        out: dict[str, object] = {
            k: v for k, v in dataclasses.asdict(self).items() if not isinstance(v, list)
        }
        for name, xs in (
            ("during", self.during_ms),
            ("during_server", self.during_server_ms),
            ("after", self.after_ms),
        ):
            if xs:
                out[f"{name}_steps"] = len(xs)
                out[f"{name}_median_ms"] = round(statistics.median(xs), 2)
                out[f"{name}_p99_ms"] = round(percentile(xs, 99), 2)
                out[f"{name}_max_ms"] = round(max(xs), 2)
        out["paths_after"] = sorted(set(self.paths_after))
        # The slowest steps during the capture and when they started (s from launch): where
        # to look in the server's log.
        worst = sorted(zip(self.during_ms, self.during_at, strict=True), reverse=True)[:8]
        out["during_slowest"] = [[round(at, 2), round(ms, 1)] for ms, at in worst]
        return out


def percentile(xs: list[float], p: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def environment() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "proto"), os.getenv("PYTHONPATH")]))
    env = {k: v for k, v in os.environ.items() if k not in COMPILE_ENV}
    return {**env, "PYTHONPATH": path}


def launch(
    cache_dir: Path, flags: list[str], log: Path, model: str
) -> tuple[Run, subprocess.Popen[bytes], int]:
    """`serve` and `generate --target` started together; the generate's first token."""
    port = free_port()
    env = environment()
    cli = [sys.executable, "-m", "executor"]
    serve = [
        *cli, "serve", "--port", str(port), "--metrics-port", "-1", "--cache-dir", str(cache_dir),
        "--model", model, "--operator-calls-open",  # loopback: GetRuntimeConfig without a token
    ]  # fmt: skip
    generate = [
        *cli, "generate", "--target", f"127.0.0.1:{port}", "--max-new-tokens", "1",
        "--cache-dir", str(cache_dir), "--model", model, "The capital of France is",
    ]  # fmt: skip
    t0 = time.perf_counter()
    server = subprocess.Popen(
        [*serve, *flags], env=env, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT
    )
    done = subprocess.run(generate, env=env, cwd=ROOT, capture_output=True, timeout=900)
    run = Run(log.stem, first_token_s=time.perf_counter() - t0, answer=done.stdout.decode().strip())
    if done.returncode != 0:
        server.kill()
        raise RuntimeError(f"generate failed: {done.stderr.decode()[-2000:]}")
    return run, server, port


def decode_until_idle(
    client: ExecutorClient,
    run: Run,
    t0: float,
    *,
    after: int,
    busy_s: float,
    pace_s: float,
    timeout: float,
) -> None:
    """bs-1 DECODE steps while the background capture runs: back to back for `busy_s` (the
    compile worker then gets only what the steps leave of the CPU), then one every `pace_s`
    (a server that is not saturated); then `after` more, back to back. `t0`: the launch."""
    row, slot_base, step = 1, 1, 0
    released: torch.Tensor | None = None
    current, current_slots = row, [0]
    config = client.get_runtime_config()
    capturing = config.graph_capture.startswith("capturing")
    if not capturing and config.graph_mode != "none":  # a load already done (upper bound)
        run.compiled_s = time.perf_counter() - t0
    start = time.perf_counter()
    remaining = after
    while remaining > 0:
        if step % DECODE_SPAN == 0:  # a new request on the next row (the last one released)
            current, current_slots = (
                row,
                list(range(slot_base, slot_base + PROMPT_TOKENS + DECODE_SPAN)),
            )
            prefill = make_extend_batch(
                input_ids=[[(17 * j) % 400 + 50 for j in range(PROMPT_TOKENS)]],
                req_pool_indices=[current],
                out_cache_loc=[current_slots[:PROMPT_TOKENS]],
            )
            if released is not None:
                prefill = dataclasses.replace(prefill, released_req_pool_indices=released)
            client.forward(prefill)
            released = torch.tensor([current])
            row = row % 100 + 1
            slot_base = 1 + (row - 1) * (PROMPT_TOKENS + DECODE_SPAN)
            step = 0
        n = PROMPT_TOKENS + step
        batch = make_decode_batch(
            input_ids=[11],
            req_pool_indices=[current],
            seq_lens=[n + 1],
            out_cache_loc=[current_slots[n]],
        )
        t = time.perf_counter()
        out = client.forward(batch)
        ms = (time.perf_counter() - t) * 1e3
        step += 1
        if not capturing:
            run.after_ms.append(ms)
            run.paths_after.append(out.stats.path)
            remaining -= 1
            continue
        run.during_ms.append(ms)
        run.during_at.append(t - t0)
        timed = out.stats.timings_ns
        run.during_server_ms.append((timed.get("queue", 0) + timed.get("total", 0)) / 1e6)
        busy = time.perf_counter() - start < busy_s
        if busy and step % 10:
            continue
        if not client.get_runtime_config().graph_capture.startswith("capturing"):
            capturing = False
            run.compiled_s = time.perf_counter() - t0
        elif time.perf_counter() - start > timeout:
            raise TimeoutError(f"the background capture did not end in {timeout} s")
        elif not busy:
            time.sleep(pace_s)


def measure(name: str, cache_dir: Path, flags: list[str], args: argparse.Namespace) -> Run:
    log = cache_dir.parent / f"{name}.log"
    t0 = time.perf_counter()
    launched = time.strftime("%H:%M:%S", time.gmtime())
    run, server, port = launch(cache_dir, flags, log, args.model)
    run.launched_utc = launched
    run.name = name
    print(f"{name}: first token {run.first_token_s:.1f} s ({run.answer!r})", flush=True)
    if args.first_token_only:
        server.terminate()
        server.wait(timeout=120)
        return run
    try:
        with ExecutorClient(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout=600)
            run.ready_s = time.perf_counter() - t0  # (already ready: generate answered)
            decode_until_idle(
                client,
                run,
                t0,
                after=args.steps,
                busy_s=args.busy_s,
                pace_s=args.pace_s,
                timeout=args.timeout,
            )
    finally:
        server.terminate()
        server.wait(timeout=120)
    print(f"{name}: {json.dumps(run.summary())}", flush=True)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="the default model unless a smoke test")
    ap.add_argument("--cache-dir", default="", help="'' = a fresh temporary directory")
    ap.add_argument("--steps", type=int, default=100, help="steps measured after the capture")
    ap.add_argument("--timeout", type=float, default=3600, help="the longest background compile")
    ap.add_argument("--busy-s", type=float, default=60, help="steps back to back this long")
    ap.add_argument("--pace-s", type=float, default=0.5, help="then one step every this long")
    ap.add_argument(
        "--first-token-only",
        action="store_true",
        help="cold and warm launches to the first token only (no steps, no wait for the compile)",
    )
    args = ap.parse_args()
    cpu, flags = cpu_description()
    work = Path(args.cache_dir or tempfile.mkdtemp(prefix="serve-at-once-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    print(
        f"machine: {cpu} ({os.cpu_count()} cores; {flags}); torch {torch.__version__}; "
        f"load {os.getloadavg()}; cache dir {cache} (fresh: {not cache.exists()})",
        flush=True,
    )
    cold = measure("cold", cache, [], args)
    if args.first_token_only:
        measure("warm", cache, [], args)
        print(f"load after: {os.getloadavg()}")
        return
    eager = measure("eager", cache, ["--graph-mode", "none"], args)
    warm = measure("warm", cache, [], args)
    base = statistics.median(eager.after_ms)
    print(f"load after: {os.getloadavg()}")
    for run in (cold, warm):
        during = run.during_ms or [float("nan")]
        print(
            f"{run.name}: first token {run.first_token_s:.1f} s ({run.answer!r}); compiled path "
            f"after {run.compiled_s or float('nan'):.1f} s; {len(run.during_ms)} steps meanwhile, "
            f"p99 {percentile(during, 99):.1f} ms = {percentile(during, 99) / base:.2f}x the "
            f"eager median {base:.1f} ms (max {max(during):.1f} ms); after: "
            f"{statistics.median(run.after_ms):.1f} ms on {sorted(set(run.paths_after))}"
        )
    if cold.compiled_s and warm.compiled_s:
        print(f"restart to the compiled path: {warm.compiled_s / cold.compiled_s:.1%} of cold")


if __name__ == "__main__":
    main()
