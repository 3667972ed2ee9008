"""Decode speed and start-up at DEFAULT settings, through gRPC, against llama.cpp on the same
GGUF file and thread count, in one run; other configurations beside it for comparison.

    PYTHONPATH=.:proto .venv/bin/python benchmarks/vs_llamacpp.py [--model smollm2]

Each `--configs` entry is a server started on loopback in its own process (one at a time, as
deployed) with only the sizing flags (`--max-reqs`, `--kv-slots`, `--max-context-len`) plus
that configuration's own:
- `defaults`: nothing else: what `make serve` runs. Its start-up (ready to answer) and, when a
  graph capture runs in the background, the time until it is in use are reported; the
  decode steps are measured once it is (the first steps run eagerly meanwhile).
- `eager`: the defaults with `--graph-mode none`;
- `gguf-torch`: `--quantization gguf --quant-kernel torch --graph-mode none` (torch's int4
  kernels, bfloat16 activations);
- `float32`: `--quantization none --dtype float32 --graph-mode none`;
- `compiled_step`: the defaults with each DECODE step one inductor graph per batch size.
Each server takes `--prompt` tokens of prefill for each of `--batch-sizes` requests, then
`--steps` DECODE steps through unary `Forward`; a step's time is the client's wall time per
call (token-to-token), reported as the median and the minimum (the minimum is the steadier
figure on a shared machine). bs-32 tokens/s is the aggregate.

llama.cpp runs through llama-cpp-python (the optional `bench` extra; it compiles llama.cpp from
source) with `--threads` threads, one stream: the same prompt length, then `--steps` greedy
tokens, token-to-token time, measured before and after the executor's runs. Without
llama-cpp-python that part is skipped with the reason. Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from served import Served, cpu_description, served  # benchmarks/served.py (the script's folder)

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.models.loader import resolve_model_spec

# ggml's AMX matmul segfaults on some Sapphire Rapids machines (llama.cpp issue 20824), and
# GGML_NATIVE=ON turns it on wherever the CPU has AMX.
AMX = (
    "on a CPU with AMX, build it with GGML_NATIVE=OFF and the CPU's ISA flags without AMX's "
    "(the CMAKE_ARGS in docs/performance.md)"
)
LLAMA_CPP_MISSING = (
    "llama-cpp-python is not installed, llama.cpp not measured: pip install '.[bench]' "
    "(compiles llama.cpp from source, about 6 minutes on two cores)"
)


@dataclass
class Measured:
    steps: dict[int, tuple[float, float]]  # bs -> (median, min) ms per DECODE step
    weight_bytes: int
    ready_s: float  # start to readiness (answering)
    graphs_s: float | None  # start until a background graph capture was in use (None: none ran)
    choices: list[str]  # GetInfo's setting choices, "setting=value (reason)"


CONFIGS = {
    "defaults": [],
    "eager": ["--graph-mode", "none"],
    "gguf-torch": ["--quantization", "gguf", "--quant-kernel", "torch", "--graph-mode", "none"],
    "float32": ["--quantization", "none", "--dtype", "float32", "--graph-mode", "none"],
    "compiled_step": ["--graph-mode", "decode", "--graph-backend", "compiled_step"],
}


def wait_for_graphs(server: Served, timeout: float) -> float | None:
    """Seconds since start until no background capture runs (None if none was running)."""
    client = server.client

    def capturing() -> bool:  # "capturing graph_mode=decode" while it runs
        return client.get_runtime_config().graph_capture.startswith("capturing")

    if not capturing():
        return None
    deadline = time.monotonic() + timeout
    while capturing():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the background graph capture did not end in {timeout} s")
        time.sleep(0.5)
    return time.perf_counter() - server.started_at


def executor_decode(
    flags: list[str], sizes: list[int], prompt: int, steps: int, threads: int
) -> Measured:
    """DECODE step times of a server in its own process started with `flags`."""
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    results: dict[int, tuple[float, float]] = {}
    with served(flags, env=env) as server:
        client = server.client
        graphs_s = wait_for_graphs(server, timeout=1800)
        info = client.info().info
        span = prompt + steps
        first = 1
        for bs in sizes:  # disjoint rows and slots for each batch size
            rows = list(range(first, first + bs))
            first += bs
            slots = {r: list(range(1 + (r - 1) * span, 1 + r * span)) for r in rows}
            client.forward(
                make_extend_batch(
                    input_ids=[[(17 * j) % 1000 + 100 for j in range(prompt)]] * bs,
                    req_pool_indices=rows,
                    out_cache_loc=[slots[r][:prompt] for r in rows],
                )
            )
            times = []
            for i in range(steps):
                batch = make_decode_batch(
                    input_ids=[11] * bs,
                    req_pool_indices=rows,
                    seq_lens=[prompt + i + 1] * bs,
                    out_cache_loc=[slots[r][prompt + i] for r in rows],
                )
                t0 = time.perf_counter()
                client.forward(batch)
                times.append(time.perf_counter() - t0)
            results[bs] = (statistics.median(times[2:]) * 1e3, min(times[2:]) * 1e3)
        choices = [f"{c.setting}={c.value} ({c.reason})" for c in info.choices]
        return Measured(results, info.weight_bytes, server.ready_s, graphs_s, choices)


def _signal_name(done: subprocess.CompletedProcess[str]) -> str:
    try:
        return signal.Signals(-done.returncode).name
    except ValueError:
        return f"signal {-done.returncode}"


def llama_cpp_decode(
    path: str, prompt: int, steps: int, threads: int, python: str
) -> tuple[float, float] | None:
    """(median, min) ms per token of one greedy stream (`llamacpp_stream.py` run by `python`),
    or None with the reason printed."""
    script = Path(__file__).with_name("llamacpp_stream.py")
    cmd = [python, str(script), path, "--prompt", str(prompt), "--steps", str(steps)]
    done = subprocess.run(
        [*cmd, "--threads", str(threads)], capture_output=True, text=True, check=False
    )
    if done.returncode < 0:  # it crashed: llama-cpp-python is there
        print(f"llama.cpp not measured: {python} {script.name} died of {_signal_name(done)}; {AMX}")
        return None
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output"
        print(f"{LLAMA_CPP_MISSING} ({python}: {reason})")
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return float(result["median_ms"]), float(result["min_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="the servers' torch intra-op threads (OMP_NUM_THREADS; 0: torch's default)",
    )
    ap.add_argument(
        "--configs", default="defaults,eager,gguf-torch,float32", help=", ".join(CONFIGS)
    )
    ap.add_argument("--cache-dir", default="", help="the servers' --cache-dir ('' = default)")
    ap.add_argument(
        "--llama-python",
        default=sys.executable,
        help="the interpreter with llama-cpp-python (it may live in a venv of its own)",
    )
    ap.add_argument(
        "--transformers",
        action="store_true",
        help="also transformers float32 on the same file, in this process (DynamicCache loop)",
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    source = resolve_model_spec(args.model)
    cpu, cpu_flags = cpu_description()
    print(
        f"machine: {cpu} ({os.cpu_count()} cores; {cpu_flags}); load {os.getloadavg()}\n"
        f"model={args.model} ({source.path}) torch={torch.__version__} server torch "
        f"threads={args.torch_threads or 'default'} prompt={args.prompt} steps={args.steps}"
    )
    # llama.cpp before and after the executor's runs: a shared machine's speed drifts over
    # minutes, so each ratio is given against both readings.
    llama = [measure_llama_cpp(source.path, args)]
    measured: dict[str, Measured] = {}
    for name in args.configs.split(","):
        if name not in CONFIGS:
            ap.error(f"--configs: one of {', '.join(CONFIGS)}, got {name!r}")
        flags = [
            "--model", args.model,
            "--max-reqs", str(sum(sizes) + 1),
            "--kv-slots", str((sum(sizes) + 1) * (args.prompt + args.steps)),
            "--max-context-len", str(args.prompt + args.steps + 8),
            *CONFIGS[name],
        ]  # fmt: skip
        if name == "compiled_step":
            flags += ["--graph-batch-sizes", args.batch_sizes]
        if args.cache_dir:
            flags += ["--cache-dir", args.cache_dir]
        m = executor_decode(flags, sizes, args.prompt, args.steps, args.torch_threads)
        measured[name] = m
        graphs = f", graphs in use after {m.graphs_s:.1f} s" if m.graphs_s is not None else ""
        print(
            f"executor {name}: ready in {m.ready_s:.1f} s{graphs}; weights {m.weight_bytes / 2**20:.1f} MiB"
        )
        if name == "defaults":
            for choice in m.choices:
                print(f"  {choice}")
        for bs, (med, best) in m.steps.items():
            print(
                f"executor {name:<13} bs={bs:<3} {med:8.2f} ms/step (min {best:7.2f}) "
                f"{bs * 1e3 / med:8.1f} tokens/s"
            )
    hf = transformers_decode(source.path, sizes, args.steps) if args.transformers else {}
    for bs, (med, best) in hf.items():
        print(f"transformers float32 bs={bs:<3} {med:8.2f} ms/step (min {best:7.2f})")
    for name, m in measured.items():
        for bs in sorted(set(hf) & set(m.steps)):
            print(
                f"bs-{bs} tokens/s {name} / transformers float32: "
                f"{hf[bs][0] / m.steps[bs][0]:.2f} (target >= 3 at bs 32)"
            )
    if llama[0] is not None:  # else the reason was printed once already
        llama.append(measure_llama_cpp(source.path, args))
    readings = [r for r in llama if r is not None]
    if not readings:
        return
    for when, (med, best) in zip(("before", "after"), readings, strict=False):
        print(
            f"llama.cpp threads={args.threads} bs=1 ({when}) {med:8.2f} ms/token (min "
            f"{best:7.2f}) {1e3 / med:8.1f} tokens/s"
        )
    for name, m in measured.items():
        if 1 in m.steps:
            ratios = " / ".join(f"{m.steps[1][0] / med:.2f}" for med, _ in readings)
            mins = " / ".join(f"{m.steps[1][1] / best:.2f}" for _, best in readings)
            print(f"bs-1 ms/token {name} / llama.cpp: {ratios} (minima {mins}; target <= 1.2)")
        big = max(m.steps)
        if big > 1:
            ratios = " / ".join(f"{big * med / m.steps[big][0]:.2f}" for med, _ in readings)
            print(
                f"bs-{big} aggregate tokens/s {name} / llama.cpp single stream: {ratios} "
                "(target >= 5)"
            )


def transformers_decode(
    path: Path | None, sizes: list[int], steps: int
) -> dict[int, tuple[float, float]]:
    """{bs: (median, min) ms per step} of transformers' own loop in float32 on the file."""
    from vs_transformers import Transformers  # benchmarks/vs_transformers.py

    if path is None:
        print("the model is no local GGUF file: transformers not measured")
        return {}
    model = Transformers(path)
    out = {}
    for bs in sizes:
        step = model.decode_step(bs)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out[bs] = (statistics.median(times[2:]) * 1e3, min(times[2:]) * 1e3)
    return out


def measure_llama_cpp(path: Path | None, args: argparse.Namespace) -> tuple[float, float] | None:
    if path is None:
        print("the model is no local GGUF file: llama.cpp not measured")
        return None
    return llama_cpp_decode(str(path), args.prompt, args.steps, args.threads, args.llama_python)


if __name__ == "__main__":
    main()
