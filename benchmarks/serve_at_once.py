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
   priority and stopped while each step runs, then gets only the gaps), then one every
   `--pace-s` (a server that is not saturated). Every step during the compile, and the time
   from launch to the compiled path. Each is followed by a step on an eager server
   (`--graph-mode none`) beside it, the compile worker stopped (`Beside`): the eager step at
   the same time, after the same idle gap, the base of the steps meanwhile. Steps start once
   the eager server's resident set has settled (`settled`: its KV cache committed).
2. eager: the same cache dir with `--graph-mode none`, `--eager-steps` back to back: the
   machine's own spread (p99 over median), with no compile.
3. warm: the same cache dir again: first token, steps while the saved compile is loaded (each
   followed by one on an eager server beside it, as in 1), and the time to the compiled path.
4. restart: the same again, steps paced from ready (no busy window, no server beside): the
   time to the compiled path against the cold compile's outside its busy window (the issue's
   <= 10%). A saturated server loads in its idle time, so warm's time holds its busy window.

`--idle-probe`: an eager server's steps back to back and after idle gaps, nothing else.
`--warm-only`: 3 alone, on a `--cache-dir` an earlier run compiled into, with no server beside
it (the steps start at ready): two trees' loads compared, each on its own warm cache dir.
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
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

# Run from a checkout (`python benchmarks/serve_at_once.py`): this tree's packages and stubs.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.served import ROOT, cpu_description, free_port
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.core.outputs import ForwardOutput
from executor.graphs.compile_pause import process_state

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
    during_busy: list[bool] = field(default_factory=list)  # each one: back to back, or paced
    # The same steps as the server timed them (queue + step, no RPC): a stall there is the
    # executor's, one only in `during_ms` is the transport's or this client's.
    during_server_ms: list[float] = field(default_factory=list)
    during_phases: list[dict[str, int]] = field(default_factory=list)  # each one's timings_ns
    # The compile worker's state read right after each step ("T": stopped, as it must be
    # then; "" when the beside server is not run), for the dump.
    during_worker: list[str] = field(default_factory=list)
    beside_ms: list[float] = field(default_factory=list)  # the eager server's steps (`Beside`)
    beside_busy: list[bool] = field(default_factory=list)  # each one: back to back, or paced
    beside_worker_ran: int = 0  # of those, the ones that found the compile worker running
    launched_utc: str = ""  # the launch, to read `during_slowest` against the server's log
    after_ms: list[float] = field(default_factory=list)  # steps after (or eager steps)
    paths_after: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        out: dict[str, object] = {
            k: v for k, v in dataclasses.asdict(self).items() if not isinstance(v, list)
        }
        busy = [ms for ms, b in zip(self.during_ms, self.during_busy, strict=True) if b]
        paced = [ms for ms, b in zip(self.during_ms, self.during_busy, strict=True) if not b]
        beside = {
            b: [ms for ms, c in zip(self.beside_ms, self.beside_busy, strict=True) if c is b]
            for b in (True, False)
        }
        for name, xs in (
            ("during", self.during_ms),
            ("during_busy", busy),
            ("during_paced", paced),
            ("during_server", self.during_server_ms),
            ("beside_busy", beside[True]),
            ("beside_paced", beside[False]),
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


def serve_command(cache_dir: Path, port: int, model: str) -> list[str]:
    return [
        sys.executable, "-m", "executor", "serve", "--port", str(port), "--metrics-port", "-1",
        "--cache-dir", str(cache_dir), "--model", model,
        "--operator-calls-open",  # loopback: GetRuntimeConfig without a token
    ]  # fmt: skip


def launch(
    cache_dir: Path, flags: list[str], log: Path, model: str
) -> tuple[Run, subprocess.Popen[bytes], int]:
    """`serve` and `generate --target` started together; the generate's first token."""
    port = free_port()
    env = environment()
    generate = [
        sys.executable, "-m", "executor", "generate", "--target", f"127.0.0.1:{port}",
        "--max-new-tokens", "1", "--cache-dir", str(cache_dir), "--model", model,
        "The capital of France is",
    ]  # fmt: skip
    t0 = time.perf_counter()
    server = subprocess.Popen(
        [*serve_command(cache_dir, port, model), *flags],
        env=env,
        cwd=ROOT,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    done = subprocess.run(generate, env=env, cwd=ROOT, capture_output=True, timeout=900)
    run = Run(log.stem, first_token_s=time.perf_counter() - t0, answer=done.stdout.decode().strip())
    if done.returncode != 0:
        server.kill()
        raise RuntimeError(f"generate failed: {done.stderr.decode()[-2000:]}")
    return run, server, port


def settled(pid: int, quiet_s: float = 1.0, timeout_s: float = 120.0) -> None:
    """Until `pid`'s resident set has not grown for `quiet_s`: a server past "ready" still
    commits its KV cache's pages on a thread (`ops.host_pages`), a core's work for seconds on
    a small machine, which the steps measured beside it must not meet."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        if resident > last:
            last, since = resident, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)


class Decoder:
    """bs-1 DECODE steps on one server: a new request every `DECODE_SPAN` steps, on the next
    row (the one before released with it)."""

    def __init__(self, client: ExecutorClient) -> None:
        self.client = client
        self.row, self.slot_base, self.step = 1, 1, 0
        self.released: torch.Tensor | None = None
        self.current, self.slots = 1, [0]

    def decode(self) -> tuple[float, ForwardOutput]:
        """One step (after the next request's prefill, untimed, when one starts): client ms."""
        if self.step % DECODE_SPAN == 0:
            self.current = self.row
            self.slots = list(range(self.slot_base, self.slot_base + PROMPT_TOKENS + DECODE_SPAN))
            prefill = make_extend_batch(
                input_ids=[[(17 * j) % 400 + 50 for j in range(PROMPT_TOKENS)]],
                req_pool_indices=[self.current],
                out_cache_loc=[self.slots[:PROMPT_TOKENS]],
            )
            if self.released is not None:
                prefill = dataclasses.replace(prefill, released_req_pool_indices=self.released)
            self.client.forward(prefill)
            self.released = torch.tensor([self.current])
            self.row = self.row % 100 + 1
            self.slot_base = 1 + (self.row - 1) * (PROMPT_TOKENS + DECODE_SPAN)
            self.step = 0
        n = PROMPT_TOKENS + self.step
        batch = make_decode_batch(
            input_ids=[11],
            req_pool_indices=[self.current],
            seq_lens=[n + 1],
            out_cache_loc=[self.slots[n]],
        )
        t = time.perf_counter()
        out = self.client.forward(batch)
        self.step += 1
        return (time.perf_counter() - t) * 1e3, out


@dataclass
class Beside:
    """An eager server (`--graph-mode none`) beside the one that compiles (or loads): one
    step on it follows each of theirs, back to back or paced (after the same idle gap: a step
    after one is slower on this machine), within the compiling server's linger
    (`CompilePause`: its compile worker stays stopped between steps that close together): the
    eager step at the same moment on the same machine, no compile running. Each of these steps
    checks that the worker was stopped. Minutes apart, this machine's speed drifted by a
    third, so a separate eager run is a poor base."""

    decoder: Decoder
    server_pid: int  # the cold server, whose compile worker must be stopped for these steps
    ms: list[float] = field(default_factory=list)
    worker_ran: int = 0  # of these steps, those that found the worker running

    def worker(self) -> int | None:
        found = subprocess.run(
            ["pgrep", "-P", str(self.server_pid), "-f", "executor.compile_worker"],
            capture_output=True,
            text=True,
        ).stdout.split()
        return int(found[0]) if found else None

    def step(self, worker: int | None) -> None:
        self.ms.append(self.decoder.decode()[0])
        if worker is not None and process_state(worker) not in ("T", "gone"):
            self.worker_ran += 1


def decode_until_idle(
    client: ExecutorClient,
    run: Run,
    t0: float,
    *,
    after: int,
    busy_s: float,
    pace_s: float,
    timeout: float,
    beside: Beside | None = None,
) -> None:
    """bs-1 DECODE steps while the background capture runs: back to back for `busy_s` (the
    compile worker then gets only what the steps leave of the CPU), then one every `pace_s`
    (a server that is not saturated); then `after` more, back to back. `t0`: the launch.
    With `beside`, one of its eager steps follows each step back to back (`Beside`)."""
    decoder = Decoder(client)
    worker: int | None = None  # the cold server's compile worker (`beside` looks it up)
    config = client.get_runtime_config()
    capturing = config.graph_capture.startswith("capturing")
    if not capturing and config.graph_mode != "none":  # a load already done (upper bound)
        run.compiled_s = time.perf_counter() - t0
    start = time.perf_counter()
    remaining = after
    while remaining > 0:
        t = time.perf_counter()
        ms, out = decoder.decode()
        if not capturing:
            run.after_ms.append(ms)
            run.paths_after.append(out.stats.path)
            remaining -= 1
            continue
        busy = time.perf_counter() - start < busy_s
        run.during_ms.append(ms)
        run.during_at.append(t - t0)
        run.during_busy.append(busy)
        timed = out.stats.timings_ns
        run.during_server_ms.append((timed.get("queue", 0) + timed.get("total", 0)) / 1e6)
        run.during_phases.append(dict(timed))
        if beside is not None:
            if worker is None or len(run.during_ms) % 100 == 0 or not busy:
                worker = beside.worker()  # (it starts after the server, and ends)
            run.during_worker.append(process_state(worker) if worker is not None else "")
            beside.step(worker)
            run.beside_busy.append(busy)
        if busy and decoder.step % 10:
            continue
        if not client.get_runtime_config().graph_capture.startswith("capturing"):
            capturing = False
            run.compiled_s = time.perf_counter() - t0
        elif time.perf_counter() - start > timeout:
            raise TimeoutError(f"the background capture did not end in {timeout} s")
        elif not busy:
            time.sleep(pace_s)


def measure(
    name: str,
    cache_dir: Path,
    flags: list[str],
    args: argparse.Namespace,
    *,
    steps: int = 0,
    besides: bool = False,
) -> Run:
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
    eager: subprocess.Popen[bytes] | None = None
    try:
        with ExitStack() as stack:
            client = stack.enter_context(ExecutorClient(f"127.0.0.1:{port}"))
            client.wait_ready(timeout=600)
            run.ready_s = time.perf_counter() - t0  # (already ready: generate answered)
            beside = None
            if besides:
                eager_port = free_port()
                eager = subprocess.Popen(
                    [*serve_command(cache_dir, eager_port, args.model), "--graph-mode", "none"],
                    env=environment(),
                    cwd=ROOT,
                    stdout=(cache_dir.parent / f"{name}-beside.log").open("ab"),
                    stderr=subprocess.STDOUT,
                )
                other = stack.enter_context(ExecutorClient(f"127.0.0.1:{eager_port}"))
                other.wait_ready(timeout=600)
                settled(eager.pid)  # its KV cache committed: no start-up under the steps
                beside = Beside(Decoder(other), server.pid, run.beside_ms)
            decode_until_idle(
                client,
                run,
                t0,
                after=steps or args.steps,
                busy_s=args.busy_s,
                pace_s=args.pace_s,
                timeout=args.timeout,
                beside=beside,
            )
            if beside is not None:
                run.beside_worker_ran = beside.worker_ran
    finally:
        for proc in (server, eager):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=120)
    print(f"{name}: {json.dumps(run.summary())}", flush=True)
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        with (Path(args.dump) / f"{name}.json").open("w") as fh:
            json.dump(dataclasses.asdict(run), fh)
    return run


def idle_probe(cache_dir: Path, model: str, steps: int = 40) -> None:
    """An eager server alone: steps back to back, then each after an idle gap (no compile
    anywhere). On some machines a step after a gap runs several times slower, every phase
    alike (as if the CPU ran slower after idle): a paced step during a compile pays it too."""
    _, server, port = launch(
        cache_dir, ["--graph-mode", "none"], cache_dir.parent / "idle.log", model
    )
    try:
        with ExecutorClient(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout=600)
            settled(server.pid)
            decoder = Decoder(client)
            for _ in range(20):
                decoder.decode()
            for gap in (0.0, 0.05, 0.5, 0.0, 0.5):
                ms, phases = [], []
                for _ in range(steps):
                    time.sleep(gap)
                    took, out = decoder.decode()
                    ms.append(took)
                    phases.append(out.stats.timings_ns)
                names = ("queue", "validate", "stage", "forward")
                split = ", ".join(
                    f"{n} {statistics.median(p.get(n, 0) for p in phases) / 1e6:.2f}" for n in names
                )
                print(
                    f"idle gap {gap} s: {steps} steps, median {statistics.median(ms):.1f} ms, "
                    f"max {max(ms):.1f} ms; server medians, ms: {split}",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait(timeout=120)


def report(run: Run, base: float) -> None:
    """A run's steps during its capture, against `base` (an eager median) and, step by step,
    against the eager server beside it."""
    during = run.during_ms or [float("nan")]
    print(
        f"{run.name}: first token {run.first_token_s:.1f} s ({run.answer!r}); compiled path "
        f"after {run.compiled_s or float('nan'):.1f} s; {len(run.during_ms)} steps meanwhile, "
        f"p99 {percentile(during, 99):.1f} ms = {percentile(during, 99) / base:.2f}x the "
        f"eager median {base:.1f} ms (max {max(during):.1f} ms); after: "
        f"{statistics.median(run.after_ms):.1f} ms on {sorted(set(run.paths_after))}"
    )
    for phase, busy in (("back to back", True), ("paced", False)):
        xs = [ms for ms, b in zip(run.during_ms, run.during_busy, strict=True) if b is busy]
        if not xs:
            continue
        line = (
            f"  {phase}: {len(xs)} steps, median {statistics.median(xs):.1f} ms = "
            f"{statistics.median(xs) / base:.2f}x, p99 {percentile(xs, 99):.1f} ms = "
            f"{percentile(xs, 99) / base:.2f}x"
        )
        near = [ms for ms, b in zip(run.beside_ms, run.beside_busy, strict=True) if b is busy]
        if near:
            m = statistics.median(near)
            line += (
                f"; the eager server beside it ({len(near)} steps, the worker running in "
                f"{run.beside_worker_ran}): median {m:.1f} ms, p99 "
                f"{percentile(near, 99):.1f} ms; meanwhile against it: median "
                f"{statistics.median(xs) / m:.2f}x, p99 {percentile(xs, 99) / m:.2f}x"
            )
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="the default model unless a smoke test")
    ap.add_argument("--cache-dir", default="", help="'' = a fresh temporary directory")
    ap.add_argument("--steps", type=int, default=100, help="steps measured after the capture")
    ap.add_argument(
        "--eager-steps", type=int, default=2000, help="the eager run's steps (its median: the base)"
    )
    ap.add_argument("--dump", default="", help="a directory for each run's steps (JSON)")
    ap.add_argument(
        "--idle-probe",
        action="store_true",
        help="only an eager server's steps back to back and after idle gaps (no compile)",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="the longest background compile")
    ap.add_argument("--busy-s", type=float, default=60, help="steps back to back this long")
    ap.add_argument("--pace-s", type=float, default=0.5, help="then one step every this long")
    ap.add_argument(
        "--first-token-only",
        action="store_true",
        help="cold and warm launches to the first token only (no steps, no wait for the compile)",
    )
    ap.add_argument(
        "--warm-only",
        action="store_true",
        help="3 alone, on the compiled steps an earlier run left in --cache-dir (e.g. to compare"
        " two trees' loads, each on its own warm cache dir)",
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
    if args.idle_probe:
        idle_probe(cache, args.model)
        return
    if args.warm_only:
        if not cache.exists():
            raise SystemExit(f"--warm-only: {cache} holds no earlier run's compiled steps")
        warm = measure("warm", cache, [], args)  # no server beside: steps from ready on
        during = warm.during_ms or [float("nan")]
        print(
            f"load after: {os.getloadavg()}\nwarm: {len(warm.during_ms)} steps while the saved "
            f"steps load: median {statistics.median(during):.1f} ms, p99 "
            f"{percentile(during, 99):.1f} ms, max {max(during):.1f} ms; compiled path after "
            f"{warm.compiled_s or float('nan'):.1f} s, then {statistics.median(warm.after_ms):.1f} ms"
        )
        return
    cold = measure("cold", cache, [], args, besides=True)
    if args.first_token_only:
        measure("warm", cache, [], args)
        print(f"load after: {os.getloadavg()}")
        return
    eager = measure("eager", cache, ["--graph-mode", "none"], args, steps=args.eager_steps)
    warm = measure("warm", cache, [], args, besides=True)
    # The restart's own load time: steps paced from ready (a saturated server loads nothing
    # until it is idle: `IdleGate`, so `warm`'s figure holds its busy window).
    restart = measure("restart", cache, [], argparse.Namespace(**{**vars(args), "busy_s": 0.0}))
    base = statistics.median(eager.after_ms)
    print(f"load after: {os.getloadavg()}")
    print(
        f"eager: {len(eager.after_ms)} steps, median {base:.1f} ms, p99 "
        f"{percentile(eager.after_ms, 99):.1f} ms = {percentile(eager.after_ms, 99) / base:.2f}x "
        "(the machine's own spread, no compile)"
    )
    for run in (cold, warm):
        report(run, base)
    if cold.compiled_s and warm.compiled_s and restart.compiled_s:
        # The cold compile stops while steps run back to back (`CompilePause`): its busy
        # window is left out of it, as the restart has none.
        work = cold.compiled_s - args.busy_s
        print(
            f"restart to the compiled path, steps paced from ready: {restart.compiled_s:.1f} s, "
            f"{restart.compiled_s / work:.1%} of the cold compile outside its busy window "
            f"({work:.1f} s); with the same busy window first: {warm.compiled_s:.1f} s, "
            f"{warm.compiled_s / cold.compiled_s:.1%} of the cold compile's {cold.compiled_s:.1f} s"
        )


if __name__ == "__main__":
    main()
