"""This executor through gRPC against Hugging Face transformers' manual KV-cache loop.

    pip install -e '.[bench]'     # transformers + accelerate (+ matplotlib for the plot)
    python benchmarks/vs_transformers.py                 # SmolLM2-135M, float32, CPU
    python benchmarks/vs_transformers.py --write-doc     # also docs/performance.md + PNG
    python benchmarks/vs_transformers.py --linear-kernels aten,onednn   # both, side by side

The executor runs as users run it: `python -m executor serve` in its own process, driven
through `Forward`; its three paths (eager, full_graph, piecewise) are switched between
measurements through `UpdateRuntimeConfig` (graph_mode none/decode/extend). transformers
loads the same GGUF (dequantized to the same float32 weights) in this process and runs
its own model with a `DynamicCache`, one token per step: the loop a user writes.

DECODE: `bs` requests with a 128-token context each; every step decodes the token at
position 128 again (ours: `seq_lens` 129 into the same slot; transformers: the cache
cropped back to 128), so every step attends over exactly 129 keys. With several
`--linear-kernels` one server per kernel runs beside the others (idle while another is
measured) and its paths are labelled with the kernel. PREFILL: 8 requests x
128 tokens in one step. Each (size, path) is timed in `--rounds` interleaved rounds of
`--steps` steps; the table reports the median round and the range over rounds, so noise
from other processes on a shared machine shows up as a range rather than hiding in a mean.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from served import cpu_description, served  # benchmarks/served.py (the script's folder)

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.models.loader import packaged_smollm2_path
from executor.service.runtime_config import parse_assignments

CONTEXT = 128
PREFILL = (8, 128)
DECODE_SIZES = [1, 8, 32, 64]
PATH_MODES = {"eager": "none", "full_graph": "decode", "piecewise": "extend"}
ROOT = Path(__file__).resolve().parents[1]


def server_flags(args: argparse.Namespace, linear_kernel: str) -> list[str]:
    """`serve` flags of one server: every path's graphs at the sizes measured."""
    return [
        "--model", args.model, "--linear-kernel", linear_kernel,
        "--graph-mode", "both", "--graph-backend", args.graph_backend,
        "--max-reqs", str(max(DECODE_SIZES) + PREFILL[0] + 1),
        "--kv-slots", str((max(DECODE_SIZES) + PREFILL[0] + 1) * (CONTEXT + 1) + 8),
        "--max-context-len", str(args.max_context_len),
        "--graph-batch-sizes", ",".join(map(str, args.sizes)),
        "--piecewise-token-sizes", str(PREFILL[0] * PREFILL[1]),
        "--max-tokens-per-batch", str(PREFILL[0] * PREFILL[1]),
        "--cache-dir", args.cache_dir,
    ]  # fmt: skip


def timed_rounds(run: Callable[[], None], steps: int) -> float:
    """ms per step of one round of `steps` steps (after one untimed step)."""
    run()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - t0) * 1e3 / steps


class Ours:
    def __init__(self, client: ExecutorClient) -> None:
        self.client = client
        self.mode = ""

    def set_path(self, path: str) -> None:
        mode = PATH_MODES[path]
        if mode != self.mode:
            self.client.update_runtime_config(parse_assignments([f"graph_mode={mode}"]))
            self.mode = mode

    def decode_step(self, bs: int, first_row: int, first_slot: int) -> Callable[[], None]:
        rows = list(range(first_row, first_row + bs))
        slots = [first_slot + i * (CONTEXT + 1) for i in range(bs)]
        per_batch = PREFILL[0] * PREFILL[1] // CONTEXT  # within max_tokens_per_batch
        for i in range(0, bs, per_batch):
            part = rows[i : i + per_batch]
            self.client.forward(
                make_extend_batch(
                    input_ids=[[(31 * r + j) % 1000 + 5 for j in range(CONTEXT)] for r in part],
                    req_pool_indices=part,
                    out_cache_loc=[list(range(s, s + CONTEXT)) for s in slots[i : i + per_batch]],
                )
            )
        batch = make_decode_batch(
            input_ids=[42] * bs,
            req_pool_indices=rows,
            seq_lens=[CONTEXT + 1] * bs,
            out_cache_loc=[s + CONTEXT for s in slots],
        )

        def step() -> None:
            self.client.forward(batch)

        return step

    def prefill_step(self, first_row: int, first_slot: int) -> Callable[[], None]:
        n, length = PREFILL
        rows = list(range(first_row, first_row + n))
        slots = [first_slot + i * length for i in range(n)]
        batch = make_extend_batch(
            input_ids=[[(17 * r + j) % 1000 + 5 for j in range(length)] for r in rows],
            req_pool_indices=rows,
            out_cache_loc=[list(range(s, s + length)) for s in slots],
        )

        def step() -> None:
            self.client.forward(batch)  # rewrites the same rows and slots every time

        return step


