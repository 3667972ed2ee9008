"""Run an in-process generation on a tensor-parallel group of ranks (gloo, CPU).

`generate_tp` starts `tp_size` processes (`rank_context`): rank 0 generates
through `ModelExecutor.forward` (validation, broadcast, sampling), the others run the worker
loop; rank 0's tokens come back through a queue. Every process is joined or killed before it
returns, even when one fails, and the rendezvous port is a free one.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import traceback
from collections.abc import Iterator
from typing import Any

import torch.multiprocessing as mp

from executor.parallel.group import TpEndpoint, free_port


def rank_context() -> Any:
    """Where the ranks come from: forked from one server process per test process, which
    imported torch and the executor once (forkserver). Spawned, each of the suite's many
    ranks imported them again, seconds of CPU each on a 2-core machine. The server forks
    before any rank's code runs (no thread, no CUDA), as spawn starts fresh; the production
    launcher (`executor.service.tp_launch`) still spawns."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "executor.model_executor", "tests.tp_util"])
    return ctx


class PickleUsedError(AssertionError):
    """Something pickled or unpickled while `pickle_forbidden` was in force."""


@contextlib.contextmanager
def pickle_forbidden() -> Iterator[None]:
    """Make every way into pickle raise `PickleUsedError`: the module's functions and classes,
    and the picklers torch.distributed's object collectives bound at import."""
    import torch.distributed.distributed_c10d as c10d

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PickleUsedError("pickle was used on the tensor-parallel path")

    targets = [(pickle, n) for n in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler")]
    targets += [(c10d, n) for n in ("_pickler", "_unpickler") if hasattr(c10d, n)]
    saved = [(mod, name, getattr(mod, name)) for mod, name in targets]
    for mod, name, _ in saved:
        setattr(mod, name, refuse)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def run_generations(ex: Any, prompts: list[list[int]], runs: list[dict[str, Any]]) -> list[Any]:
    """`generate(...)` once per kwargs of `runs`: [(tokens, sorted paths the steps took)];
    a run `{"toggles": {...}}` applies runtime toggles instead (broadcast to every rank),
    `{"refuse": batch}` sends a batch that must be refused (never broadcast): its error,
    `{"batches": [...]}` runs prebuilt batches: the tokens of each, `{"pipelined": [...]}`
    the same, all queued at once behind the device thread (rank 0 pipelines, workers follow),
    and `{"weights": {...}}` updates the weights (`tests.weights_util.transport_update`)."""
    from executor.client.scheduler import generate
    from executor.core.errors import BatchValidationError

    results: list[Any] = []
    for kw in runs:
        if "toggles" in kw:
            ex.control.apply_toggles(**kw["toggles"])
            continue
        if "batches" in kw or "pipelined" in kw:  # prebuilt batches: tokens and extra outputs
            outs = (
                [ex.forward(b) for b in kw["batches"]]
                if "batches" in kw
                else _through_worker(ex, kw["pipelined"])
            )
            extras = [
                None
                if o.extras is None
                else {k: v.values.tolist() for k, v in vars(o.extras).items() if v is not None}
                for o in outs
            ]
            results.append(([o.next_token_ids.tolist() for o in outs], extras))
            continue
        if "weights" in kw:  # new weights, staged as a transport stages them
            from tests.weights_util import transport_update

            results.append(transport_update(ex, **kw["weights"]))
            continue
        if "captured" in kw:  # the graph buckets this rank serves: (decode, piecewise)
            runner = ex.runner
            results.append(
                tuple(
                    sorted(r.captured) if r is not None else None
                    for r in (runner.decode_graphs, runner.piecewise)
                )
            )
            continue
        if "refuse" in kw:
            try:
                ex.forward(kw["refuse"])
            except BatchValidationError as e:
                results.append((e.field, []))
                continue
            raise AssertionError("the invalid batch was not refused")
        paths: set[str] = set()

        def forward(batch: Any, paths: set[str] = paths) -> Any:
            out = ex.forward(batch)
            paths.add(out.stats.path)
            return out

        results.append((generate(forward, ex.limits, prompts, **kw), sorted(paths)))
    return results


def _through_worker(ex: Any, batches: list[Any]) -> list[Any]:
    """`batches` queued before the device thread starts, so each step finds the next waiting."""
    from executor.service.device_worker import DeviceWorker

    worker = DeviceWorker(ex, queue_size=len(batches) + 1)
    jobs = [worker.submit(b, i + 1) for i, b in enumerate(batches)]
    worker.start()
    assert worker.wait_idle(120)
    worker.stop(10)
    return [job.future.result() for job in jobs]


def fail_captures(skip: dict[str, int]) -> None:
    """The fault a rank injects into its own captures: bucket `size` of runner `kind`
    (decode | piecewise) fails as an out-of-memory capture does (cleanly, that bucket only)."""
    from executor.graphs.decode_runner import DecodeGraphRunner
    from executor.graphs.graph import GraphCaptureOOM
    from executor.graphs.piecewise_runner import PiecewiseGraphRunner

    for cls in (DecodeGraphRunner, PiecewiseGraphRunner):
        if cls.kind not in skip:
            continue
        original = cls._capture_one

        def capture_one(self: Any, size: int, original: Any = original) -> None:
            if size == skip[self.kind]:
                raise GraphCaptureOOM(f"injected: out of memory capturing {self.kind} {size}")
            original(self, size)

        cls._capture_one = capture_one  # type: ignore[method-assign]


def _rank_main(
    rank: int,
    config: Any,
    port: int,
    prompts: list[list[int]],
    runs: list[dict[str, Any]],
    out: Any,
    faults: dict[int, dict[str, int]] | None = None,
    forbid_pickle: bool = False,
) -> None:
    from executor.config import resolve_device
    from executor.model_executor import ModelExecutor
    from executor.parallel.group import close_comm, init_comm
    from executor.parallel.nccl_env import set_nccl_error_handling
    from executor.tp_worker import run_worker

    comm = None
    if faults and rank in faults:
        fail_captures(faults[rank])
    try:
        endpoint = TpEndpoint(
            rank, config.tp_size, "127.0.0.1", port, config.tp_timeout_s, local_rank=rank
        )
        device = resolve_device(config, rank)
        set_nccl_error_handling(os.environ, device)
        comm = init_comm(endpoint, device)
        ex = ModelExecutor(config, comm=comm, local_rank=rank)
        guard = pickle_forbidden() if forbid_pickle else contextlib.nullcontext()
        if rank == 0:
            ex.warmup()
            with guard:  # every step and toggle, broadcast (the queue below pickles)
                result = run_generations(ex, prompts, runs)
                ex.close()
            out.put(("ok", result))
        else:
            with guard:
                run_worker(ex)
    except BaseException:
        out.put(("error", f"rank {rank}: {traceback.format_exc()}"))
        raise
    finally:
        # Every rank leaves with its group freed (its gloo and TCPStore threads joined
        # here): a group that outlives it meets the interpreter's teardown (exit -6).
        if comm is not None and not close_comm(comm):
            raise AssertionError(f"rank {rank}: the process group outlived close_comm")


GROUP_THREADS = ("gloo", "tcpstore")  # the C++ threads of a gloo group (prefixes, /proc names)


def thread_names() -> list[str]:
    """This process's threads, as the kernel names them (C++ threads included)."""
    names = []
    for task in sorted(os.listdir("/proc/self/task")):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names


def _leave_group(rank: int, port: int, out: Any) -> None:
    """Join a group of 2, import torch._dynamo after it exists (as the model's load does),
    run collectives, leave: whether the group was freed, and the group threads left."""
    import torch

    from executor.parallel.group import close_comm, init_comm

    comm = init_comm(TpEndpoint(rank, 2, "127.0.0.1", port, 60), torch.device("cpu"))
    import torch._dynamo  # after the group exists, as the model's load imports it

    one = torch.ones(3)
    for _ in range(3):
        comm.all_reduce_(one)
        comm.ping()
    freed = close_comm(comm)
    left = [n for n in thread_names() if any(g in n for g in GROUP_THREADS)]
    out.put((rank, freed, left))


def leave_group_tp() -> list[tuple[int, bool, list[str]]]:
    """`_leave_group` on 2 ranks: each rank's (rank, freed, group threads left),
    after checking both exited 0."""
    ctx = rank_context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_leave_group, args=(r, port, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        assert [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def generate_tp(
    config: Any,
    prompts: list[list[int]],
    runs: list[dict[str, Any]],
    timeout_s: float = 240,
    *,
    faults: dict[int, dict[str, int]] | None = None,
    forbid_pickle: bool = False,
) -> list[Any]:
    """Rank 0's `run_generations(...)` at `config.tp_size` ranks; `faults`: rank -> the
    capture it fails (`fail_captures`); `forbid_pickle`: pickle raises on every rank while the
    steps run (`pickle_forbidden`)."""
    ctx = rank_context()
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, config, port, prompts, runs, out, faults, forbid_pickle),
            daemon=True,
        )
        for r in range(config.tp_size)
    ]
    for p in procs:
        p.start()
    try:
        try:
            status, value = out.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"tp {config.tp_size}: no result in {timeout_s} s") from None
        if status != "ok":
            raise AssertionError(value)
        for p in procs:
            p.join(timeout=30)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return value
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
