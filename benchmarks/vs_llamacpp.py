"""Decode speed and weight memory: this executor (`--quantization none` and `gguf`, eager and
`compiled_step` graphs, through gRPC) against llama.cpp on the same GGUF file, in one run.

    PYTHONPATH=.:proto .venv/bin/python benchmarks/vs_llamacpp.py [--model smollm2]

For each quantization and path a server starts on loopback in its own process (one at a time,
as deployed: a server inside the benchmark's process measured 2-3x slower here), takes
`--prompt` tokens of prefill for each of `--batch-sizes` requests, then `--steps` DECODE steps
through unary `Forward`; a step's time is the client's wall time per call (token-to-token).
bs-32 tokens/s is the aggregate (32 tokens per step). Weight bytes are what `GetInfo` reports.

llama.cpp runs through llama-cpp-python (the optional `bench` extra:
`pip install '.[bench]'`; it compiles llama.cpp from source, about 6 minutes on two cores)
with `--threads` threads, one stream: the same prompt length, then `--steps` greedy tokens,
token-to-token time. Without llama-cpp-python that part is skipped with the reason, and the
executor's figures are still measured. Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from served import cpu_description, served  # benchmarks/served.py (the script's folder)

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.models.loader import resolve_model_spec

LLAMA_CPP_MISSING = (
    "llama-cpp-python is not installed, llama.cpp not measured: pip install '.[bench]' "
    "(compiles llama.cpp from source, about 6 minutes on two cores)"
)


def executor_decode(
    flags: list[str], sizes: list[int], prompt: int, steps: int, threads: int
) -> tuple[dict[int, float], int]:
    """{bs: median ms per DECODE step through gRPC}, resident weight bytes; the server in its
    own process with `flags`."""
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    results: dict[int, float] = {}
    with served(flags, env=env) as server:
        client = server.client
        weight_bytes = client.info().info.weight_bytes
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
            results[bs] = statistics.median(times[2:]) * 1e3
    return results, weight_bytes


def llama_cpp_decode(path: str, prompt: int, steps: int, threads: int) -> float | None:
    """Median ms per token of one greedy stream, or None (with the reason printed)."""
    try:
        import llama_cpp
    except ImportError:
        print(LLAMA_CPP_MISSING)
        return None
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=prompt + steps + 8, n_threads=threads, n_batch=prompt, verbose=False
    )
    tokens = [(17 * j) % 1000 + 100 for j in range(prompt)]
    times, last = [], time.perf_counter()
    for n, _tok in enumerate(llm.generate(tokens, top_k=1, temp=0.0, reset=True)):
        now = time.perf_counter()
        if n > 0:  # the first token closes the prefill
            times.append(now - last)
        last = now
        if n == steps:
            break
    return statistics.median(times[2:]) * 1e3


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
        help="the server's torch intra-op threads (OMP_NUM_THREADS; 0: torch's default). On a "
        "shared, oversubscribed machine "
        "the int4 kernel's OpenMP region waits for descheduled threads (~12 ms a call with 2 "
        "threads at load 8 on 2 cores, 0.5 ms with 1): compare the paths at 1 thread there",
    )
    ap.add_argument("--quantizations", default="gguf,none")
    ap.add_argument(
        "--paths",
        default="eager,compiled_step",
        help="eager (graph_mode none) and/or compiled_step (DECODE graphs at the batch sizes "
        "measured, each step one compiled graph; compiling costs about a minute per batch "
        "size on two cores, then inductor's cache under the default cache dir)",
    )
    ap.add_argument("--cache-dir", default="", help="the servers' --cache-dir ('' = default)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    source = resolve_model_spec(args.model)
    cpu, cpu_flags = cpu_description()
    print(
        f"machine: {cpu} ({os.cpu_count()} cores; {cpu_flags}); load {os.getloadavg()}\n"
        f"model={args.model} ({source.path}) torch={torch.__version__} server torch "
        f"threads={args.torch_threads or 'default'} prompt={args.prompt} steps={args.steps}"
    )
    # llama.cpp before and after the executor's runs: this machine's speed drifts by tens of
    # percent over minutes, so each ratio is given against both readings.
    llama_ms = [measure_llama_cpp(source.path, args)]
    measured: dict[tuple[str, str], tuple[dict[int, float], int]] = {}
    paths = args.paths.split(",")
    for quantization in args.quantizations.split(","):
        for path in paths:
            graphs = ["--graph-mode", "none"]
            if path == "compiled_step":
                graphs = [
                    "--graph-mode", "decode", "--graph-backend", "compiled_step",
                    "--graph-batch-sizes", args.batch_sizes,
                ]  # fmt: skip
            elif path != "eager":
                ap.error(f"--paths: eager or compiled_step, got {path!r}")
            # `none` is the float32 path the issue compares memory against (auto would be
            # bfloat16 on a CPU with native bfloat16); gguf keeps the auto activations.
            flags = [
                "--model", args.model, "--quantization", quantization,
                "--dtype", "float32" if quantization == "none" else "auto",
                "--max-reqs", str(sum(sizes) + 1),
                "--kv-slots", str((sum(sizes) + 1) * (args.prompt + args.steps)),
                "--max-context-len", str(args.prompt + args.steps + 8),
                *graphs,
            ]  # fmt: skip
            if args.cache_dir:
                flags += ["--cache-dir", args.cache_dir]
            per_bs, weight_bytes = executor_decode(
                flags, sizes, args.prompt, args.steps, args.torch_threads
            )
            measured[quantization, path] = per_bs, weight_bytes
            for bs, ms in per_bs.items():
                print(
                    f"executor quantization={quantization:<5} path={path:<13} bs={bs:<3} "
                    f"{ms:8.2f} ms/step {bs * 1e3 / ms:8.1f} tokens/s"
                )
        print(f"executor quantization={quantization:<5} weights {weight_bytes / 2**20:.1f} MiB")
    weights = {q: b for (q, _), (_, b) in measured.items()}
    if "gguf" in weights and "none" in weights:
        ratio = weights["gguf"] / weights["none"]
        print(f"weight bytes gguf / none: {ratio:.3f} (target <= 0.333)")
    if llama_ms[0] is not None:  # else the reason was printed once already
        llama_ms.append(measure_llama_cpp(source.path, args))
    readings = [ms for ms in llama_ms if ms is not None]
    if not readings:
        return
    for when, ms in zip(("before", "after"), readings, strict=False):
        print(
            f"llama.cpp threads={args.threads} bs=1 ({when}) {ms:8.2f} ms/token "
            f"{1e3 / ms:8.1f} tokens/s"
        )
    for (quantization, path), (per_bs, _) in measured.items():
        name = f"{quantization}/{path}"
        if 1 in per_bs:
            ratios = " / ".join(f"{per_bs[1] / ms:.2f}" for ms in readings)
            print(f"bs-1 ms/token {name} / llama.cpp: {ratios} (target <= 1.5)")
        big = max(per_bs)
        if big > 1:
            ratios = " / ".join(f"{big * ms / per_bs[big]:.2f}" for ms in readings)
            print(
                f"bs-{big} aggregate tokens/s {name} / llama.cpp single stream: {ratios} "
                "(target >= 5)"
            )


def measure_llama_cpp(path: Path | None, args: argparse.Namespace) -> float | None:
    if path is None:
        print("the model is no local GGUF file: llama.cpp not measured")
        return None
    return llama_cpp_decode(str(path), args.prompt, args.steps, args.threads)


if __name__ == "__main__":
    main()
