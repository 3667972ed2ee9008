"""A worker rank's loop: receive rank 0's commands and run them on this rank's shard."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from executor.core.errors import ToggleRefusedError
from executor.model_executor import ModelExecutor
from executor.parallel import broadcast

log = structlog.get_logger(__name__)


def run_worker(executor: ModelExecutor, after_toggles: Callable[[], object] = lambda: None) -> None:
    """Until rank 0 says stop. A failed collective raises `TpGroupError` (the group is gone:
    the process exits non-zero); a refused toggle was refused on rank 0 too. `after_toggles`
    runs after each toggle command (the process's heap freezes what a capture loaded)."""
    comm = executor.comm
    log.info("tensor-parallel worker serving", rank=comm.rank, tp_size=comm.size)
    while True:
        command = broadcast.receive(comm)
        if command.kind == broadcast.STEP:
            assert command.batch is not None
            executor.run_shard(command.batch, keep_rows=command.keep_rows)
        elif command.kind == broadcast.TOGGLES:
            try:
                executor.control.apply_toggles(**command.toggles)
            except ToggleRefusedError as e:
                log.info("toggle refused (as on rank 0)", reason=str(e))
            after_toggles()
        elif command.kind == broadcast.KV_READ:
            executor.kv_transfer.serve_read(command.kv)
        elif command.kind == broadcast.KV_WRITE:
            assert command.payload is not None
            executor.kv_transfer.serve_write(command.kv, command.payload)
        elif command.kind == broadcast.LORA:
            assert executor.lora is not None
            executor.lora.serve(command.lora)
        elif command.kind == broadcast.WEIGHTS:
            executor.weights.ranks.serve(command.weights, command.payload)
        elif command.kind == broadcast.PING:
            comm.ping()
        else:
            comm.ping()  # rank 0's last collective: then every rank may leave the group
            log.info("tensor-parallel worker stopping", rank=comm.rank)
            return
