"""Quantized weights: the kernels' formula, GGUF blocks, the layers, the loader's modes.

Tolerances. The layers run the kernels with bfloat16 activations and bfloat16 scales/zeros
(8 significant bits: a relative rounding of at most 2^-9 each), and return bfloat16 results.
Against `F.linear` on the exact float32 weight with float32 activations, every output is
therefore within `REL_TOL = 1e-2` of the largest |output| (measured: at most 0.45% for these
shapes and formats). Against a reference that rounds x, scale and zero to bfloat16 first and
accumulates in float32, only the output rounding and summation order remain: within
`ROUNDED_TOL = 8e-3` of the largest |output| (one bfloat16 step is 2^-8 = 3.9e-3 relative).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig, resolve_device
from executor.core.forward_batch import ForwardBatch
from executor.model_executor import ModelExecutor
from executor.models.config import ModelConfig
from executor.models.decoder_model import DecoderModel
from executor.models.gguf_blocks import read_blocks
from executor.models.layers import Linear, PackedLinear
from executor.models.loader import load_model, read_model_config
from executor.models.quant_cache import CACHE_FORMAT
from executor.models.quant_formats import GroupQuant, quantize_int4, quantize_int8
from executor.models.quantize import check_quantization
from executor.models.quantized import (
    COMPUTE_DTYPE,
    GroupQmmLinear,
    Int4Linear,
    Int8Linear,
    QuantizedEmbedding,
    int4_terms,
)
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights
from tests.gguf_writer import write_gguf

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
REL_TOL = 1e-2
ROUNDED_TOL = 8e-3
# [N, K] of the fused QKV, output, fused gate-up and down projections.
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
TINY_SHAPES = [(128, 64), (64, 64), (256, 64), (64, 128)]
MakeExecutor = Callable[..., ModelExecutor]


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _rounded_reference(x: torch.Tensor, w: GroupQuant) -> torch.Tensor:
    """x @ W.T with x and every term's scale and zero rounded to bfloat16, in float32."""
    out = torch.zeros(x.shape[0], w.shape[0])
    for q, scale, zero in int4_terms(w):
        s = _bf16(scale).repeat_interleave(w.group, dim=1)
        z = _bf16(zero).repeat_interleave(w.group, dim=1)
        out += _bf16(x) @ ((q.float() - 8) * s + z).T
    return out


def _max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def _gguf_blocks(weight: np.ndarray, qtype: Q) -> tuple[GroupQuant, np.ndarray]:
    """What `read_blocks` makes of ggml's blocks for `weight`, and ggml's own dequantization."""
    raw = gguf.quants.quantize(weight, qtype)
    blocks = read_blocks(raw, qtype.name, rows=weight.shape[0], cols=weight.shape[1])
    return blocks, gguf.quants.dequantize(raw, qtype)


