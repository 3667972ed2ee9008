from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

# This checkout's generated stubs (`model_executor.v1` lives under proto/), not those of the
# checkout an editable install points at: a git worktree shares another checkout's venv.
# PYTHONPATH carries it to the servers tests start as subprocesses.
_PROTO = str(Path(__file__).resolve().parent.parent / "proto")
sys.path.insert(0, _PROTO)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_PROTO, os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402
import torch  # noqa: E402

from executor.core.names import EAGER_KERNELS, INDUCTOR  # noqa: E402

# Imported where used: collecting the `gpu` tests needs pytest and torch here and nothing of
# the dev extras (the GPU machine has only the runtime's; benchmarks/device_check.sh).
if TYPE_CHECKING:
    from executor.model_executor import ModelExecutor
    from tests.prometheus_tools import PrometheusBinaries

# Without CUDA, Triton kernels run only under triton's interpreter (numpy on CPU tensors).
# Triton reads TRITON_INTERPRET when a kernel is decorated and again when it launches, so
# it is set here, for the whole session and before any test module imports the kernels.
# Nothing changes where triton is not installed, or where CUDA is present.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _row_invariant_interpreter_dot() -> None:
    """The interpreter's `tl.dot` is numpy's matmul, whose BLAS kernel gives a row's last bits
    by the row's place in the block on some CPUs (OpenBLAS, AVX2): a query row that a chunk
    boundary moves within its block then reads differently. A GPU's tile product computes
    each output the same way wherever it sits, which is what the batch-invariant kernels
    rely on; this dot does too: each output summed over k in order, rows independent."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, precision: Any, imprecise: Any) -> Any:
        fp8 = any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b))
        if fp8 or a.data.ndim != 2:
            return original(self, a, b, d, precision, imprecise)
        dtype = d.data.dtype
        products = a.data.astype(dtype)[:, :, None] * b.data.astype(dtype)[None, :, :]
        return interpreter.TensorHandle(products.sum(axis=1) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    _row_invariant_interpreter_dot()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo_per_module() -> object:
    """Each test module starts with dynamo's in-process caches empty. A server process holds
    one model; a test session builds hundreds, and dynamo keeps every compiled entry of a
    shared layer function with guards on an earlier model's modules (a quantized model's
    `mn` buffer, read back while a later model compiles, failed its capture)."""
    yield
    torch._dynamo.reset()


@pytest.fixture(
    params=[
        pytest.param(EAGER_KERNELS, id="eager"),
        pytest.param(INDUCTOR, id="inductor", marks=pytest.mark.long),
    ]
)
def graph_compiler(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """What compiles the graphs of the `compiled` and `compiled_step` backends in this test:
    dynamo's `eager` backend in the gate (the same tracing, guards, buckets, fallbacks and
    device writes, without code generation), inductor in `make test-long` (its C++ kernels
    take minutes of a 2-core machine). Executors built in the test process only."""
    from executor.graphs import settings

    compiler = str(request.param)
    monkeypatch.setattr(settings, "graph_compiler", lambda config: compiler)
    return compiler


def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every process of this test run sees: under pytest-xdist, the parent of the
    workers' own temporary folders."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir for the whole test run, shared by the xdist workers (every entry is
    written under a temporary name, then renamed: processes can share it): a fresh clone
    pays the GGUF dequantization, the host kernels' builds and a graph's compile once."""
    path = shared_tmp(tmp_path_factory) / "model-cache"
    path.mkdir(exist_ok=True)
    return path


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers' GGUF load with two of its repeats memoized (both read-only): the file's
    parse (once for the config, again for the tensors) and gguf's name map (rebuilt for each
    of the model's modules, the same each time). What it reads is unchanged."""
    import gguf

    readers: dict[str, Any] = {}
    reader, name_map = gguf.GGUFReader, functools.cache(gguf.get_tensor_name_map)

    def read(path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return reader(path, *args, **kwargs)
        if str(path) not in readers:
            readers[str(path)] = reader(path)
        return readers[str(path)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", read)
        patch.setattr(gguf, "get_tensor_name_map", name_map)
        yield


@pytest.fixture(scope="session")
def hf_smollm2(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """transformers' SmolLM2-135M read from the packaged GGUF file by its own GGUF loader
    (float32, eval mode). Shared: tests read it and never change it. The first process of the
    run that needs it reads the GGUF file (slow: transformers dequantizes it in Python) and
    saves what it read as safetensors; the other test processes load that."""
    transformers = pytest.importorskip("transformers")
    from filelock import FileLock
    from safetensors.torch import save_file

    from executor.models.loader import packaged_smollm2_path

    auto = transformers.AutoModelForCausalLM
    saved = shared_tmp(tmp_path_factory) / "hf-smollm2"
    weights = saved / "model.safetensors"
    with FileLock(f"{saved}.lock"):
        if not weights.exists():
            path = packaged_smollm2_path()
            with _gguf_read_once():
                model = auto.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            model.config.save_pretrained(saved)
            tied = model.config.tie_word_embeddings  # the head is the embedding: saved once
            state = {
                k: v.contiguous()
                for k, v in model.state_dict().items()
                if not (tied and k == "lm_head.weight")
            }
            save_file(state, str(saved / "partial.safetensors"))
            (saved / "partial.safetensors").rename(weights)
            return model.eval()
    return auto.from_pretrained(saved, dtype=torch.float32).eval()


@pytest.fixture
def make_executor(cache_dir: Path) -> Callable[..., ModelExecutor]:
    from executor.config import ExecutorConfig
    from executor.model_executor import ModelExecutor

    def make(**overrides: object) -> ModelExecutor:
        values: dict[str, object] = {
            "model": "tiny-random",
            "device": "cpu",  # the CPU suite stays on the CPU where a GPU exists too
            "max_reqs": 16,
            "kv_slots": 2048,
            "max_context_len": 1024,
            "cache_dir": str(cache_dir),
            # The stand-in enforces CUDA's capture rules and captures in milliseconds; the
            # compiled backend has its own few tests (tests/test_compiled_graphs.py).
            "graph_backend": "standin",
            # `auto` is bfloat16 on CPUs with native bfloat16 (AVX512-BF16/AMX): the tests'
            # tolerances are float32's, whichever machine runs them.
            "dtype": "float32",
            "allow_input_embeds": True,  # tests send embeddings; the default refuses them
        }
        values.update(overrides)
        return ModelExecutor(ExecutorConfig(**values))  # type: ignore[arg-type]

    return make


@pytest.fixture(scope="session")
def prometheus_binaries() -> PrometheusBinaries:
    """promtool and prometheus, installed from Debian's package when missing (never a skip)."""
    from tests.prometheus_tools import PrometheusUnavailable, ensure_prometheus

    try:
        return ensure_prometheus()
    except PrometheusUnavailable as exc:
        pytest.fail(f"Prometheus's binaries are needed and could not be installed: {exc}")
