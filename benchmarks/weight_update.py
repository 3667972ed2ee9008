"""Weight update time per transport on loopback, and memory released and resumed.

The executor serves `--model` (SmolLM2, float32) in its own process (`served.py`). Its whole
checkpoint (every tensor, float32, slightly perturbed so the update changes something) is
sent `--repeats` times (after one round not counted) by each transport:
- `stream`: UpdateWeights from this process (4 MiB chunks, CRC-32 each);
- `path`: UpdateWeightsFromPath, the executor reading the safetensors file itself;
- `group`: UpdateWeightsFromGroup over a gloo weights group this process forms with it;
- `broadcast`: the baseline of `group`, a bare gloo broadcast of the same tensors between
  this process and a spawned one, into a staging arena kept between rounds as the
  executor's is (the receiver acknowledges the last tensor);
- `grpc`: the baseline of `stream`, a bare grpcio client stream of the same bytes in the same
  4 MiB messages to a spawned server that copies each into one buffer (one copy a side, no
  checksum, no protobuf).
Each figure is from the call to its answer (the update swapped in); the executor's answer
splits it into staging (while steps could run) and the swap (the pause between two steps).
Then ReleaseMemory and ResumeMemory of both tags, with the executor's resident set.

    python benchmarks/weight_update.py [--model smollm2] [--repeats 3] [--linear-kernel aten]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.multiprocessing as mp

from executor.client.grpc_client import ExecutorClient
from executor.parallel.group import free_port
from executor.weights.group import GroupSpec, WeightsGroup
from executor.weights.staging import StagingArena

MIB = 1 << 20
GIB = 1 << 30


@dataclass
class Figures:
    transport: str
    nbytes: int
    seconds: list[float] = field(default_factory=list)
    stage: list[float] = field(default_factory=list)
    swap: list[float] = field(default_factory=list)

    def row(self) -> str:
        med = statistics.median
        s = med(self.seconds)
        stage = f"{med(self.stage):.2f}" if self.stage else "-"
        swap = f"{med(self.swap):.3f}" if self.swap else "-"
        return (
            f"| {self.transport} | {self.nbytes / MIB:.0f} | {s:.2f} | "
            f"{self.nbytes / GIB / s:.2f} | {stage} | {swap} |"
        )


def checkpoint(model: str, cache_dir: Path | None) -> dict[str, torch.Tensor]:
    """The model's tensors as its loader reads them (float32), each scaled by 1.001."""
    from executor.models.loader import read_weights, resolve_model_spec

    _, tensors = read_weights(resolve_model_spec(model), cache_dir)
    return {n: (t.float() * 1.001).contiguous() for n, t in tensors.items()}


def _receiver(port: int, shapes: list[tuple[int, ...]], repeats: int) -> None:
    """Receives every round into one staging arena kept between rounds, as an update's
    receiver does (it cannot write into the weights in use)."""
    group = WeightsGroup(GroupSpec("127.0.0.1", port, 1, 2, timeout_s=600), torch.device("cpu"))
    arena = StagingArena()
    for _ in range(repeats):
        received = list(group.receive([(s, torch.float32) for s in shapes], 0, arena))
        group.verdict(0, 1)  # received: the sender's clock stops here
        del received


def _bare_grpc_server(conn: Any, nbytes: int) -> None:
    import grpc

    buffer = memoryview(bytearray(nbytes))

    def receive(messages: Any, context: Any) -> bytes:
        n = count = 0
        for m in messages:
            buffer[n : n + len(m)] = m
            n += len(m)
            count += 1
        return n.to_bytes(8, "little") + count.to_bytes(8, "little")

    options = [("grpc.max_receive_message_length", 64 * MIB)]
    server = grpc.server(futures.ThreadPoolExecutor(2), options=options)
    handler = grpc.stream_unary_rpc_method_handler(receive)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("bare.B", {"S": handler})]
    )
    conn.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    conn.recv()  # (until told to stop)
    server.stop(0)


