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
from executor.config import ExecutorConfig, background_graph_mode
from executor.core.limits import BatchLimits
from executor.graphs.settings import graph_settings
from executor.model_executor import ModelExecutor
from executor.models import quant_kernel
from executor.models.quant_kernel import choose_quantization
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


def test_getinfo_reports_every_choice_with_its_reason(make_executor: MakeExecutor) -> None:
    ex = make_executor(quantization="auto", linear_kernel="auto")
    choices = {c.setting: c for c in ex.info.choices}
    assert set(choices) == {
        "device",
        "dtype",
        "quantization",
        "quant_kernel",
        "linear_kernel",
        "pipeline_steps",
        "graph_mode",
        "graph_backend",
    }
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


def test_a_cpu_server_answers_at_once_and_reports_the_background_capture(
    cache_dir: Path,
) -> None:
    """`serve` with graph_mode=auto: ready before the compile ends, GetRuntimeConfig says
    "capturing" until the bs-1 graph is in use, then DECODE runs on it."""
    from executor.client.grpc_client import ExecutorClient
    from tests.server_util import running_server, tiny_config

    config = tiny_config(
        cache_dir, graph_mode="auto", graph_backend="compiled_step", max_context_len=64
    )
    with running_server(config) as running, ExecutorClient(f"127.0.0.1:{running.port}") as c:
        assert c.get_runtime_config().graph_capture == "capturing graph_mode=decode"
        [mode] = [x for x in c.info().info.choices if x.setting == "graph_mode"]
        assert "background" in mode.reason
        c.forward(  # served eagerly meanwhile
            make_extend_batch(
                input_ids=[[5, 6, 7]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]]
            )
        )
        deadline = time.monotonic() + 300
        while c.get_runtime_config().graph_capture != "idle":
            assert time.monotonic() < deadline, "the background capture did not end"
            time.sleep(0.2)
        assert c.get_runtime_config().graph_mode == "decode"
        assert running.executor is not None
        assert running.executor.control.start_background() is None  # in use: nothing to do
        out = c.forward(
            make_decode_batch(input_ids=[8], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[4])
        )
        assert out.stats.path == "full_graph"