def test_int4_kernel_dequantizes_q_minus_8_times_scale_plus_zero() -> None:
    """The convention everything else builds on, checked against a float reference."""
    g = torch.Generator().manual_seed(0)
    n, k = 32, 128
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int16)
    scale = torch.rand(n, k // 32, generator=g) * 0.1 + 0.01
    zero = torch.randn(n, k // 32, generator=g) * 0.1
    w = GroupQuant(q, scale, zero, bits=4, source="int4")
    x = torch.randn(5, k, generator=g)
    out = Int4Linear(w, None, device=CPU)(x)
    assert _max_rel(out, _rounded_reference(x, w)) <= ROUNDED_TOL
    # Not the unsigned reading (q * scale + zero): that would be off by 8 * scale * sum(x).
    unsigned = _bf16(x) @ (q.float() * _bf16(scale).repeat_interleave(32, 1)).T
    assert _max_rel(out, unsigned) > 0.1


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("shape", SMOLLM2_SHAPES + TINY_SHAPES)
def test_gguf_block_linear_equals_f_linear_on_the_dequantized_weight(
    qtype: Q, shape: tuple[int, int]
) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(*shape, generator=g) / shape[1] ** 0.5).numpy()
    blocks, ggml = _gguf_blocks(weight, qtype)
    assert np.array_equal(blocks.dequantize().numpy(), ggml)  # ggml's values, exactly
    layer = Int4Linear(blocks, None, device=CPU)
    assert layer.terms == (2 if qtype == Q.Q8_0 else 1)
    for bs in (1, 7, 32):
        x = torch.randn(bs, shape[1], generator=g)
        out = layer(x)
        assert out.dtype == torch.float32 and out.shape == (bs, shape[0])
        assert _max_rel(out, F.linear(x, torch.from_numpy(ggml))) <= REL_TOL, (qtype, shape, bs)
        assert _max_rel(out, _rounded_reference(x, blocks)) <= ROUNDED_TOL, (qtype, shape, bs)


@pytest.mark.parametrize("shape", SMOLLM2_SHAPES[:2] + TINY_SHAPES)
def test_int4_and_int8_from_float_equal_f_linear_on_their_dequantized_weight(
    shape: tuple[int, int],
) -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(*shape, generator=g) / shape[1] ** 0.5
    bias = torch.randn(shape[0], generator=g)
    x = torch.randn(3, 2, shape[1], generator=g)  # a leading batch shape survives
    int4 = quantize_int4(weight)
    # Quantization error of min/max int4: at most half a step of the row's group.
    step = int4.scale.repeat_interleave(32, dim=1)
    assert bool(((int4.dequantize() - weight).abs() <= step / 2 + 1e-6).all())
    int8 = quantize_int8(weight)
    assert bool(((int8.dequantize() - weight).abs() <= int8.scale[:, None] / 2 + 1e-6).all())
    for layer, w in (
        (Int4Linear(int4, bias, device=CPU), int4),
        (Int8Linear(int8, bias, device=CPU), int8),
    ):
        out = layer(x)
        assert out.shape == (3, 2, shape[0])
        assert _max_rel(out, F.linear(x, w.dequantize(), bias)) <= REL_TOL, type(layer)


def test_bf16_activations_pass_through_unconverted() -> None:
    w = quantize_int4(torch.randn(64, 64))
    out = Int4Linear(w, None, device=CPU)(torch.randn(2, 64, dtype=COMPUTE_DTYPE))
    assert out.dtype == COMPUTE_DTYPE


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_quantized_embedding_gathers_the_dequantized_rows_exactly(qtype: Q) -> None:
    weight = torch.randn(512, 64).numpy()
    blocks, ggml = _gguf_blocks(weight, qtype)
    emb = QuantizedEmbedding(blocks, device=CPU, dtype=torch.float32)
    ids = torch.tensor([0, 5, 511, 5])
    rows = emb(ids)
    expected = torch.from_numpy(ggml)[ids]
    if qtype == Q.Q8_0:
        assert torch.equal(rows, expected)
    else:  # (q - 8) d + (m + 8 d) against ggml's d q + m: the same up to float32 rounding
        assert float((rows - expected).abs().max()) <= 1e-6 * float(expected.abs().max())


def test_int4_refuses_shapes_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"output size 24 must be a multiple of 16 on cpu"):
        Int4Linear(quantize_int4(torch.randn(24, 64)), None, device=CPU)
    config = ModelConfig(
        **{**TINY_CONFIGS["tiny-random"].as_dict(), "hidden_size": 48, "head_dim": 12}
    )
    with pytest.raises(
        ValueError,
        match=r"quantization=int4: model\.layers\.\*\.self_attn\.qkv_proj has weight shape "
        r"\[96, 48\] and the input size 48 must be a multiple of the group size 32",
    ):
        check_quantization("int4", "hf", "some-dir", config, CPU)
    check_quantization("int8", "hf", "some-dir", config, CPU)  # int8 takes any shape


