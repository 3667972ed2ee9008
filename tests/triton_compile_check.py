"""Compile the Triton attention kernels for real GPU targets on a machine without a GPU.

Triton's interpreter (which the kernel tests use on CPU) is more lenient than its
compiler, so this lowers every kernel through the NVIDIA backend (TTIR -> TTGIR -> PTX ->
cubin with the ptxas that ships in the triton wheel) for sm_80 and sm_90, in float32 and
bfloat16, with and without the optional features (a window start, a sliding window, a logit
soft-cap), and checks that each fits the target's shared memory. Run by
tests/test_triton_kernels.py in a subprocess, because the interpreter flag set for that
session must be off here; the suite runs `--quick --arch N` (the largest geometry in float32,
which needs the most shared memory, with the features on, and SmolLM2's in bfloat16 without:
2 of the 6 combinations of a target; the gate compiles for sm_80, whose shared memory is the
smaller, and `make test-long` for sm_90 too), and `python tests/triton_compile_check.py` runs
every combination on both targets. Exit status: 0 all compiled, 1 a failure, 3 no NVIDIA
backend.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

# Usable shared memory per block (bytes) on each target.
TARGETS = {80: 166912, 90: 232448}
# (num_heads, num_kv_heads, head_dim, dtype): SmolLM2's geometry, and a large one in both dtypes.
CONFIGS = [(9, 3, 64, "bf16"), (32, 8, 128, "fp32"), (32, 8, 128, "bf16")]
QUICK = [((32, 8, 128, "fp32"), True), ((9, 3, 64, "bf16"), False)]


def main(quick: bool, archs: list[int]) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        print("the triton install has no NVIDIA backend (ptxas)")
        return 3

    from attention.triton import decode_attention as dec
    from attention.triton import extend_attention as ext
    from attention.triton import kv_indices as kvi
    from attention.triton import launch as L

    def compile_one(
        fn: Any, types: dict[str, str], consts: dict[str, int], target: Any, warps: int, stages: int
    ) -> Any:
        signature = {
            name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names
        }
        src = ASTSource(fn=fn, signature=signature, constexprs=consts)
        return triton.compile(
            src, target=target, options={"num_warps": warps, "num_stages": stages}
        )

    failures = 0
    for arch in archs:
        smem_limit = TARGETS[arch]
        target = GPUTarget("cuda", arch, 32)
        combos = QUICK if quick else list(itertools.product(CONFIGS, (False, True)))
        for (hq, hk, d, dt), on in combos:
            dl = L.decode_launch(4, hq, hk, d, L.DEFAULT_MAX_KV_SPLITS, 132)
            el = L.extend_launch(4, hq, d, 512)
            p = f"*{dt}"
            jobs = {
                "create_kv_indices": (
                    kvi._create_kv_indices_kernel,
                    {
                        "req_to_token_ptr": "*i32",
                        "req_pool_indices_ptr": "*i64",
                        "kv_lens_ptr": "*i64",
                        "kv_indptr_ptr": "*i32",
                        "kv_indices_ptr": "*i64",
                        "kv_start_ptr": "*i64",
                    },
                    {"BLOCK": L.KV_INDICES_BLOCK, "HAS_START": on},
                    L.NUM_WARPS,
                    1,
                ),
                "decode_stage1": (
                    dec._decode_stage1_kernel,
                    {
                        "q_ptr": p,
                        "k_buffer_ptr": p,
                        "v_buffer_ptr": p,
                        "kv_indptr_ptr": "*i32",
                        "kv_indices_ptr": "*i64",
                        "num_kv_splits_ptr": "*i32",
                        "att_out_ptr": "*fp32",
                        "att_lse_ptr": "*fp32",
                        "sm_scale": "fp32",
                        "logit_cap": "fp32",
                    },
                    {
                        "KV_GROUP": hq // hk,
                        "HEAD_DIM": d,
                        "BLOCK_H": dl.block_h,
                        "BLOCK_D": dl.block_d,
                        "BLOCK_N": dl.block_n,
                        "MIN_BLOCK_KV": L.MIN_BLOCK_KV,
                        "HAS_SOFTCAP": on,
                    },
                    dl.num_warps,
                    dl.num_stages,
                ),
                "decode_stage2": (
                    dec._decode_stage2_kernel,
                    {
                        "att_out_ptr": "*fp32",
                        "att_lse_ptr": "*fp32",
                        "o_ptr": p,
                        "kv_indptr_ptr": "*i32",
                        "num_kv_splits_ptr": "*i32",
                    },
                    {"HEAD_DIM": d, "BLOCK_D": dl.block_d, "MIN_BLOCK_KV": L.MIN_BLOCK_KV},
                    L.NUM_WARPS,
                    1,
                ),
                "extend": (
                    ext._extend_kernel,
                    {
                        "q_ptr": p,
                        "k_ptr": p,
                        "v_ptr": p,
                        "o_ptr": p,
                        "k_buffer_ptr": p,
                        "v_buffer_ptr": p,
                        "qo_indptr_ptr": "*i32",
                        "kv_indptr_ptr": "*i32",
                        "kv_indices_ptr": "*i64",
                        "sm_scale": "fp32",
                        "logit_cap": "fp32",
                        "window": "i32",
                    },
                    {
                        "KV_GROUP": hq // hk,
                        "HEAD_DIM": d,
                        "BLOCK_M": el.block_m,
                        "BLOCK_N": el.block_n,
                        "BLOCK_D": el.block_d,
                        "HAS_SOFTCAP": on,
                        "HAS_WINDOW": on,
                        "ALL_CACHED": on,  # batch_invariant's one loop over every key
                    },
                    el.num_warps,
                    el.num_stages,
                ),
            }
            for name, (fn, types, consts, warps, stages) in jobs.items():
                where = f"sm_{arch} {dt} Hq={hq} Hk={hk} D={d} {name}{' (features on)' * on}"
                try:
                    shared = compile_one(fn, types, consts, target, warps, stages).metadata.shared
                except Exception as exc:  # report every kernel, then fail
                    failures += 1
                    print(f"{where}: compile failed: {type(exc).__name__}: {exc}")
                    continue
                status = "ok" if shared <= smem_limit else f"needs more than {smem_limit}"
                failures += shared > smem_limit
                print(f"{where}: shared memory {shared} bytes, {status}")
    return 1 if failures else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = [int(args[i + 1]) for i, a in enumerate(args) if a == "--arch"] or list(TARGETS)
    sys.exit(main(quick="--quick" in args, archs=chosen))
