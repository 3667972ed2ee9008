"""The benchmarks' measuring logic on a few steps (their figures live in docs/performance.md)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import constrained_decode, quant_kernels, step_overhead
from executor.client.grpc_client import ExecutorClient
from executor.config import ExecutorConfig
from ops import qmm
from tests.server_util import running_server, tiny_config


def _measured(config: ExecutorConfig, device_ns: int | None = None) -> step_overhead.Result:
    """Three bs-1 steps of `step_overhead.measure` against an in-process executor on `config`
    and the bare server."""
    bare_server, bare_port = step_overhead.start_bare_server()
    try:
        with (
            running_server(config) as running,
            ExecutorClient(f"127.0.0.1:{running.port}") as executor,
            ExecutorClient(f"127.0.0.1:{bare_port}") as bare,
        ):
            return step_overhead.measure(
                executor, bare, bs=1, steps=3, warmup=1, device_ns=device_ns
            )
    finally:
        bare_server.stop(grace=None)


def test_step_overhead_splits_the_executor_overhead_and_times_a_bare_round_trip(
    cache_dir: Path,
) -> None:
    """Three bs-1 steps against an in-process executor and bare server: every step has a bare
    round trip, a model forward and an overhead whose parts add up to it."""
    result = _measured(tiny_config(cache_dir, graph_mode="none", max_reqs=4))

    assert result.bs == 1
    assert len(result.bare_us) == len(result.overhead_us) == len(result.model_us) == 3
    assert min(result.bare_us + result.model_us + result.client_codec_us) > 0
    assert {"queue", "validate", "stage", "sample", step_overhead.REST} <= result.phases_us.keys()
    for i, overhead in enumerate(result.overhead_us):
        parts = sum(values[i] for values in result.phases_us.values())
        assert parts == pytest.approx(overhead, abs=1e-3)
        assert result.phases_us[step_overhead.REST][i] > 0
    # The bare answer is the executor's size (a few bytes of timings' varints apart).
    assert abs(result.response_bytes - result.bare_response_bytes) <= 16
    assert result.request_bytes > 0
    assert math.isfinite(result.ratio) and result.ratio > 0
    table = step_overhead.table([result]).splitlines()
    assert table[0].startswith("| bs | bare round trip | executor overhead | ratio | target |")
    assert table[2].startswith("| 1 | ") and "| 2.0x |" in table[2]


@pytest.mark.slow
def test_step_overhead_under_the_stand_in_counts_its_device_time_as_the_model(
    cache_dir: Path,
) -> None:
    """`--simulated-step-ms D`: the model's time is the stand-in's D, the overhead the wall
    time minus D (the stand-in's few ops are the executor's host work)."""
    config = tiny_config(cache_dir, graph_mode="none", max_reqs=4, simulated_step_ms=1.0)
    result = _measured(config, device_ns=1_000_000)
    assert result.model_us == [1000.0] * 3
    assert "forward" in result.phases_us  # the stand-in's own ops: host work
    for i, overhead in enumerate(result.overhead_us):
        wall = sum(values[i] for values in result.phases_us.values())
        assert overhead == pytest.approx(wall - 1000.0, abs=1e-3)


def test_cold_host_times_an_admission_after_each_gap(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import cold_host

    monkeypatch.setattr(sys, "argv", ["cold_host.py", "--repeats", "2"])
    cold_host.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| before each admission")
    assert rows[1].startswith("| nothing (back to back) |") and rows[1].endswith("| 1.00x |")
    assert len(rows) == 1 + 7 and all(row.endswith("x |") for row in rows[1:])


def test_constrained_decode_pairs_runs_of_the_same_shapes(cache_dir: Path) -> None:
    """One constrained/unconstrained pair at bs 2: the unconstrained run steps the lengths the
    constrained one had, every step of the constrained run carried a mask, and the table has
    the row."""
    from executor.models.tokenizer import byte_tokenizer

    config = tiny_config(cache_dir, graph_mode="none", max_reqs=4)
    with running_server(config) as running, ExecutorClient(f"127.0.0.1:{running.port}") as client:
        info = client.info().info
        tok = byte_tokenizer(info.vocab_size, info.bos_token_id, info.eos_token_ids)
        result = constrained_decode.measure(
            client, tok, model="tiny-random", bs=2, repeats=1, max_new_tokens=6
        )
    con, unc = result.constrained[0], result.unconstrained[0]
    assert [len(o) for o in con.outputs] == [len(o) for o in unc.outputs]
    assert con.tokens > 0 and con.mask_ns > 0 and unc.mask_ns == 0
    assert all(s.stats.control_rows.get("vocab_mask") for s in con.steps if s.stats.batch_size)
    assert not any(s.stats.control_rows for s in unc.steps)
    assert math.isfinite(result.ratio) and result.ratio > 0
    row = constrained_decode.table([result]).splitlines()[2]
    assert row.startswith("| tiny-random | 2 | ")


def test_sampling_controls_benchmark_times_every_variant(cache_dir: Path) -> None:
    """Two measured steps per variant on tiny-random: each variant's step ran its controls
    (the `sample` phase is timed for all) and the table has one cell per variant."""
    from benchmarks import sampling_controls
    from executor.model_executor import ModelExecutor

    ex = ModelExecutor(tiny_config(cache_dir, graph_mode="none", max_reqs=12, kv_slots=4096))
    result = sampling_controls.measure(ex, bs=2, steps=2, context=16, warmup=1)
    assert set(result.sample_us) == set(sampling_controls.VARIANTS)
    assert all(len(v) == 2 and min(v) > 0 for v in result.total_us.values())
    line = sampling_controls.table([result]).splitlines()[2]
    assert line.startswith("| 2 | ") and line.count("/") == len(sampling_controls.VARIANTS)


def test_extra_outputs_benchmark_times_every_ask_and_builds_plain_steps(cache_dir: Path) -> None:
    from benchmarks import extra_outputs
    from executor.model_executor import ModelExecutor

    ex = ModelExecutor(
        tiny_config(cache_dir, graph_mode="none", max_reqs=2, kv_slots=64, max_tokens_per_batch=64)
    )
    result = extra_outputs.measure_asks(ex, bs=2, tokens=8, steps=1)
    assert set(result) == set(extra_outputs.VARIANTS)
    assert all(len(total) == 1 and total[0] > 0 for total, _ in result.values())
    batches = extra_outputs.plain_decode_steps(bs=2, context=4, steps=3)
    for fb in batches:  # a prefill, three decode steps and the release all run
        ex.forward(fb)
    assert ex.req_to_token_pool.rows_in_use() == 0


@pytest.mark.slow
def test_speculative_benchmark_pairs_plain_and_speculative_runs(cache_dir: Path) -> None:
    """One prompt whose continuation repeats (drafts accepted), through gRPC: both modes ran,
    gave the same tokens (tiny-random's float forward is exact across step shapes), and the
    row has every figure."""
    from benchmarks import speculative
    from executor.client.speculation import SpeculationPolicy

    config = tiny_config(cache_dir, graph_mode="none", max_reqs=4)
    with running_server(config) as running, ExecutorClient(f"127.0.0.1:{running.port}") as client:
        result = speculative.measure_set(
            client,
            "looping",
            [[7, 8, 9]],
            new_tokens=20,
            speculate=4,
            ngram=3,
            repeats=2,
            policy=SpeculationPolicy(min_accepted=0.0),
        )
    assert len(result.ratios) == len(result.plain_rates) == 2 and min(result.ratios) > 0
    assert result.parted == [None, None] and result.equal_tokens() == "2/2"
    assert result.accept_length > 1.0 and 0 < result.verify_share < 1  # VERIFY on matches only
    assert {"decode forward", "decode total", "verify forward", "verify total"} <= set(
        result.step_ms
    )
    row = result.row()
    assert row.startswith("| looping | 2/2 | ")
    assert row.count("|") == speculative.HEADER.count("|") // 2


@pytest.mark.slow
def test_step_overhead_measures_a_baseline_executor_in_the_same_rotation(
    cache_dir: Path,
) -> None:
    """`--baseline-tree`: a second executor takes every measured request too, and the A/B
    table compares the two overheads."""
    config = tiny_config(cache_dir, graph_mode="none", max_reqs=4)
    bare_server, bare_port = step_overhead.start_bare_server()
    try:
        with (
            running_server(config) as running,
            running_server(config) as other,
            ExecutorClient(f"127.0.0.1:{running.port}") as executor,
            ExecutorClient(f"127.0.0.1:{other.port}") as baseline,
            ExecutorClient(f"127.0.0.1:{bare_port}") as bare,
        ):
            result = step_overhead.measure(
                executor, bare, bs=1, steps=3, warmup=1, baseline=baseline
            )
    finally:
        bare_server.stop(grace=None)

    assert len(result.baseline_us) == len(result.overhead_us) == len(result.bare_us) == 3
    assert len(result.baseline_model_us) == 3
    assert min(result.baseline_us) > 0 and min(result.baseline_model_us) > 0
    rows = step_overhead.baseline_table([result]).splitlines()
    assert rows[0].startswith("| bs | bare round trip | baseline overhead |")
    assert rows[0].endswith("| baseline forward | forward | change |")
    assert rows[2].startswith("| 1 | ") and rows[2].count("%)") == 2


@pytest.mark.slow
def test_kv_transfer_measures_export_import_and_push(cache_dir: Path) -> None:
    """A 40-token request moved twice each way between two loopback executors: contiguous
    slots go as one run, pages of 8 as one run per page, and every figure is a rate."""
    from benchmarks import kv_transfer

    config = tiny_config(cache_dir, graph_mode="none", max_reqs=4, kv_slots=128)
    with (
        running_server(config, kv_transfer=True) as b,
        running_server(config, kv_transfer=True, kv_peers=f"127.0.0.1:{b.port}") as a,
        ExecutorClient(f"127.0.0.1:{a.port}") as ca,
        ExecutorClient(f"127.0.0.1:{b.port}") as cb,
    ):
        results = [
            kv_transfer.measure(ca, cb, f"127.0.0.1:{b.port}", tokens=40, repeats=2, page=page)
            for page in (0, 8)
        ]
        assert a.executor.req_to_token_pool.rows_in_use() == 0  # it released what it held
        assert b.executor.req_to_token_pool.rows_in_use() == 0
    layout = a.executor.kv_transfer.layout
    contiguous, paged = results
    assert contiguous.runs == 1 and paged.runs == 5
    assert contiguous.mbytes == pytest.approx(40 * layout.bytes_per_slot / 1e6)
    for r in results:
        assert len(r.export_mb_s) == len(r.import_mb_s) == len(r.push_mb_s) == 2
        assert min(r.export_mb_s + r.import_mb_s + r.push_mb_s) > 0
        assert r.chunks == 2 * layout.num_layers  # 40 slots fit one chunk per layer and kind
    assert paged.descriptors_per_mb > contiguous.descriptors_per_mb
    lines = kv_transfer.table(results).splitlines()
    assert lines[0].startswith("| slots | tokens | MB | runs | chunks | descriptors/MB |")
    assert lines[2].startswith("| contiguous | 40 |") and lines[3].startswith("| pages of 8 | 40 |")


@pytest.mark.slow  # the baseline spawns its receiver
def test_weight_update_times_every_transport_and_the_bare_baselines(
    cache_dir: Path, tmp_path: Path
) -> None:
    """Tiny-random's whole checkpoint once through each transport and the two baselines (a
    bare gloo broadcast, a bare grpcio stream); every figure is a time, and the executor ends
    on the last update's version."""
    from safetensors.torch import save_file

    from benchmarks import weight_update
    from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights

    tensors = tiny_random_weights(TINY_CONFIGS["tiny-random"], seed=3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = tiny_config(cache_dir, graph_mode="none", max_reqs=4, kv_slots=128)
    with (
        running_server(
            config, weight_update_root=str(tmp_path), weight_group_addresses="127.0.0.1"
        ) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as client,
    ):
        figures = weight_update.measure(client, tensors, "model.safetensors", repeats=1)
        assert client.info().info.weight_version == "group-1"
        lines = weight_update.memory(client, os.getpid())
    assert [f.transport for f in figures] == ["stream", "path", "group", "broadcast", "grpc"]
    for f in figures:
        assert len(f.seconds) == 1 and f.seconds[0] > 0 and f.nbytes == 558336
        assert f.row().startswith(f"| {f.transport} | 1 |")
    assert lines[2].startswith("| ReleaseMemory | weights, kv_cache |")
    # The bare stream's messages are at most a chunk, each tensor cut as UpdateWeights cuts it
    # (its server checks the bytes and the number of messages it received).
    assert len(weight_update.bare_grpc_stream(list(tensors.values()), 1, chunk_bytes=4096)) == 1


@pytest.mark.slow
def test_kernel_count_counts_a_decode_layer_with_torch_ops_and_fused() -> None:
    """One middle layer of a bs-1 DECODE step on the tiny model, the Triton kernels under
    the interpreter: the torch ops launch about three times what the fused path does, which
    is within the issue's 12 a layer; each fused op is one launch."""
    pytest.importorskip("triton")
    from benchmarks import kernel_count

    ex = kernel_count.build("tiny-random", "cpu", None)
    torch_ops = kernel_count.measure(ex, fused=False, row=1)
    fused = kernel_count.measure(ex, fused=True, row=2)
    assert fused.regions["rmsnorm"] == 2 and fused.regions["rotary"] == 1
    assert fused.regions["silu_mul"] == 1
    assert torch_ops.regions["rmsnorm"] >= 10 and torch_ops.regions["rotary"] >= 8
    # Linears, the KV store and attention are the same on both paths.
    assert fused.regions["other"] == torch_ops.regions["other"] >= 6
    assert fused.ops["aten::mm"] == 4 and fused.ops["triton::_decode_stage1_kernel"] == 1
    assert fused.total <= 12 < 30 <= torch_ops.total
    table = kernel_count.table([("torch ops", torch_ops), ("fused", fused)]).splitlines()
    assert table[0].startswith("| path | kernels per layer |")
    assert table[3].startswith(f"| fused | {fused.total} |")


@pytest.mark.slow
def test_vs_llamacpp_measures_a_served_configuration(tmp_path: Path) -> None:
    """A few DECODE steps of a served configuration: both batch sizes timed (median >= min),
    readiness timed, the setting choices read, and no background capture waited for."""
    from benchmarks import vs_llamacpp

    flags = [
        "--model", "tiny-random", "--max-reqs", "4", "--kv-slots", "64",
        "--max-context-len", "32", "--cache-dir", str(tmp_path), "--dtype", "float32",
        *vs_llamacpp.CONFIGS["eager"],
    ]  # fmt: skip
    m = vs_llamacpp.executor_decode(flags, [1, 2], prompt=4, steps=5, threads=1)
    assert set(m.steps) == {1, 2}
    assert all(med >= best > 0 for med, best in m.steps.values())
    assert m.ready_s > 0 and m.graphs_s is None and m.weight_bytes > 0
    assert any(c.startswith("graph_mode=none (configured)") for c in m.choices)


def test_speculative_benchmark_says_where_two_runs_parted() -> None:
    from benchmarks import speculative

    assert speculative._first_difference([1, 2, 3], [1, 2, 3]) is None
    assert speculative._first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert speculative._first_difference([1, 2], [1, 2, 3]) == 2  # one ended first
    result = speculative.SetResult("s", [1.0], [1.0], [1.0], [1.0], 1.0, 0.0, {}, [None, 17])
    assert result.equal_tokens() == "1/2 (parted at [17])"


def test_quant_kernels_times_qmm_int4_and_float32_for_each_shape_and_row_count(
    cache_dir: Path,
) -> None:
    try:
        qmm.load(cache_dir)
    except qmm.QmmUnavailable as e:
        pytest.skip(f"no qmm kernel on this machine: {e}")
    rows = quant_kernels.measure({"small": (32, 64), "wide": (48, 96)}, [1, 3], calls=2)
    assert [(name, r) for name, r, _ in rows] == [
        ("small", 1),
        ("small", 3),
        ("wide", 1),
        ("wide", 3),
    ]
    assert all(set(ms) == {"qmm", "int4", "float32"} for *_, ms in rows)
    assert all(0 < t < 1000 for *_, ms in rows for t in ms.values())


def test_every_benchmark_script_runs_from_a_checkout() -> None:
    """`python benchmarks/X.py` puts the script's folder first on sys.path, not the checkout:
    a script that imports `benchmarks.*` inserts the checkout's root before that import."""
    root = Path(__file__).resolve().parents[1]
    for script in sorted((root / "benchmarks").glob("*.py")):
        text = script.read_text()
        if "from benchmarks." not in text or '__name__ == "__main__"' not in text:
            continue
        first_import = text.index("from benchmarks.")
        assert "sys.path.insert(0" in text[:first_import], script.name


def test_overhead_phases_names_functions_that_exist() -> None:
    """Every phase the profile times resolves to a function of the tree (a rename breaks the
    profiled server's start-up otherwise)."""
    from benchmarks import overhead_phases

    targets = overhead_phases.phase_targets()
    assert len(targets) == sum(1 for p in overhead_phases.PHASES if p[1])
    assert all(callable(getattr(owner, name)) for _, owner, name in targets)


@pytest.mark.slow
def test_overhead_phases_serves_with_the_flags_it_is_given() -> None:
    """`--server-flag` reaches `serve` after the defaults: under the stand-in accelerator the
    model's phase is its few ops and the stand-in's wait is device-thread time outside it."""
    root = Path(__file__).resolve().parents[1]
    script = str(root / "benchmarks" / "overhead_phases.py")
    args = ["--batch-sizes", "1", "--steps", "3", "--warmup", "1"]
    result = subprocess.run(
        [sys.executable, script, *args, "--server-flag=--simulated-step-ms=20"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {
        line.split("|")[1].replace("&nbsp;", "").strip(): line.split("|")[2:4]
        for line in result.stdout.splitlines()
        if line.startswith("| ")
    }
    assert rows["(steps)"][0].strip() == "3"
    model_wall = float(rows["runner.forward (model)"][0])
    serve_wall = float(rows["device: _serve"][0])
    assert model_wall < 20_000 < serve_wall  # the 20 ms wait: the device thread, not the model


def test_metrics_overhead_measures_each_part_on_a_tiny_model() -> None:
    """A few steps and calls: every part of the row is a positive time (the RPC scope runs on
    a stand-in for gRPC's context with what Telemetry reads of it)."""
    import argparse

    from benchmarks import metrics_overhead

    row = metrics_overhead.measure("tiny-random", argparse.Namespace(steps=4, iters=20))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "tiny-random"
    assert all(float(c.rstrip("%")) > 0 for c in cells[1:]), row


def test_vs_llamacpp_says_why_llama_cpp_was_not_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An interpreter without llama-cpp-python, and one whose llama.cpp crashes (ggml's AMX
    kernels on some Sapphire Rapids): each skips llama.cpp with its own reason."""
    from benchmarks import vs_llamacpp

    crashes = tmp_path / "crashes"
    crashes.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crashes.chmod(0o755)
    missing = tmp_path / "missing"
    missing.write_text("#!/bin/sh\necho 'ModuleNotFoundError: llama_cpp' >&2; exit 1\n")
    missing.chmod(0o755)
    assert vs_llamacpp.llama_cpp_decode("m.gguf", 4, 4, 1, str(crashes)) is None
    assert "died of SIGSEGV" in capsys.readouterr().out
    assert vs_llamacpp.llama_cpp_decode("m.gguf", 4, 4, 1, str(missing)) is None
    assert "not installed" in capsys.readouterr().out


@pytest.mark.slow
def test_hardening_benchmark_measures_access_health_and_headers(
    cache_dir: Path, tmp_path: Path
) -> None:
    """A few calls of each: both servers answered, the health port answered while the main
    port was saturated, every hostile header was refused."""
    from benchmarks import hardening

    (tmp_path / "token").write_text("t")
    config = hardening.tiny(cache_dir)
    plain = hardening.serve(config)
    guarded = hardening.serve(
        config, call_token_file=str(tmp_path / "token"), rpc_threads=4, max_forward_calls=2,
        health_port=0,
    )  # fmt: skip
    try:
        with (
            ExecutorClient(f"127.0.0.1:{plain.port}") as open_client,
            ExecutorClient(f"127.0.0.1:{guarded.port}", token="t") as token_client,
        ):
            access = hardening.measure_access(open_client, token_client, 3)
        health = hardening.measure_health(guarded, 3)
    finally:
        plain.drain(1.0)
        guarded.drain(1.0)
    headers = hardening.measure_headers(tmp_path)
    assert len(access.open_us) == len(access.token_us) == 3 and min(access.token_us) > 0
    assert len(health) == 3 and max(health) < 1000
    assert len(headers) == 3 and all(ms < 1000 for ms, _, _ in headers.values())
    table = hardening.report(access, health, headers)
    assert "| added by the access check |" in table and table.count("| refuse ") == 3


def test_pipeline_runs_count_every_step_and_read_the_occupancy_gauge(cache_dir: Path) -> None:
    """A few steps of each workload of benchmarks/pipeline.py against a stand-in server
    (D = 1 ms): every answer counted with its host gap and admission time, the tokens the
    stand-in's rule, the occupancy from the answers in (0, 1], and the gauge read from the
    metrics port."""
    from benchmarks import pipeline
    from executor.models.standin import standin_token

    config = tiny_config(cache_dir, simulated_step_ms=1.0, max_reqs=64, kv_slots=32768)
    with running_server(config) as running, ExecutorClient(f"127.0.0.1:{running.port}") as client:
        vocab = client.info().info.vocab_size
        run = pipeline.overlap_run(client, bs=2, steps=5)
        assert run.steps == len(run.gaps_ns) == 6  # the prefill, 4 decodes, the release
        for r, tokens in enumerate(run.tokens):
            prompt = [(31 * r + j) % 400 + 5 for j in range(pipeline.PROMPT_LEN)]
            want = [standin_token(prompt[-1], pipeline.PROMPT_LEN - 1, vocab)]
            for k in range(4):
                want.append(standin_token(want[-1], pipeline.PROMPT_LEN + k, vocab))
            assert tokens == want
        assert 0 < run.occupancy(1.0) <= 1 and min(run.gaps_ns) >= 0
        assert len(run.validate_ns) == run.steps and min(run.validate_ns) > 0  # admission timed
        unary = pipeline.unary_run(f"127.0.0.1:{running.port}", clients=2, steps=6)
        assert unary.steps == 2 * 2 and [len(t) for t in unary.tokens] == [3, 3]
        assert running.metrics_port is not None
        assert 0 < pipeline.gauge(running.metrics_port) <= 1
