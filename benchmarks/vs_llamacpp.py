"""Decode speed and weight memory: this executor (`--quantization none` and `gguf`, eager and
`compiled_step` graphs, through gRPC) against llama.cpp on the same GGUF file, in one run.

    PYTHONPATH=.:proto .venv/bin/python benchmarks/vs_llamacpp.py [--model smollm2]

For each quantization a server starts on loopback (in this process, one at a time), takes
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
import statistics
import time

import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.config import ExecutorConfig
from executor.models.loader import resolve_model_spec
from executor.service.server import start_server
from executor.service.server_config import ServerConfig

LLAMA_CPP_MISSING = (
    "llama-cpp-python is not installed, llama.cpp not measured: pip install '.[bench]' "
    "(compiles llama.cpp from source, about 6 minutes on two cores)"
)


def executor_decode(
    cfg: ExecutorConfig, sizes: list[int], prompt: int, steps: int
) -> tuple[dict[int, float], int]:
    """{bs: median ms per DECODE step through gRPC}, resident weight bytes."""
    running = start_server(
        cfg, ServerConfig(port=0, metrics_port=0, log_level="warning"), block_until_ready=True
    )
    results: dict[int, float] = {}
    try:
        with ExecutorClient(f"127.0.0.1:{running.port}") as client:
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
    finally:
        running.drain()
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
        help="torch intra-op threads (0: torch's default). On a shared, oversubscribed machine "
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
    args = ap.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    source = resolve_model_spec(args.model)
    print(
        f"model={args.model} ({source.path}) torch={torch.__version__} "
        f"torch threads={torch.get_num_threads()} prompt={args.prompt} steps={args.steps}"
    )
    measured: dict[tuple[str, str], tuple[dict[int, float], int]] = {}
    paths = args.paths.split(",")
    for quantization in args.quantizations.split(","):
        for path in paths:
            graphs = {"graph_mode": "none"}
            if path == "compiled_step":
                graphs = {
                    "graph_mode": "decode",
                    "graph_backend": "compiled_step",
                    "graph_batch_sizes": args.batch_sizes,
                }
            elif path != "eager":
                ap.error(f"--paths: eager or compiled_step, got {path!r}")
            cfg = ExecutorConfig(
                model=args.model,
                quantization=quantization,
                max_reqs=sum(sizes) + 1,
                kv_slots=(sum(sizes) + 1) * (args.prompt + args.steps),
                max_context_len=args.prompt + args.steps + 8,
                **graphs,  # type: ignore[arg-type]
            )
            per_bs, weight_bytes = executor_decode(cfg, sizes, args.prompt, args.steps)
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
    llama_ms = (
        llama_cpp_decode(str(source.path), args.prompt, args.steps, args.threads)
        if source.path is not None
        else None
    )
    if llama_ms is None:
        return
    print(
        f"llama.cpp threads={args.threads} bs=1 {llama_ms:8.2f} ms/token {1e3 / llama_ms:8.1f} tokens/s"
    )
    for (quantization, path), (per_bs, _) in measured.items():
        name = f"{quantization}/{path}"
        if 1 in per_bs:
            print(f"bs-1 ms/token {name} / llama.cpp: {per_bs[1] / llama_ms:.2f} (target <= 1.5)")
        big = max(per_bs)
        if big > 1:
            ratio = big * 1e3 / per_bs[big] / (1e3 / llama_ms)
            print(
                f"bs-{big} aggregate tokens/s {name} / llama.cpp single stream: {ratio:.2f} "
                "(target >= 5)"
            )


if __name__ == "__main__":
    main()
