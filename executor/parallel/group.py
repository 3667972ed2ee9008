"""Join a tensor-parallel group: `TpEndpoint` (who and where), `init_comm`, `close_comm`.

`serve` spawns its workers with an endpoint whose rendezvous is a FileStore in a private
directory (`store_file`): no listening socket, so nothing off the pod can join the group or
write its store (a TCPStore listens on every interface whatever its host). Under `torchrun`
the endpoint is the TCP one its environment describes (`endpoint_from_env`, called by the
host: the engine reads no environment itself). gloo on CPU; on CUDA NCCL for the model's collectives
plus a gloo group for the host-side broadcast of batches.
"""

from __future__ import annotations

import gc
import socket
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from executor.parallel.comm import TpComm

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class TpEndpoint:
    rank: int
    size: int
    master_addr: str
    master_port: int
    timeout_s: float
    local_rank: int = 0  # the CUDA device index of this rank on its node
    store_file: str = ""  # a FileStore path: the rendezvous without a socket (one host)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of size {self.size}")
        if not self.store_file and not 0 < self.master_port < 65536:
            raise ValueError(f"master port must be in 1..65535, got {self.master_port}")


def endpoint_from_env(env: Mapping[str, str], tp_size: int, timeout_s: float) -> TpEndpoint | None:
    """The endpoint torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    LOCAL_RANK), or None when not launched by torchrun; ValueError when WORLD_SIZE is not
    `tp_size` or a variable is missing."""
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError(f"torchrun environment is incomplete: {', '.join(missing)} unset")
    world = int(env["WORLD_SIZE"])
    if world != tp_size:
        raise ValueError(f"WORLD_SIZE={world} but tp_size={tp_size}: they must be equal")
    return TpEndpoint(
        rank=int(env["RANK"]),
        size=world,
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
        timeout_s=timeout_s,
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (the group's rendezvous port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_comm(endpoint: TpEndpoint, device: torch.device) -> TpComm:
    """Join the group (blocks until every rank arrives, at most the timeout)."""
    # `torch.distributed.nn.functional` binds `group.WORLD` as the default argument of its
    # collectives when it is imported; torch._dynamo imports it. Imported after the group
    # exists (the model's first compile-related import), it holds the default group for
    # good: `destroy_process_group` then frees nothing, gloo's worker and TCP-loop threads
    # (and rank 0's TCPStore server thread) live on into the interpreter's teardown, and a
    # rank aborted there, now and then ("terminate called without an active exception",
    # exit -6). Imported first, the defaults hold None.
    import torch.distributed.nn.functional

    timeout = timedelta(seconds=endpoint.timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_method = (
        f"file://{endpoint.store_file}"
        if endpoint.store_file
        else f"tcp://{endpoint.master_addr}:{endpoint.master_port}"
    )
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=endpoint.rank,
        world_size=endpoint.size,
        timeout=timeout,
    )
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return TpComm(
        rank=endpoint.rank,
        size=endpoint.size,
        backend=backend,
        cpu_group=cpu_group,
        wait_timeout_s=endpoint.timeout_s,
    )


def close_comm(comm: TpComm) -> bool:
    """Leave the group (a no-op for size 1 or when it was never joined). True if the group
    is gone with its threads (gloo's, the TCPStore's), joined here; False (logged) when
    something still holds it, so that its threads would meet the interpreter's teardown."""
    if not (comm.enabled and dist.is_initialized()):
        return True
    group = weakref.ref(dist.distributed_c10d._get_default_group())
    dist.destroy_process_group()
    if group() is not None:
        gc.collect()  # a reference cycle through the group
    if group() is None:
        return True
    log.warning(
        "the process group outlived destroy_process_group: its threads stop at exit",
        referrers=len(gc.get_referrers(group())),
    )
    return False