# --- the loader's modes ------------------------------------------------------------------
def _write(tmp_path: Path, model: str, qtype: Q) -> Path:
    config = TINY_CONFIGS[model]
    path = tmp_path / f"{model}-{qtype.name}.gguf"
    write_gguf(path, config, tiny_random_weights(config), qtype_2d=qtype)
    return path


def _load(spec: str | Path, quantization: str) -> DecoderModel:
    return load_model(
        str(spec),
        device=CPU,
        dtype=torch.float32,
        max_positions=256,
        cache_dir=None,
        quantization=quantization,
    ).model


def test_gguf_mode_keeps_every_block_tensor_quantized(tmp_path: Path) -> None:
    model = _load(_write(tmp_path, "tiny-random-qwen2", Q.Q4_1), "gguf")
    layer = model.decoder_layers[0]
    for attr in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        linear = layer.get_submodule(attr)
        assert isinstance(linear, Int4Linear) and linear.format == "Q4_1"
    assert layer.self_attn.qkv_proj.bias is not None  # Qwen2's QKV bias, kept float
    # Tied head and embedding: the one 2-D tensor, both quantized.
    assert isinstance(model.lm_head, Int4Linear) and isinstance(
        model.embed_tokens, QuantizedEmbedding
    )


def test_cli_refuses_a_bad_combination_before_serving(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from executor.client.cli import main

    # The CLI configures logging process-wide onto this test's captured stderr; keep it out.
    monkeypatch.setattr("executor.client.cli_session.configure_logging", lambda *a, **k: None)

    assert main(["generate", "hi", "--model", "tiny-random", "--quantization", "gguf"]) == 2
    err = capsys.readouterr().err
    assert "model-executor: error: quantization=gguf keeps a GGUF file's own blocks" in err


@pytest.mark.slow
def test_cli_generates_with_quantized_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`generate` end to end (embedded server) with tiny-random quantized at load (the test
    GGUFs carry no vocabulary; SmolLM2's `gguf` run is in docs/performance.md)."""
    from executor.client.cli import main

    monkeypatch.setattr("executor.client.cli_session.configure_logging", lambda *a, **k: None)
    args = ["generate", "hi", "--model", "tiny-random", "--max-new-tokens", "4", "--ignore-eos"]
    assert main([*args, "--cache-dir", str(tmp_path), "--quantization", "int8"]) == 0
    assert capsys.readouterr().out.strip()


def test_modes_refuse_bad_combinations_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match="quantization=gguf keeps a GGUF file's own blocks, but model 'tiny-random' is tiny-random; use quantization=int8 or int4",
    ):
        _load("tiny-random", "gguf")
    with pytest.raises(
        ValueError,
        match=r"stores no decoder linear as Q4_0, Q4_1, Q8_0; use quantization=int8 or int4",
    ):
        _load(_write(tmp_path, "tiny-random", Q.F32), "gguf")
    with pytest.raises(
        ValueError, match="quantization must be one of auto, none, gguf, int8, int4, got 'q4'"
    ):
        ExecutorConfig(quantization="q4")


def _greedy(
    ex: ModelExecutor, prompt: list[int], n: int, forced: list[int] | None = None
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens on row 1 with the logits each came from; `forced` feeds those tokens
    instead of the chosen ones (both paths then see the same context)."""
    slots = list(range(1, len(prompt) + n + 1))
    batch = make_extend_batch(
        input_ids=[prompt], req_pool_indices=[1], out_cache_loc=[slots[: len(prompt)]]
    )
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for i in range(n):
        out = ex.forward(batch, return_logits=True).logits
        assert out is not None
        logits.append(out[0])
        tokens.append(int(out[0].argmax()))
        pos = len(prompt) + i
        batch = make_decode_batch(
            input_ids=[(forced or tokens)[i]],
            req_pool_indices=[1],
            seq_lens=[pos + 1],
            out_cache_loc=[slots[pos]],
        )
    return tokens, logits


# How far a quantized kernel's prefill logits may stray from the float32 path's: torch's int4
# kernels take bfloat16 activations, qmm quantizes them to int8 per group of 32 (as llama.cpp).
KERNEL_LOGIT_TOLERANCE = {"torch": 0.02, "qmm": 0.03}


@pytest.mark.parametrize("quant_kernel", ["qmm", "torch"])
@pytest.mark.parametrize(
    ("model", "qtype"), [("tiny-random", Q.Q4_0), ("tiny-random-qwen2", Q.Q8_0)]
)
def test_gguf_mode_generates_what_the_float32_path_generates(
    tmp_path: Path, model: str, qtype: Q, cache_dir: Path, quant_kernel: str
) -> None:
    """Both paths on the same file: prefill logits close, and greedy tokens equal until the
    float32 path's choice is a near-tie: its top-2 gap there is within the paths' logit
    difference (quantized activations can flip only such a choice)."""
    path = _write(tmp_path, model, qtype)
    base = ExecutorConfig(
        model=str(path),
        max_reqs=4,
        kv_slots=512,
        max_context_len=256,
        cache_dir=str(cache_dir),
        dtype="float32",
        quantization="none",  # the float32 reference (auto keeps a GGUF's blocks)
    )
    ref = ModelExecutor(base)
    quant = ModelExecutor(base.replace(quantization="gguf", quant_kernel=quant_kernel))
    assert quant.loaded.quant_kernel == quant_kernel
    assert quant.loaded.weight_bytes < ref.loaded.weight_bytes / 2
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    ref_tokens, ref_logits = _greedy(ref, prompt, 24)
    prefill = _greedy(quant, prompt, 1)[1][0]
    assert _max_rel(prefill, ref_logits[0]) <= KERNEL_LOGIT_TOLERANCE[quant_kernel]
    q_tokens, _ = _greedy(quant, prompt, 24)
    first = next(
        (i for i, (a, b) in enumerate(zip(ref_tokens, q_tokens, strict=True)) if a != b), None
    )
    if first is not None:
        _, q_logits = _greedy(quant, prompt, first + 1, forced=ref_tokens)
        top2 = ref_logits[first].topk(2).values
        diff = float((q_logits[first] - ref_logits[first]).abs().max())
        assert float(top2[0] - top2[1]) <= 2 * diff, f"token {first} is no near-tie"
        # int8 activations flip near-ties sooner on this random model (flat logits).
        assert first >= (4 if quant_kernel == "torch" else 1), f"diverged at token {first}"


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_float_models_quantize_at_load(make_executor: MakeExecutor, mode: str) -> None:
    """The quantized model computes what a float model holding the dequantized weights does."""
    # The reference's weights are edited in place below: plain (aten) linears.
    ref, quant = make_executor(linear_kernel="aten"), make_executor(quantization=mode)
    quantize = quantize_int4 if mode == "int4" else quantize_int8
    for ref_layer in ref.model.decoder_layers:
        for attr in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            weight = ref_layer.get_submodule(attr).weight
            weight.copy_(quantize(weight).dequantize())
    layer = quant.model.decoder_layers[1]
    int4_kind = GroupQmmLinear if quant.loaded.quant_kernel == "qmm" else Int4Linear
    kind = int4_kind if mode == "int4" else Int8Linear
    assert all(
        isinstance(layer.get_submodule(a), kind)
        for a in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    )
    # Float checkpoints keep a float head (packed where the float linears are).
    head = PackedLinear if quant.loaded.linear_kernel == "onednn" else Linear
    assert isinstance(quant.model.lm_head, head)
    assert quant.info.quantization == mode and ref.info.quantization == "none"
    batch = make_extend_batch(
        input_ids=[[5, 9, 200, 31]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3, 4]]
    )
    a, b = (
        ref.forward(batch, return_logits=True).logits,
        quant.forward(batch, return_logits=True).logits,
    )
    assert a is not None and b is not None
    assert _max_rel(b, a) <= KERNEL_LOGIT_TOLERANCE[quant.loaded.quant_kernel]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_cuda_int4_linear_equals_f_linear(qtype: Q) -> None:
    weight = (torch.randn(960, 576) / 24).numpy()
    blocks, ggml = _gguf_blocks(weight, qtype)
    layer = Int4Linear(blocks, None, device=torch.device("cuda"))
    x = torch.randn(4, 576)
    out = layer(x.cuda()).cpu()
    assert _max_rel(out, F.linear(x, torch.from_numpy(ggml))) <= REL_TOL
    int8 = quantize_int8(torch.from_numpy(weight))
    out8 = Int8Linear(int8, None, device=torch.device("cuda"))(x.cuda()).cpu()
    assert _max_rel(out8, F.linear(x, int8.dequantize())) <= REL_TOL


# How far a graph path's logits may stray from eager's on the same quantized model: the paths
# round their float inputs differently, and an activation quantization amplifies that.
GRAPH_LOGIT_TOLERANCE = {"torch": ROUNDED_TOL, "qmm": 0.05}


@pytest.mark.slow
@pytest.mark.parametrize("quant_kernel", ["qmm"])  # torch's kernels: the whole-step test below
def test_quantized_layers_run_on_the_graph_paths(
    tmp_path: Path, cache_dir: Path, quant_kernel: str, graph_compiler: str
) -> None:
    """Full-graph DECODE and piecewise EXTEND (the CPU stand-in refuses host reads and
    data-dependent sizes at capture) agree with eager on a quantized model."""
    from tests.random_batches import BatchGenerator

    path = _write(tmp_path, "tiny-random-qwen2", Q.Q4_1)
    base = ExecutorConfig(
        model=str(path),
        max_reqs=16,
        kv_slots=4096,
        max_context_len=1024,
        cache_dir=str(cache_dir),
        quantization="gguf",
        quant_kernel=quant_kernel,
        dtype="float32",
    )
    eager = ModelExecutor(base.replace(graph_mode="none"))
    graph = ModelExecutor(
        base.replace(
            # Two buckets each (a compiler traces one graph set per bucket): batches of 1-6
            # pad to 2 or 8, the generator's extends to 16 or 128, or run eagerly past it.
            graph_mode="both",
            graph_batch_sizes="2,8",
            piecewise_token_sizes="16,128",
        )
    )
    assert all(not r.failed for r in graph.control.capture_reports), graph.control.capture_reports
    gen = BatchGenerator(seed=11, limits=eager.limits, max_batch_size=6)
    paths: set[str] = set()
    for step in range(30):
        fb = gen.next_batch(step)
        a = eager.forward(fb, return_logits=True)
        b = graph.forward(fb, return_logits=True)
        assert a.logits is not None and b.logits is not None
        if a.logits.numel():
            tolerance = GRAPH_LOGIT_TOLERANCE[quant_kernel]
            assert _max_rel(b.logits, a.logits) <= tolerance, f"step {step} {b.stats.path}"
        assert torch.equal(a.next_token_ids, b.next_token_ids), f"step {step}"
        paths.add(b.stats.path)
        if not fb.forward_mode.is_idle():
            gen.observe(fb, a.next_token_ids)
    assert {"full_graph", "piecewise"} <= paths, paths


@pytest.mark.slow
@pytest.mark.parametrize("quant_kernel", ["qmm", "torch"])
def test_quantized_layers_run_in_whole_step_compiled_decode_graphs(
    tmp_path: Path, cache_dir: Path, quant_kernel: str, graph_compiler: str
) -> None:
    """`compiled_step`: the quantized kernels (qmm as an extern op), the KV write and attention
    inside one graph per DECODE bucket give eager's greedy tokens and logits on a Q4_1
    model."""
    path = _write(tmp_path, "tiny-random-qwen2", Q.Q4_1)
    base = ExecutorConfig(
        model=str(path),
        max_reqs=4,
        kv_slots=512,
        max_context_len=256,
        cache_dir=str(tmp_path / "compiled"),  # a cold compile cache: the compile is tested
        quantization="gguf",
        quant_kernel=quant_kernel,
        dtype="float32",
    )
    eager = ModelExecutor(base.replace(graph_mode="none"))
    graph = ModelExecutor(
        base.replace(graph_mode="decode", graph_backend="compiled_step", graph_batch_sizes="1")
    )
    assert [(r.captured, r.failed) for r in graph.control.capture_reports] == [([1], {})]
    prompt = [(7 * i) % 500 + 3 for i in range(20)]
    want_tokens, want_logits = _greedy(eager, prompt, 6)
    got_tokens, got_logits = _greedy(graph, prompt, 6)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        assert _max_rel(got, want) <= GRAPH_LOGIT_TOLERANCE[quant_kernel]
    step = make_decode_batch(
        input_ids=[5], req_pool_indices=[1], seq_lens=[len(prompt) + 6], out_cache_loc=[26]
    )
    assert graph.forward(step).stats.path == "full_graph"


@pytest.mark.slow
def test_packed_model_is_cached_and_reloaded_without_the_gguf_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path, "tiny-random-qwen2", Q.Q8_0)

    def load() -> DecoderModel:
        return load_model(
            str(path),
            device=CPU,
            dtype=torch.float32,
            max_positions=256,
            cache_dir=tmp_path / "cache",
            quantization="gguf",
        ).model

    first = load()
    assert (
        len(list((tmp_path / "cache" / "gguf").glob(f"*.packed-v{CACHE_FORMAT}-cpu-float32-qmm-*")))
        == 1
    )

    def no_reader(*_: object) -> None:
        raise AssertionError("the cached model must not parse the GGUF's tensors again")

    monkeypatch.setattr("executor.models.loader.read_gguf_blocks", no_reader)
    second = load()
    for name in ("layers.1.self_attn.qkv_proj", "lm_head", "embed_tokens"):
        a, b = first.get_submodule(name), second.get_submodule(name)
        assert type(a) is type(b) and a.cached_attrs() == b.cached_attrs(), name
    assert first.state_dict().keys() == second.state_dict().keys()
    for key, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[key]), key
    ids = torch.tensor([3, 99, 511])
    assert torch.equal(first.embed_tokens(ids), second.embed_tokens(ids))
    h = torch.randn(2, 64)
    qkv = "layers.0.self_attn.qkv_proj"
    assert torch.equal(first.get_submodule(qkv)(h), second.get_submodule(qkv)(h))
    assert torch.equal(
        first.compute_logits(h, _decode_batch(2)), second.compute_logits(h, _decode_batch(2))
    )


def _decode_batch(bs: int) -> ForwardBatch:
    return make_decode_batch(
        input_ids=[5] * bs,
        req_pool_indices=list(range(1, bs + 1)),
        seq_lens=[1] * bs,
        out_cache_loc=list(range(1, bs + 1)),
    )


def test_int8_is_refused_on_cuda_at_config_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    """`device=auto` on a CUDA machine with `quantization=int8`: refused before any weight is
    read, naming the naive kernel; int4 and none resolve there, and int8 still does on CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = ExecutorConfig(model="tiny-random", device="auto", quantization="int8")
    assert resolve_device(config) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"quantization=int8 is not served on CUDA.*naive"):
        read_model_config(config)
    for mode in ("int4", "none"):
        read_model_config(config.replace(quantization=mode))
    read_model_config(config.replace(device="cpu"))
    with pytest.raises(ValueError, match="_weight_int8pack_mm"):
        check_quantization(
            "int8", "hf", "some-dir", TINY_CONFIGS["tiny-random"], torch.device("cuda")
        )
