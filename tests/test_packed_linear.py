"""oneDNN-packed float linears (`executor/models/onednn_linear.py`, `PackedLinear`, `linear_kernel`)."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.models.layers import Linear, PackedLinear
from executor.models.onednn_linear import PackedWeight, onednn_linear, packed_weights_alive
from executor.models.packing import choose_linear_kernel

MakeExecutor = Callable[..., ModelExecutor]

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no mkldnn"
)

# [out, in] of SmolLM2's four decoder linears and head, and of tiny-random's.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (192, 64), (64, 128)]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # A different summation order than MKL's sgemm: float32 rounding, relative to the scale.
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * max(scale, 1.0)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_packed_linear_equals_f_linear(n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n * 7 + k)
    weight = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g) if n < 1000 else None
    x = torch.randn(rows, k, generator=g)
    layer = PackedLinear(weight, bias)
    _close(layer(x), F.linear(x, weight, bias))
    # Leading dimensions are kept, as Linear keeps them.
    x3 = x.view(1, rows, k)
    assert layer(x3).shape == (1, rows, n)


@pytest.mark.slow
def test_compiled_halves_call_the_packed_op_once_for_every_layer() -> None:
    """Each layer's key is a graph input, so layers of one shape share one compiled graph
    (no recompile per layer) and each gets its own weight."""
    torch._dynamo.reset()
    weights = [torch.randn(96, 64) for _ in range(3)]
    layers = [PackedLinear(w, None) for w in weights]

    def half(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        return F.silu(layer(x)) * 2

    compiled = torch.compile(half, fullgraph=True, dynamic=True, backend="inductor")
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows in (3, 5):
        x = torch.randn(rows, 64)
        for layer, w in zip(layers, weights, strict=True):
            _close(compiled(layer, x), F.silu(F.linear(x, w)) * 2)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before
    assert graphs == 1, f"{graphs} graphs for 3 layers x 2 row counts"


@pytest.mark.slow
def test_packed_weights_go_with_their_owners() -> None:
    gc.collect()
    before = packed_weights_alive()
    layer = PackedLinear(torch.randn(32, 16), None)
    assert packed_weights_alive() == before + 1
    key = layer.key
    del layer
    gc.collect()
    assert packed_weights_alive() == before
    with pytest.raises(RuntimeError, match="no packed weight for this key"):
        onednn_linear(torch.randn(2, 16), key, None)
    # A copied key names nothing either: keys are handles, not state.
    weight = PackedWeight(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="no packed weight"):
        onednn_linear(torch.randn(2, 16), weight.key.clone(), None)


def test_choose_linear_kernel() -> None:
    cpu = torch.device("cpu")
    assert choose_linear_kernel("auto", cpu, torch.float32).kernel == "onednn"
    bf16 = choose_linear_kernel("auto", cpu, torch.bfloat16)
    assert bf16.kernel == "aten" and "float32" in bf16.reason
    assert choose_linear_kernel("aten", cpu, torch.float32).kernel == "aten"
    with pytest.raises(ValueError, match=r"linear_kernel=onednn: .*bfloat16"):
        choose_linear_kernel("onednn", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match=r"linear_kernel=onednn: .*CPU"):
        choose_linear_kernel("onednn", torch.device("cuda", 0), torch.float32)
    with pytest.raises(ValueError, match="linear_kernel must be one of auto, onednn, aten"):
        ExecutorConfig(linear_kernel="mkl")


def test_executor_packs_every_float_linear_and_gives_the_aten_tokens(
    make_executor: MakeExecutor,
) -> None:
    plain = make_executor(linear_kernel="aten")
    packed = make_executor()  # auto: onednn on CPU in float32
    assert packed.loaded.linear_kernel == "onednn" and plain.loaded.linear_kernel == "aten"
    layer = packed.model.decoder_layers[0]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert isinstance(layer.get_submodule(name), PackedLinear), name
        assert isinstance(plain.model.decoder_layers[0].get_submodule(name), Linear), name
    assert not any(isinstance(m, Linear) for m in packed.model.modules())
    # Both hold the same weights, once each; a tied head adds its packed copy.
    head = packed.model.lm_head
    assert isinstance(head, PackedLinear)
    tied = packed.loaded.config.tie_word_embeddings
    extra = head.packed.nbytes if tied else 0
    assert packed.loaded.weight_bytes == plain.loaded.weight_bytes + extra

    prompts = [[5, 9, 200, 31, 7], [11, 12, 13]]
    slots = [[1, 2, 3, 4, 5], [40, 41, 42]]
    results = []
    for ex in (plain, packed):
        first = ex.forward(
            make_extend_batch(input_ids=prompts, req_pool_indices=[1, 2], out_cache_loc=slots),
            return_logits=True,
        )
        tokens = [first.next_token_ids.tolist()]
        logits = [first.logits]
        lens = [len(p) for p in prompts]
        for step in range(6):
            lens = [n + 1 for n in lens]
            out = ex.forward(
                make_decode_batch(
                    input_ids=tokens[-1],
                    req_pool_indices=[1, 2],
                    seq_lens=lens,
                    out_cache_loc=[100 + step, 200 + step],
                ),
                return_logits=True,
            )
            tokens.append(out.next_token_ids.tolist())
            logits.append(out.logits)
        results.append((tokens, logits))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert a is not None and b is not None
        _close(b, a)
