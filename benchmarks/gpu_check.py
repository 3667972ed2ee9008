"""`make gpu-check`: on a CUDA machine, run what only a GPU proves and write one report.

    python benchmarks/gpu_check.py --report gpu-check.md

Steps, each with its wall time and pass/fail in the report:
1. the `gpu`-marked tests (`pytest -m gpu`): Triton kernels against the reference, real CUDA
   graphs against eager, tensor parallelism over NCCL, the device scope;
2. the fused Triton kernels (RMSNorm, rotary, SiLU-mul) against the torch ops and the step
   clock's CUDA events, on the GPU (`tests/test_triton_fused.py`, `tests/test_step_clock.py`);
3. the kernels launched per decode layer, torch ops vs fused (`benchmarks/kernel_count.py`);
4. the per-path step latency on SmolLM2 (`benchmarks/paths.py --device cuda`);
5. the attention backends on CUDA (`benchmarks/attention_backends.py --device cuda`).
Without a CUDA device it writes a report saying so and exits 2 (nothing is pretended).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class StepResult:
    name: str
    command: list[str]
    returncode: int
    seconds: float
    tail: str


def run_step(name: str, command: list[str], timeout_s: float) -> StepResult:
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = 124, f"timed out after {timeout_s:.0f} s\n{exc.stdout or ''}"
    lines = out.strip().splitlines()
    return StepResult(name, command, code, time.perf_counter() - start, "\n".join(lines[-40:]))


def report(results: list[StepResult], device: str) -> str:
    lines = [
        "# gpu-check report",
        "",
        f"- Device: {device}",
        f"- Host: {platform.node()}, Python {platform.python_version()}",
        "",
        "| step | result | seconds |",
        "|---|---|---:|",
    ]
    for r in results:
        verdict = "pass" if r.returncode == 0 else f"FAIL ({r.returncode})"
        lines.append(f"| {r.name} | {verdict} | {r.seconds:.0f} |")
    for r in results:
        lines += ["", f"## {r.name}", "", f"`{' '.join(r.command)}`", "", "```", r.tail, "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=ROOT / "gpu-check.md")
    parser.add_argument("--timeout-s", type=float, default=540, help="per step")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        args.report.write_text(
            "# gpu-check report\n\nNo CUDA device on this machine (torch "
            f"{torch.__version__}): nothing ran.\n"
        )
        print(f"no CUDA device: wrote {args.report}", file=sys.stderr)
        return 2
    device = (
        f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}"
    )
    py = sys.executable
    steps = [
        ("gpu tests", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]),
        (
            "fused kernels and step clock on CUDA",
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/test_triton_fused.py",
                "tests/test_step_clock.py",
            ],
        ),
        ("kernels per decode layer", [py, "benchmarks/kernel_count.py", "--device", "cuda"]),
        (
            "paths on SmolLM2",
            [py, "benchmarks/paths.py", "--device", "cuda", "--plot", "gpu-paths.png"],
        ),
        ("attention backends", [py, "benchmarks/attention_backends.py", "--device", "cuda"]),
    ]
    results = [run_step(name, cmd, args.timeout_s) for name, cmd in steps]
    args.report.write_text(report(results, device))
    print(args.report.read_text())
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
