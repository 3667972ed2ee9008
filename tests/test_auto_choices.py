"""What `auto` settings become on this machine and why: quantization (a GGUF kept quantized
where the qmm kernel loads), the background graph capture a CPU server starts while it
serves, and how GetInfo reports every choice."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.core.limits import BatchLimits
from executor.graphs.settings import background_graph_mode, graph_settings
from executor.model_executor import ModelExecutor
from executor.models import quant_kernel
from executor.models.quant_kernel import choose_quant_kernel, choose_quantization
from executor.service.info_codec import info_from_proto, info_to_proto
from ops import qmm

MakeExecutor = Callable[..., ModelExecutor]
CPU = torch.device("cpu")
ModelExecutorLimits = BatchLimits(
    max_reqs=8, kv_slots=64, max_context_len=64, vocab_size=32, hidden_size=8, max_batch_size=8,
    max_tokens_per_batch=64,
)  # fmt: skip


def test_auto_quantization_keeps_a_gguf_quantized_where_the_kernel_loads(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        qmm.load(cache_dir)
    except qmm.QmmUnavailable as e:
        pytest.skip(f"no qmm kernel on this machine: {e}")
    mode, why = choose_quantization("auto", "gguf", CPU, cache_dir)
    assert mode == "gguf" and why.startswith("auto:") and "qmm" in why
    assert choose_quantization("int8", "gguf", CPU, cache_dir) == ("int8", "configured")
    for kind in ("hf", "tiny-random"):
        assert choose_quantization("auto", kind, CPU, cache_dir)[0] == "none"
    assert choose_quantization("auto", "gguf", CPU, cache_dir, tp_size=2)[0] == "none"
    assert choose_quantization("auto", "gguf", torch.device("cuda", 0), cache_dir)[0] == "none"
    mode, why = choose_quantization("auto", "gguf", CPU, cache_dir, quant_kernel="torch")
    assert mode == "none" and "quant_kernel=torch" in why

    def unavailable(_: Path) -> qmm.QmmKernel:
        raise qmm.QmmUnavailable("no C compiler (cc or gcc) on PATH")

    monkeypatch.setattr(quant_kernel.qmm, "load", unavailable)
    mode, why = choose_quantization("auto", "gguf", CPU, cache_dir)
    assert mode == "none" and "no C compiler" in why


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_activations_on_native_bfloat16_take_torchs_int4_kernel(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """On a CPU with native bfloat16, bfloat16 activations run a GGUF's blocks on torch's int4
    kernel (as fast as qmm there, closer to float32); float32 activations, or a CPU without
    it, keep the qmm rule (and stay float without qmm)."""
    monkeypatch.setattr(quant_kernel, "cpu_has_native_bf16", lambda: native)
    bf16, f32 = torch.bfloat16, torch.float32
    kernel = choose_quant_kernel("auto", CPU, cache_dir, bf16)
    mode, why = choose_quantization("auto", "gguf", CPU, cache_dir, dtype=bf16)
    if native:
        assert kernel.kernel == "torch" and "native bfloat16" in kernel.reason
        assert mode == "gguf" and "torch's int4 kernel" in why
        configured = choose_quantization(
            "auto", "gguf", CPU, cache_dir, quant_kernel="torch", dtype=bf16
        )
        assert configured[0] == "gguf"
        assert choose_quant_kernel("qmm", CPU, cache_dir, bf16).reason == "configured"
    else:
        assert "native bfloat16" not in kernel.reason and "native bfloat16" not in why
    # float32 activations: the qmm rule, natively bfloat16 or not
    assert "native bfloat16" not in choose_quant_kernel("auto", CPU, cache_dir, f32).reason
    assert (
        choose_quantization("auto", "gguf", CPU, cache_dir, quant_kernel="torch", dtype=f32)[0]
        == "none"
    )


def test_getinfo_reports_every_choice_with_its_reason(make_executor: MakeExecutor) -> None:
    ex = make_executor(quantization="auto", linear_kernel="auto")
    choices = {c.setting: c for c in ex.info.choices}
    assert set(choices) == {
        "device",
        "dtype",
        "quantization",
        "quant_kernel",
        "linear_kernel",
        "lm_head_dtype",
        "pipeline_steps",
        "batch_invariant",
        "eager_input_no_copy",
        "graph_mode",
        "graph_backend",
    }
    assert choices["eager_input_no_copy"].value == "false"
    assert "eager_registry.py" in choices["eager_input_no_copy"].reason  # the measurement
    on = {c.setting: c for c in make_executor(eager_input_no_copy=True).info.choices}
    assert (on["eager_input_no_copy"].value, on["eager_input_no_copy"].reason) == (
        "true",
        "configured",
    )
    assert (choices["pipeline_steps"].value, choices["pipeline_steps"].reason) == (
        "off",
        "auto: a CPU device's forward is synchronous",
    )
    assert (choices["dtype"].value, choices["dtype"].reason) == ("float32", "configured")
    assert choices["quantization"].value == "none"
    assert "float" in choices["quantization"].reason  # tiny-random: float weights
    assert choices["graph_backend"].reason == "configured"  # the fixtures' stand-in
    back, _ = info_from_proto(info_to_proto(ex.info, "tiny-random"))
    assert back.choices == ex.info.choices


def test_a_cpu_server_with_auto_graphs_captures_decode_graphs_in_the_background() -> None:
    cfg = ExecutorConfig(device="cpu")
    assert background_graph_mode(cfg, CPU) == "decode"
    assert background_graph_mode(cfg.replace(graph_backend="compiled_step"), CPU) == "decode"
    # bs 1 only: larger batches are bound by their matmuls (graphs measured no faster there)
    assert graph_settings(cfg, ModelExecutorLimits, CPU).decode_buckets == [1]
    assert graph_settings(
        cfg.replace(graph_batch_sizes="1,4"), ModelExecutorLimits, CPU
    ).decode_buckets == [1, 4]
    for other in (
        cfg.replace(graph_mode="none"),
        cfg.replace(graph_backend="standin"),
        cfg.replace(graph_backend="compiled"),  # measured no faster than eager on a CPU
        cfg.replace(tp_size=2),
    ):
        assert background_graph_mode(other, CPU) is None
    assert background_graph_mode(cfg, torch.device("cuda", 0)) is None


@pytest.mark.slow
def test_a_cpu_server_answers_at_once_and_reports_the_background_capture(
    cache_dir: Path, tmp_path: Path
) -> None:
    """`serve` with graph_mode=auto: ready before the compile ends (its heap frozen),
    GetRuntimeConfig says "capturing" until the bs-1 graph is in use (what its load added to
    the heap frozen too), then DECODE runs on it. A weight update then lands in that compiled
    graph, also after the weights' memory moved (a release, and a resume awaiting the
    update)."""
    import gc

    from executor.client.grpc_client import ExecutorClient
    from executor.service import heap
    from tests.server_util import Scrape, running_server, tiny_config

    config = tiny_config(
        cache_dir, graph_mode="auto", graph_backend="compiled_step", max_context_len=64
    )
    with (
        running_server(config, freeze_heap=True) as running,
        ExecutorClient(f"127.0.0.1:{running.port}") as c,
    ):
        assert heap.frozen()
        frozen_at_start = gc.get_freeze_count()
        assert c.get_runtime_config().graph_capture == "capturing graph_mode=decode"
        [mode] = [x for x in c.info().info.choices if x.setting == "graph_mode"]
        assert "background" in mode.reason
        c.forward(  # served eagerly meanwhile
            make_extend_batch(
                input_ids=[[5, 6, 7]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]]
            )
        )
        # The compile worker runs at nice 10: on a machine other processes keep busy it gets
        # little CPU (minutes for tiny-random at load 11 on 2 cores, seconds when quiet).
        deadline = time.monotonic() + 900
        running_s = []  # the gauge while it runs: how long the capture has run
        while c.get_runtime_config().graph_capture != "idle":
            assert time.monotonic() < deadline, "the background capture did not end"
            running_s.append(Scrape(running).get("model_executor_graph_capture_running_seconds"))
            time.sleep(0.2)
        assert c.get_runtime_config().graph_mode == "decode"
        assert running_s and running_s[0] > 0 and running_s == sorted(running_s)
        assert Scrape(running).get("model_executor_graph_capture_running_seconds") == 0
        assert gc.get_freeze_count() > frozen_at_start  # the loaded step's objects
        assert running.executor is not None
        assert running.executor.control.start_background() is None  # in use: nothing to do
        # Compiled by the compile worker (its own process), loaded here from the cache dir.
        decode = running.executor.runner.decode_graphs
        assert decode is not None
        assert all(c.graph.loaded for kv in decode.captured.values() for c in kv.values())
        assert any((cache_dir / "graphs").glob("decode-bs1-*.aot"))
        out = c.forward(
            make_decode_batch(input_ids=[8], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[4])
        )
        assert out.stats.path == "full_graph"
        _updates_reach_the_compiled_graph(running.executor, c, tmp_path, cache_dir)


def _updates_reach_the_compiled_graph(
    executor: ModelExecutor, client: object, tmp_path: Path, cache_dir: Path
) -> None:
    """Two updates (packed linears change under their key, the rest in place), the second
    after a release of the weights and a resume awaiting it: a prefill and a bs-1 DECODE on
    the compiled graph give, token and logprob, an eager executor's started on the weights."""
    from executor.weights.memory import WEIGHTS
    from tests.weights_util import fresh, new_weights, update

    seen = []
    for i, (version, seed) in enumerate((("rl-1", 1), ("rl-2", 2))):
        row, slot = 2 + i, 20 + 10 * i
        prefill = make_extend_batch(
            input_ids=[[9, 10, 11, 12]],
            req_pool_indices=[row],
            out_cache_loc=[list(range(slot, slot + 4))],
        )
        decode = make_decode_batch(
            input_ids=[13], req_pool_indices=[row], seq_lens=[5], out_cache_loc=[slot + 4]
        )
        decode.return_logprob = True
        if version == "rl-2":
            executor.weights.release((WEIGHTS,))
            executor.weights.resume((WEIGHTS,), from_update=True)
        tensors = new_weights(seed=seed)
        update(executor, tensors, version)
        ref = fresh(tmp_path / version, cache_dir, "tiny-random", tensors)
        client.forward(prefill)  # type: ignore[attr-defined]
        got = client.forward(decode)  # type: ignore[attr-defined]
        ref.forward(prefill)
        want = ref.forward(decode)
        assert (got.stats.path, got.weight_version) == ("full_graph", version)
        assert got.next_token_ids.tolist() == want.next_token_ids.tolist()
        assert torch.allclose(got.next_token_logprobs, want.next_token_logprobs, atol=1e-4)
        seen.append(float(got.next_token_logprobs[0]))
    assert seen[0] != seen[1]
