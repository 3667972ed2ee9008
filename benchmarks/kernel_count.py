"""Kernels launched per decoder layer of a DECODE step, from the profiler: torch ops vs fused.

    python benchmarks/kernel_count.py                 # CPU: the eager op sequence
    python benchmarks/kernel_count.py --device cuda   # CUDA: kernels the GPU ran

One DECODE step (after a prefill) is profiled with the layer's three parts (pre-attention
half, attention, post-attention half) of one middle layer in `record_function` scopes, and
each small op (RMSNorm with its residual add, rotary, SiLU-mul) in a region scope, twice:
with the small ops as torch references ("torch ops") and as the Triton kernels of
`ops/triton_fused.py` ("fused"). Attention is the Triton backend in both.

On CPU the count is the eager op sequence: every leaf operator of the scope (one with no
operator below it) that is not a view or metadata op (`NON_KERNEL`) counts one, and every
Triton launch (run by Triton's interpreter: numpy on CPU tensors) counts one, whatever the
interpreter does inside it; that is what each launches on CUDA, up to a library kernel that
launches two (cuBLAS split-K). On CUDA the count is the kernels the profiler saw launched
from the scope.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proto"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYER = "kc:layer"  # the scopes of the counted layer
REGION = "kc:region:"  # + rmsnorm | rotary | silu_mul
TRITON = "triton::"  # + kernel name (CPU: each interpreted launch)
# Leaf operators that launch no kernel: views, metadata, allocation.
NON_KERNEL = frozenset(
    {
        "aten::view",
        "aten::reshape",
        "aten::_reshape_alias",
        "aten::_unsafe_view",
        "aten::split",
        "aten::split_with_sizes",
        "aten::chunk",
        "aten::narrow",
        "aten::slice",
        "aten::select",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::t",
        "aten::transpose",
        "aten::permute",
        "aten::expand",
        "aten::as_strided",
        "aten::alias",
        "aten::detach",
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::resolve_conj",
        "aten::resolve_neg",
        "aten::result_type",
        "aten::to",  # a leaf only when nothing is converted
        "aten::_to_copy",
        "aten::contiguous",
        "aten::lift_fresh",
        "aten::is_nonzero",
        "aten::size",
        "aten::stride",
        "aten::dim",
        "aten::promote_types",
    }
)


@dataclass
class LayerCount:
    """The kernels of one decode layer, in total and per region."""

    total: int = 0
    regions: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)  # what was counted, by name


def _scoped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch.profiler import record_function

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def instrumented(ex: Any, layer_index: int, *, fused: bool) -> Iterator[None]:
    """Scopes around one layer's parts and each small op; `fused` routes the small ops to
    the Triton kernels on every device (the CPU runs them under Triton's interpreter)."""
    import executor.models.layers as layers_mod
    import ops.activation
    import ops.rmsnorm
    import ops.rotary

    patches: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, attr: str, value: Any) -> None:
        patches.append((obj, attr, obj.__dict__.get(attr, _MISSING)))
        setattr(obj, attr, value)

    layer = ex.model.decoder_layers[layer_index]
    patch(layer, "pre_attention", _scoped(LAYER, layer.pre_attention))
    patch(layer, "post_attention", _scoped(LAYER, layer.post_attention))
    attn = ex.attn_backend
    attn_forward = attn.forward

    def forward(q: Any, k: Any, v: Any, layer_id: int, fb: Any, *a: Any, **kw: Any) -> Any:
        if layer_id != layer.layer_id:
            return attn_forward(q, k, v, layer_id, fb, *a, **kw)
        return _scoped(LAYER, attn_forward)(q, k, v, layer_id, fb, *a, **kw)

    patch(attn, "forward", forward)
    patch(layers_mod, "add_rms_norm", _scoped(REGION + "rmsnorm", ops.rmsnorm.add_rms_norm))
    rope_cls = ops.rotary.RotaryEmbedding
    patch(rope_cls, "forward", _scoped(REGION + "rotary", rope_cls.forward))
    for mlp in (getattr(lay, "mlp", None) for lay in ex.model.decoder_layers):
        if mlp is not None and hasattr(mlp, "act_and_mul"):
            patch(mlp, "act_and_mul", _scoped(REGION + "silu_mul", mlp.act_and_mul))
    use = (lambda t: True) if fused else (lambda t: False)
    for mod in (ops.rmsnorm, ops.rotary, ops.activation):
        patch(mod, "use_triton", use)
    if ex.device.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def run_scoped(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _scoped(TRITON + self.fn.__name__, run)(self, *args, **kwargs)

        patch(InterpretedFunction, "run", run_scoped)
    try:
        yield
    finally:
        for obj, attr, old in reversed(patches):
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


_MISSING = object()


def count_layer(events: list[Any], *, on_cuda: bool) -> LayerCount:
    """Sum the kernels under every `LAYER` scope of a profile (one step: three scopes)."""
    out = LayerCount()

    def walk(e: Any, region: str) -> int:
        """Count `e`'s kernels: a Triton launch is one; an operator with kernels below it
        is those; a kernel operator with none below it (only views) is one."""
        name = e.name
        if name.startswith(REGION):
            region = name.removeprefix(REGION)
        if on_cuda:
            n = len(getattr(e, "kernels", []))
            _add(out, region, name, n)
            return n + sum(walk(child, region) for child in e.cpu_children)
        if name.startswith(TRITON):  # whatever the interpreter runs inside it
            _add(out, region, name, 1)
            return 1
        below = sum(walk(child, region) for child in e.cpu_children)
        if below == 0 and _is_kernel(name):
            _add(out, region, name, 1)
            return 1
        return below

    for e in events:
        if e.name == LAYER and (e.cpu_parent is None or not _inside(e.cpu_parent, LAYER)):
            walk(e, "other")
    return out


def _add(out: LayerCount, region: str, name: str, n: int) -> None:
    if n:
        out.total += n
        out.regions[region] += n
        out.ops[name] += n


def _inside(e: Any, name: str) -> bool:
    while e is not None:
        if e.name == name:
            return True
        e = e.cpu_parent
    return False


def _is_kernel(name: str) -> bool:
    return "::" in name and name not in NON_KERNEL and not name.startswith("kc:")


def build(model: str, device: str, cache_dir: str | None) -> Any:
    from executor.config import ExecutorConfig
    from executor.model_executor import ModelExecutor

    config = ExecutorConfig(
        model=model,
        device=device,
        dtype="float32" if device == "cpu" else "bfloat16",
        attention_backend="triton" if device == "cuda" else "torch_native",
        graph_mode="none",
        linear_kernel="aten" if device == "cpu" else "auto",
        max_reqs=4,
        kv_slots=512,
        max_context_len=256,
        **({"cache_dir": cache_dir} if cache_dir else {}),
    )
    ex = ModelExecutor(config)
    if device == "cpu":  # the CUDA backend, its kernels under Triton's interpreter
        from attention import TritonAttnBackend

        backend = TritonAttnBackend(ex.attn_backend.layout, ex.req_to_token_pool, ex.kv_pool)
        ex.attn_backend = ex.runner.attn_backend = backend
    return ex


def measure(ex: Any, *, fused: bool, row: int = 1, layer_index: int | None = None) -> LayerCount:
    """Profile one bs-1 DECODE step of `ex` (request row `row`, after a prefill and a warm-up
    step) and count one middle layer's kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from executor.batch_prep import make_decode_batch, make_extend_batch

    n_layers = len(ex.model.decoder_layers)
    index = n_layers // 2 if layer_index is None else layer_index
    base = 1 + 16 * (row - 1)  # this row's KV slots
    slots = list(range(base, base + 10))
    on_cuda = ex.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with instrumented(ex, index, fused=fused):
        ex.forward(
            make_extend_batch(
                input_ids=[list(range(3, 11))], req_pool_indices=[row], out_cache_loc=[slots[:8]]
            )
        )

        def step(n: int) -> None:
            ex.forward(
                make_decode_batch(
                    input_ids=[5],
                    req_pool_indices=[row],
                    seq_lens=[n + 1],
                    out_cache_loc=[slots[n]],
                )
            )

        step(8)  # warm: the kernels compiled (CUDA) or decorated (interpreter)
        with profile(activities=activities) as prof:
            step(9)
            if on_cuda:
                torch.cuda.synchronize()
    return count_layer(list(prof.events()), on_cuda=on_cuda)


def table(rows: list[tuple[str, LayerCount]]) -> str:
    regions = sorted({r for _, c in rows for r in c.regions})
    lines = [
        "| path | kernels per layer | " + " | ".join(regions) + " |",
        "|---|---:|" + "---:|" * len(regions),
    ]
    for name, c in rows:
        cells = " | ".join(str(c.regions.get(r, 0)) for r in regions)
        lines.append(f"| {name} | {c.total} | {cells} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--ops", action="store_true", help="list the counted ops")
    args = parser.parse_args()
    if args.device == "cpu":
        # The Triton kernels run under the interpreter on CPU; it is read when they are
        # decorated, so before the executor is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    ex = build(args.model, args.device, args.cache_dir)
    rows = [
        ("torch ops", measure(ex, fused=False, row=1)),
        ("fused (Triton)", measure(ex, fused=True, row=2)),
    ]
    print(f"model {args.model}, device {args.device}, one bs-1 DECODE step, a middle layer")
    print(table(rows))
    if args.ops:
        for name, c in rows:
            print(f"\n{name}:")
            for op, n in sorted(c.ops.items()):
                print(f"  {n:3d}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
