"""The GPU check (benchmarks/device_check.sh): its whole plumbing on the CPU (`--dry-run`), the
deadline, the bfloat16 near-tie rule, and the wheel list `make device-wheels` downloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import device_paths
from benchmarks.device_paths import Reference, Run, bf16_ulp, compare, expected_path
from tools.device_wheels import DEVICE_WHEELS, pinned_versions

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
STAGES = [
    "preflight",
    "gpu_tests",
    "paths",
    "attention",
    "latency",
    "occupancy",
    "kernels",
    "graph_memory",
    "nccl",
    "memory_release",
    "host_phases",
]


def _rows(summary: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in summary.splitlines()
        if line.startswith("| ") and not line.startswith("| stage ")
    ]


def _run(env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        # Not the checkout's .whl/ (`make device-wheels`: the GPU machine's Python's wheels).
        env={**os.environ, "PYTHON": sys.executable, "DEVICE_CHECK_WHEELS": "/nonexistent", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_passes_its_dry_run(stage: str, tmp_path: Path) -> None:
    """Each stage's code on the CPU, in this process (the script gives each its own, which
    costs a torch import a stage: the whole dry run is `bash benchmarks/device_check.sh
    --dry-run`, a run of its own)."""
    import torch

    from benchmarks import device_check
    from benchmarks.device_common import Context, register_models

    register_models()
    out = tmp_path / "out"
    out.mkdir()
    ctx = Context(torch.device("cpu"), True, tmp_path / "cache")
    result = device_check.stages(out)[stage](ctx)
    assert result.status == "PASS" and result.figures, "\n".join(result.lines)
    # At most 8 files come back from a device call's $OUT: the driver writes 3, the stages
    # only the tests' JUnit XML.
    written = {p.name for p in out.iterdir()}
    assert written == ({"pytest-gpu.xml"} if stage == "gpu_tests" else set()), written


@pytest.mark.slow
def test_the_script_runs_each_stage_in_its_process_and_prints_the_table_last(
    tmp_path: Path,
) -> None:
    """The driver's plumbing, on the cheapest stage (preflight always runs first)."""
    done = _run({"OUT": str(tmp_path)}, "--dry-run", "--stages", "nccl", timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = (tmp_path / "summary.md").read_text()
    rows = _rows(summary)
    assert [r[0] for r in rows] == ["preflight", "nccl"]
    assert all(r[1] == "PASS" and r[3] for r in rows), summary
    assert done.stdout.rstrip().endswith(summary.rstrip().splitlines()[-1])
    details = [json.loads(line) for line in (tmp_path / "details.jsonl").read_text().splitlines()]
    assert [d["stage"] for d in details] == ["preflight", "nccl"]
    assert "=== nccl" in (tmp_path / "check.log").read_text()
    assert {p.name for p in tmp_path.iterdir()} == {"summary.md", "check.log", "details.jsonl"}


def test_a_stage_past_the_deadline_is_skipped_and_out_defaults_to_a_temp_folder() -> None:
    env = {"DEVICE_CHECK_DEADLINE_S": "0"}
    done = _run({**env, "OUT": ""}, "--dry-run", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    [out] = [line.split()[-1] for line in done.stdout.splitlines() if line.startswith("results in")]
    assert Path(out).parent == Path(os.environ.get("TMPDIR", "/tmp"))
    rows = _rows(Path(out, "summary.md").read_text())
    assert [r[0] for r in rows] == STAGES
    assert all(r[1] == "SKIP" and r[3].startswith("deadline") for r in rows)


def test_paths_expect_the_graph_path_their_settings_name() -> None:
    assert expected_path("both", "decode") == "full_graph"
    assert expected_path("overlap", "extend") == "piecewise"
    assert expected_path("full_graph", "extend") == "eager"
    assert expected_path("piecewise", "decode") == "eager"
    assert expected_path("eager_no_copy", "decode") == "eager_no_copy"


def test_bfloat16_may_diverge_only_at_a_near_tie_and_float32_never() -> None:
    prompts = [[5, 6, 7], [8, 9]]
    # Request 0 (row 3) is identical; request 1 (row 4) differs at its token 1, sampled by
    # the step that reached seq_len 3 (its 2-token prompt plus token 0).
    ref = Reference(Run([[1, 2, 3], [4, 5, 6]]), {}, {0: 3, 1: 4})
    run = Run([[1, 2, 3], [4, 9, 9]])
    assert bf16_ulp(20.0) == 0.125
    ref.top2[(4, 3)] = (20.0, 19.9)  # within 2 ulps (0.25): a near-tie
    assert compare(ref, run, prompts, "bfloat16") == (1, "")
    same, why = compare(ref, run, prompts, "float32")
    assert same == 1 and why.startswith("float32 tokens differ at request 1 token 1")
    ref.top2[(4, 3)] = (20.0, 19.0)  # 1.0 apart: a real divergence
    same, why = compare(ref, run, prompts, "bfloat16")
    assert same == 1 and why.startswith("not a near-tie at request 1 token 1")
    assert device_paths.NEAR_TIE_ULPS == 2.0


def test_every_device_wheel_has_a_pinned_version() -> None:
    pins = pinned_versions()
    assert set(DEVICE_WHEELS) <= set(pins)
    assert pins["grpcio"] == pins["grpcio-health-checking"]  # the stubs move with grpcio


@pytest.mark.slow
def test_without_a_gpu_the_check_fails_fast_and_says_so(tmp_path: Path) -> None:
    """Nothing is pretended: off a CUDA machine (and without --dry-run) preflight fails and
    no other stage runs."""
    done = _run({"OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert done.returncode == 1
    [row] = _rows((tmp_path / "summary.md").read_text())
    assert row[:2] == ["preflight", "FAIL"] and "no CUDA device" in row[3]
