"""Which attention backend runs, and whether the executor keeps the host `seq_lens` mirror."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from attention.base import AttentionBackend, AttentionLayout
from attention.torch_native import TorchNativeBackend
from attention.torch_paged import TorchPagedBackend
from attention.triton.backend import TritonAttnBackend

if TYPE_CHECKING:
    from executor.kv_cache import KVPool, ReqToTokenPool

BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchNativeBackend.name: TorchNativeBackend,
    TorchPagedBackend.name: TorchPagedBackend,
    TritonAttnBackend.name: TritonAttnBackend,
}
# Every value `attention_backend` accepts (the config validates against it).
BACKEND_NAMES: tuple[str, ...] = ("auto", *BACKENDS)


def backend_class(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend class for `name`; `auto` is triton on CUDA and torch_paged elsewhere."""
    if name == "auto":
        name = TritonAttnBackend.name if device.type == "cuda" else TorchPagedBackend.name
    if name not in BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is unknown (choose from {', '.join(BACKEND_NAMES)})"
        )
    cls = BACKENDS[name]
    if cls is TritonAttnBackend:
        TritonAttnBackend.check_available(device)
    return cls


def create_backend(
    name: str,
    *,
    layout: AttentionLayout,
    req_to_token_pool: ReqToTokenPool,
    kv_pool: KVPool,
    device: torch.device,
) -> AttentionBackend:
    return backend_class(name, device)(layout, req_to_token_pool, kv_pool)


def decide_needs_cpu_seq_lens(
    policy: str,
    backends: Iterable[AttentionBackend | None],
    *,
    piecewise_mode: str | None = None,
) -> bool:
    """Whether batches must carry `seq_lens_cpu` / `seq_lens_sum` under `policy` (auto | on |
    off); `piecewise_mode` is the graph mode when it enables the piecewise path, else None.

    `auto`: True if any backend in use reads them (a backend that does not say defaults to
    True), or if the piecewise path is enabled (it plans attention on real shapes from host
    values); otherwise False. `on` forces True. `off` forces False and is refused (ValueError,
    at start-up) where something in use needs the mirror.
    """
    readers = [b.name for b in backends if b is not None and getattr(b, "needs_cpu_seq_lens", True)]
    piecewise = piecewise_mode is not None
    if policy == "on":
        return True
    if policy == "off":
        if readers:
            raise ValueError(
                "needs_cpu_seq_lens=off, but attention backend "
                f"{', '.join(repr(r) for r in readers)} reads seq_lens_cpu; use "
                "needs_cpu_seq_lens=auto, or an attention backend that does not need it "
                f"({', '.join(n for n, cls in BACKENDS.items() if not cls.needs_cpu_seq_lens)})"
            )
        if piecewise:
            raise ValueError(
                f"needs_cpu_seq_lens=off, but graph_mode={piecewise_mode!r} enables the "
                "piecewise path, which plans attention from host sequence lengths; use "
                "needs_cpu_seq_lens=auto, or graph_mode=none|decode"
            )
        return False
    return bool(readers) or piecewise