class Transformers:
    def __init__(self, gguf: Path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()

    @torch.inference_mode()
    def decode_step(self, bs: int) -> Callable[[], None]:
        from transformers import DynamicCache

        ids = torch.tensor([[(31 * r + j) % 1000 + 5 for j in range(CONTEXT)] for r in range(bs)])
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = torch.full((bs, 1), 42)
        position = torch.full((bs, 1), CONTEXT)

        @torch.inference_mode()
        def step() -> None:
            out = self.model(
                input_ids=token, position_ids=position, past_key_values=cache, use_cache=True
            )
            out.logits[:, -1].argmax(-1)
            cache.crop(-1)  # back to CONTEXT tokens (a positive length is refused)

        return step

    def prefill_step(self) -> Callable[[], None]:
        n, length = PREFILL
        ids = torch.tensor([[(17 * r + j) % 1000 + 5 for j in range(length)] for r in range(n)])

        @torch.inference_mode()
        def step() -> None:
            out = self.model(input_ids=ids, use_cache=True)
            out.logits[:, -1].argmax(-1)

        return step


def fmt_range(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--graph-backend", default="compiled")
    ap.add_argument("--max-context-len", type=int, default=256)  # one KV bucket holds 129
    ap.add_argument("--batch-sizes", default=",".join(map(str, DECODE_SIZES)))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "vs-transformers"))
    ap.add_argument(
        "--linear-kernels", default="onednn", help="comma-separated: one server each (aten, onednn)"
    )
    ap.add_argument("--write-doc", action="store_true")
    args = ap.parse_args()
    args.sizes = [int(b) for b in args.batch_sizes.split(",")]
    kernels = args.linear_kernels.split(",")
    load_before = os.getloadavg()[0]
    gguf = packaged_smollm2_path()
    ready: dict[str, float] = {}
    with ExitStack() as stack:
        ports: dict[str, int] = {}
        for kernel in kernels:  # one after another: start-up times are not shared
            server = stack.enter_context(served(server_flags(args, kernel)))
            ports[kernel], ready[kernel] = server.port, server.ready_s
        results = run(args, gguf, ports)
    cpu, flags = cpu_description()
    started = ", ".join(f"{k} {s:.0f} s" for k, s in ready.items())
    header = (
        f"machine: {cpu} ({os.cpu_count()} cores; flags: {flags}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; SmolLM2-135M float32; graph backend "
        f"{args.graph_backend}; linear kernel {args.linear_kernels}; server ready in {started} "
        f"(cache dir {args.cache_dir}); load average before the run {load_before:.2f}"
    )
    table = render(results)
    print(header)
    print(table)
    if args.write_doc:
        write_doc(args, header, table, results)


Results = dict[str, dict[str, list[float]]]  # workload -> path -> ms per step, one per round


