"""Start or join the tensor-parallel group around a served executor (`--tp-size N`).

`serve` on its own spawns ranks 1..N-1 (`torch.multiprocessing`, spawn) that meet through a
FileStore in a private directory (mode 0700), and pins gloo's (and NCCL's bootstrap) sockets to
the loopback interface: nothing the group listens on is reachable from off the pod, and its
store (which holds pickled values in torch) is a file only this user can write. Under `torchrun` (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) every process runs
`serve`, rank 0 serves gRPC and the others run the worker loop instead (`run_torchrun_worker`).

Workers never outlive rank 0: each exits within half a second of its parent's death (a
thread watches the parent pid), and otherwise ends when a collective times out. `TpGroup.stop`
tells the workers to stop, then waits for them, then kills what is left: no orphans.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch.multiprocessing as mp

from executor.config import ExecutorConfig, resolve_device
from executor.models.loader import prepare_shared_weights
from executor.parallel.comm import TpComm, TpGroupError
from executor.parallel.group import TpEndpoint, close_comm, endpoint_from_env, init_comm
from executor.parallel.nccl_env import set_nccl_error_handling
from executor.parallel.parent_watch import die_with_parent
from executor.service import heap
from executor.service.server_config import ServerConfig
from ops import triton_off

log = structlog.get_logger(__name__)

STOP_WAIT_S = 10.0  # how long `stop` waits for the workers to exit before killing them


def worker_main(
    rank: int, config: ExecutorConfig, endpoint: TpEndpoint, log_level: str, log_format: str
) -> None:
    """A spawned worker (`rank` >= 1): join, load this rank's shard, follow rank 0; exit 1
    when the group fails."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C: rank 0 stops the group
    sys.exit(run_worker_rank(config, _with_rank(endpoint, rank), log_level, log_format))


def _with_rank(endpoint: TpEndpoint, rank: int) -> TpEndpoint:
    return dataclasses.replace(endpoint, rank=rank, local_rank=rank)


# The socket interface variables torch reads (gloo's pairs, NCCL's bootstrap); the loopback
# interface for a group whose ranks share one host. An operator's own setting wins.
LOOPBACK_INTERFACE = "lo"
_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def pin_to_loopback(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set the interface variables (those unset) to loopback in `environ`; what was set. The
    spawned workers inherit them."""
    pinned = {}
    for name in _INTERFACE_VARIABLES:
        if not environ.get(name):
            environ[name] = LOOPBACK_INTERFACE
            pinned[name] = LOOPBACK_INTERFACE
    return pinned


def run_torchrun_worker(
    config: ExecutorConfig, endpoint: TpEndpoint, server_config: ServerConfig
) -> int:
    """A rank >= 1 that torchrun launched: the process exit code. torchrun forwards SIGTERM to
    every rank: a worker keeps serving rank 0's draining steps and stops on its command (or
    when rank 0 is gone)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    return run_worker_rank(config, endpoint, server_config.log_level, server_config.log_format)


def run_worker_rank(
    config: ExecutorConfig, endpoint: TpEndpoint, log_level: str, log_format: str
) -> int:
    """The worker side of a rank (spawned or torchrun): the process exit code."""
    from executor.model_executor import ModelExecutor
    from executor.observability.logs import configure_logging
    from executor.tp_worker import run_worker

    configure_logging(log_level, log_format, rank=endpoint.rank)
    triton_off.keep_out_on_cpu(config.device)  # this process's own, as `serve`'s
    comm: TpComm | None = None
    try:
        device = resolve_device(config, endpoint.local_rank)
        set_nccl_error_handling(os.environ, device)
        comm = init_comm(endpoint, device)
        executor = ModelExecutor(config, comm=comm, local_rank=endpoint.local_rank)
        heap.freeze()  # this process's own: a worker's collections would stall rank 0's steps
        run_worker(executor, after_toggles=heap.refreeze)  # and what a capture loads
        return 0
    except TpGroupError as e:
        log.error("tensor-parallel group failed; worker exiting", reason=str(e))
        return 1
    except BaseException as e:
        log.error("tensor-parallel worker failed", exc_info=e)
        return 1
    finally:
        if comm is not None and comm.failed is None:
            close_comm(comm)


def torchrun_endpoint(config: ExecutorConfig, env: Mapping[str, str]) -> TpEndpoint | None:
    """This process's endpoint when torchrun launched it (None otherwise)."""
    if config.tp_size == 1 and "WORLD_SIZE" not in env:
        return None
    return endpoint_from_env(env, config.tp_size, config.tp_timeout_s)


@dataclass
class TpGroup:
    """Rank 0's view of the group: its communicator and the workers it spawned."""

    comm: TpComm
    processes: list[Any] = field(default_factory=list)
    store_dir: str = ""  # the FileStore's private directory, removed at stop

    def alive(self) -> list[int]:
        return [p.pid for p in self.processes if p.is_alive()]

    def stop(self, timeout_s: float = STOP_WAIT_S) -> list[int | None]:
        """Wait for the spawned workers (told to stop by `ModelExecutor.close`) up to
        `timeout_s` (not at all when the group failed: a hung worker would never stop), then
        kill what is left; leave the group. Their exit codes."""
        if self.comm.failed is not None:
            timeout_s = 0.0
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                log.warning("tensor-parallel worker did not stop; killing it", pid=p.pid)
                p.kill()
                p.join(5)
        if self.comm.failed is None:
            close_comm(self.comm)
        if self.store_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        return [p.exitcode for p in self.processes]


def start_group(
    config: ExecutorConfig,
    env: Mapping[str, str],
    *,
    log_level: str = "info",
    log_format: str = "json",
) -> TpGroup:
    """Rank 0: join torchrun's group, or spawn `tp_size - 1` workers and form one on a free
    loopback port. Returns once every rank has joined (at most `tp_timeout_s`)."""
    endpoint = torchrun_endpoint(config, env)
    processes: list[Any] = []
    store_dir = ""
    if endpoint is None:
        prepare_shared_weights(config)
        store_dir = tempfile.mkdtemp(prefix="model-executor-tp-")  # mode 0700
        endpoint = TpEndpoint(
            rank=0,
            size=config.tp_size,
            master_addr="127.0.0.1",
            master_port=0,
            timeout_s=config.tp_timeout_s,
            store_file=os.path.join(store_dir, "rendezvous"),
        )
        pinned = pin_to_loopback(os.environ)  # before the spawn: the workers inherit it
        ctx = mp.get_context("spawn")
        for rank in range(1, config.tp_size):
            p = ctx.Process(
                target=worker_main,
                args=(rank, config, endpoint, log_level, log_format),
                name=f"tp-worker-{rank}",
            )
            p.start()
            processes.append(p)
        log.info(
            "tensor-parallel workers started",
            tp_size=config.tp_size,
            pids=[p.pid for p in processes],
            store_file=endpoint.store_file,
            pinned=pinned,
        )
    elif endpoint.rank != 0:
        raise ValueError("start_group runs on rank 0; other ranks run run_worker_rank")
    group = TpGroup(TpComm(), processes, store_dir)
    try:
        device = resolve_device(config, endpoint.local_rank)
        set_nccl_error_handling(os.environ, device)
        group.comm = init_comm(endpoint, device)
    except BaseException:
        for p in processes:
            p.kill()
            p.join(5)
        if store_dir:
            shutil.rmtree(store_dir, ignore_errors=True)
        raise
    return group