def bare_grpc_stream(
    tensors: list[torch.Tensor], repeats: int, chunk_bytes: int | None = None
) -> list[float]:
    """Seconds to stream `tensors`' bytes in messages of `chunk_bytes` (UpdateWeights' chunk
    size by default) to a bare grpcio server in a spawned process, `repeats` times."""
    import grpc

    from executor.service.weights_codec import CHUNK_BYTES

    chunk = chunk_bytes or CHUNK_BYTES
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    views = [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors]
    parent, conn = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=_bare_grpc_server, args=(conn, nbytes))
    child.start()
    port = parent.recv()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.stream_unary("/bare.B/S")

    def messages() -> Any:
        for v in views:
            for offset in range(0, len(v), chunk):
                yield bytes(v[offset : offset + chunk])  # one copy, as an encoding

    count = sum(-(-(t.numel() * t.element_size()) // chunk) for t in tensors)
    seconds = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            answer = call(messages())
            seconds.append(time.perf_counter() - t0)
            got = (int.from_bytes(answer[:8], "little"), int.from_bytes(answer[8:], "little"))
            assert got == (nbytes, count), (got, nbytes, count)
    finally:  # the server process ends whatever happened here
        channel.close()
        parent.send(None)
        child.join(60)
    return seconds


def bare_broadcast(tensors: list[torch.Tensor], repeats: int) -> list[float]:
    """Seconds to broadcast `tensors` to one spawned gloo member, `repeats` times."""
    port = free_port()
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_receiver, args=(port, [tuple(t.shape) for t in tensors], repeats))
    child.start()
    group = WeightsGroup(GroupSpec("127.0.0.1", port, 0, 2, timeout_s=600), torch.device("cpu"))
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for t in tensors:
            group.broadcast(t, 0)
        group.verdict(0, 1)
        seconds.append(time.perf_counter() - t0)
    child.join(60)
    return seconds


def measure(
    client: ExecutorClient, tensors: dict[str, torch.Tensor], path: str, repeats: int
) -> list[Figures]:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    figures = {k: Figures(k, nbytes) for k in ("stream", "path", "group")}
    weights = client.weights
    with weights.open_group("127.0.0.1", free_port(), world_size=2, timeout_s=600) as group:
        calls = {
            "stream": lambda v: weights.update(tensors.items(), version=v),
            "path": lambda v: weights.update_from_path(path, version=v),
            "group": lambda v: group.update(tensors.items(), version=v),
        }
        for i in range(repeats + 1):  # the first round warms up and is not counted
            for name, call in calls.items():
                t0 = time.perf_counter()
                result = call(f"{name}-{i}")
                if i:
                    figures[name].seconds.append(time.perf_counter() - t0)
                    figures[name].stage.append(result.stage_seconds)
                    figures[name].swap.append(result.swap_seconds)
    base = Figures("broadcast", nbytes, bare_broadcast(list(tensors.values()), repeats + 1)[1:])
    grpc = Figures("grpc", nbytes, bare_grpc_stream(list(tensors.values()), repeats + 1)[1:])
    return [*figures.values(), base, grpc]


def _rss(pid: int) -> int:
    import os

    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(client: ExecutorClient, pid: int) -> list[str]:
    lines = [
        "| call | tags | bytes (MiB) | resident set change (MiB) | seconds |",
        "|---|---|---:|---:|---:|",
    ]
    for name, call in (
        ("ReleaseMemory", lambda: client.weights.release(["weights", "kv_cache"])),
        ("ResumeMemory (reload)", lambda: client.weights.resume(["weights", "kv_cache"])),
    ):
        before = _rss(pid)
        report = call()
        change = (_rss(pid) - before) / MIB
        lines.append(
            f"| {name} | weights, kv_cache | {report.nbytes / MIB:.0f} | {change:+.0f} | "
            f"{report.seconds:.2f} |"
        )
    return lines


def main() -> None:
    from benchmarks.served import cpu_description, served

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-slots", type=int, default=4096)
    parser.add_argument("--linear-kernel", default="auto", help="onednn packs, aten does not")
    parser.add_argument(
        "--omp-threads", type=int, default=0, help="the executor's OMP_NUM_THREADS (0: unset)"
    )
    args = parser.parse_args()
    tensors = checkpoint(args.model, Path(tempfile.gettempdir()) / "model-executor-cache")
    with tempfile.TemporaryDirectory() as root:
        from safetensors.torch import save_file

        save_file(tensors, str(Path(root) / "model.safetensors"))
        flags = ["--model", args.model, "--dtype", "float32", "--quantization", "none"]
        flags += ["--graph-mode", "none", "--kv-slots", str(args.kv_slots), "--max-reqs", "8"]
        flags += ["--linear-kernel", args.linear_kernel]
        flags += ["--weight-update-root", root, "--weight-group-addresses", "127.0.0.1"]
        model, simd = cpu_description()
        env = {"OMP_NUM_THREADS": str(args.omp_threads)} if args.omp_threads else None
        with served(flags, env=env) as server:
            info = server.client.info().info
            print(
                f"# {model} ({simd}); {args.model} float32, linear_kernel {info.linear_kernel}, "
                f"{len(tensors)} tensors, resident weights {info.weight_bytes / MIB:.0f} MiB; "
                f"{args.repeats} repeats, medians; OMP_NUM_THREADS {args.omp_threads or 'unset'}"
            )
            figures = measure(server.client, tensors, "model.safetensors", args.repeats)
            mem = memory(server.client, server.process.pid)
    print("| transport | MiB | seconds | GiB/s | staging s | swap s |")
    print("|---|---:|---:|---:|---:|---:|")
    for f in figures:
        print(f.row())
    stream, group, base, grpc = figures[0], figures[2], figures[3], figures[4]
    ratio = statistics.median(group.seconds) / statistics.median(base.seconds)
    print(f"\ngroup / bare broadcast: {ratio:.2f}x")
    ratio = statistics.median(stream.seconds) / statistics.median(grpc.seconds)
    print(f"stream / bare grpcio stream: {ratio:.2f}x\n")
    print("\n".join(mem))


if __name__ == "__main__":
    main()