def run(args: argparse.Namespace, gguf: Path, ports: dict[str, int]) -> Results:
    """Every workload in `--rounds` interleaved rounds: transformers, then each server's
    paths (labelled `path [kernel]` when there are several servers)."""
    hf = Transformers(gguf)
    results: Results = {}
    clients = {k: ExecutorClient(f"127.0.0.1:{port}") for k, port in ports.items()}
    try:
        servers = {k: Ours(c) for k, c in clients.items()}
        workloads: list[
            tuple[str, Callable[[], None], dict[str, tuple[Ours, str, Callable[[], None]]]]
        ] = []

        def label(path: str, kernel: str) -> str:
            return path if len(servers) == 1 else f"{path} [{kernel}]"

        for bs in args.sizes:
            paths = {}
            for kernel, ours in servers.items():
                step = ours.decode_step(bs, 1, 1)  # same rows and slots for every path
                for p in ("eager", "full_graph"):
                    paths[label(p, kernel)] = (ours, p, step)
            workloads.append((f"decode bs {bs}", hf.decode_step(bs), paths))
        n, length = PREFILL
        paths = {}
        for kernel, ours in servers.items():
            prefill = ours.prefill_step(
                1 + max(DECODE_SIZES), 1 + max(DECODE_SIZES) * (CONTEXT + 1)
            )
            for p in ("eager", "piecewise"):
                paths[label(p, kernel)] = (ours, p, prefill)
        workloads.append((f"prefill {n} x {length}", hf.prefill_step(), paths))
        for name, hf_step, by_label in workloads:
            results[name] = {"transformers": [], **{p: [] for p in by_label}}
            for _ in range(args.rounds):  # interleaved, so drift hits every column alike
                results[name]["transformers"].append(timed_rounds(hf_step, args.steps))
                for key, (ours, path, step) in by_label.items():
                    ours.set_path(path)
                    results[name][key].append(timed_rounds(step, args.steps))
            print(name, {k: fmt_range(v) for k, v in results[name].items()}, flush=True)
    finally:
        for c in clients.values():
            c.close()
    return results


def tokens_per_step(name: str) -> int:
    if name.startswith("decode"):
        return int(name.split()[-1])
    return PREFILL[0] * PREFILL[1]


def render(results: Results) -> str:
    rows = [
        "| workload | path | ms/step, median (range) | tokens/s | vs transformers (tokens/s ratio) |",
        "|---|---|---:|---:|---:|",
    ]
    for name, by_path in results.items():
        ref = statistics.median(by_path["transformers"])
        for path, values in by_path.items():
            ms = statistics.median(values)
            tps = tokens_per_step(name) * 1e3 / ms
            ratio = "1.00x" if path == "transformers" else f"{ref / ms:.2f}x"
            rows.append(f"| {name} | {path} | {fmt_range(values)} | {tps:,.0f} | {ratio} |")
    return "\n".join(rows)


def write_doc(args: argparse.Namespace, header: str, table: str, results: Results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png = ROOT / "docs" / "vs_transformers.png"
    names = list(results)
    paths = list(dict.fromkeys(p for by_path in results.values() for p in by_path))
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(paths)
    for i, path in enumerate(paths):
        ys = [
            tokens_per_step(n) * 1e3 / statistics.median(results[n][path])
            if path in results[n]
            else 0
            for n in names
        ]
        ax.bar([x + i * width for x in range(len(names))], ys, width, label=path)
    ax.set_xticks([x + (len(paths) - 1) / 2 * width for x in range(len(names))], names)
    ax.set_ylabel("tokens/s")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M float32 on CPU: executor via gRPC vs transformers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    doc = ROOT / "docs" / "vs_transformers.md"
    text = doc.read_text()
    begin, end = "<!-- BEGIN vs_transformers -->", "<!-- END vs_transformers -->"
    command = (
        "python benchmarks/vs_transformers.py --write-doc "
        f"--steps {args.steps} --rounds {args.rounds} --graph-backend {args.graph_backend} "
        f"--batch-sizes {args.batch_sizes} --linear-kernels {args.linear_kernels}"
    )
    block = (
        f"{begin}\n{header}\n\nCommand: `{command}`\n\n{table}\n\n![](vs_transformers.png)\n{end}"
    )
    if begin in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text += f"\n{block}\n"
    doc.write_text(text)


if __name__ == "__main__":
    main()
