"""Weight updates in the engine (`executor.weights`): after an update, greedy tokens equal a
fresh executor's started on the new weights, whatever holds the weights (float, oneDNN-packed,
int8/int4 re-quantized, graph paths), for partial updates too; refusals change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.core.errors import BatchTooLargeError, BatchValidationError, ModelStateError
from executor.model_executor import ModelExecutor
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights
from executor.weights.catalog import TensorSpec
from executor.weights.writer import digest
from tests.gguf_writer import write_gguf
from tests.weights_util import config, fresh, greedy, new_weights, update

# Every test here loads an executor or starts a server: over half a second each.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("model", "overrides"),
    [
        ("tiny-random", {"linear_kernel": "onednn"}),  # packed linears, packed in place
        ("tiny-random", {"linear_kernel": "aten", "graph_mode": "both"}),  # graphs stay valid
        ("tiny-random-qwen2", {}),  # biases, a tied head (its packed copy follows)
        ("tiny-random-qwen3-moe", {"linear_kernel": "aten"}),  # stacked experts
        ("tiny-random", {"quantization": "int8"}),  # re-quantized as the loader quantizes
        pytest.param(  # CUDA graphs replay the weights' own storage, written in place
            "tiny-random",
            {"device": "cuda", "graph_mode": "both", "graph_backend": "cuda"},
            marks=pytest.mark.gpu,
        ),
    ],
    ids=["packed", "graphs", "qwen2-tied", "moe", "int8", "cuda-graphs"],
)
def test_update_equals_a_fresh_executor_on_the_new_weights(
    tmp_path: Path, cache_dir: Path, model: str, overrides: dict[str, object]
) -> None:
    ex = ModelExecutor(config(cache_dir, model, **overrides))
    before = greedy(ex)
    tensors = new_weights(model)
    result = update(ex, tensors, "step-1")
    assert result.version == "step-1" and result.num_tensors == len(tensors)
    ref = fresh(tmp_path, cache_dir, model, tensors, **overrides)
    after = greedy(ex)
    assert after == greedy(ref)
    assert after != before
    assert ex.info.weight_version == "step-1"
    assert ex.forward(_idle()).weight_version == "step-1"
    if overrides.get("graph_mode") == "both":  # the graphs replayed the new weights
        out = ex.forward(_decode_after_prefill(ex))
        assert out.stats.path == "full_graph"


def _idle():  # type: ignore[no-untyped-def]
    from executor.batch_prep import make_idle_batch

    return make_idle_batch()


def _decode_after_prefill(ex: ModelExecutor):  # type: ignore[no-untyped-def]
    from executor.batch_prep import make_decode_batch, make_extend_batch

    ex.forward(
        make_extend_batch(input_ids=[[5, 6, 7]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]])
    )
    return make_decode_batch(input_ids=[9], req_pool_indices=[1], seq_lens=[4], out_cache_loc=[4])


def test_a_partial_update_changes_only_the_named_tensors(tmp_path: Path, cache_dir: Path) -> None:
    """One part of a fused (packed) QKV and one norm: the other parts keep their values."""
    ex = ModelExecutor(config(cache_dir, linear_kernel="onednn"))
    old = tiny_random_weights(TINY_CONFIGS["tiny-random"])
    new = new_weights()
    names = [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ]
    update(ex, {n: new[n] for n in names})
    mixed = {**old, **{n: new[n] for n in names}}
    assert greedy(ex) == greedy(fresh(tmp_path, cache_dir, "tiny-random", mixed))
    assert ex.info.weight_version == "1"  # no version named: the count of updates


def test_bfloat16_tensors_are_cast_to_the_weights_dtype(tmp_path: Path, cache_dir: Path) -> None:
    ex = ModelExecutor(config(cache_dir))
    new = {n: t.to(torch.bfloat16) for n, t in new_weights().items()}
    update(ex, new)
    ref = fresh(tmp_path, cache_dir, "tiny-random", {n: t.float() for n, t in new.items()})
    assert greedy(ex) == greedy(ref)


@pytest.mark.parametrize(
    ("spec", "error", "field"),
    [
        (
            TensorSpec("model.layers.9.mlp.up_proj.weight", torch.float32, (128, 64)),
            BatchValidationError,
            "tensors[0].name",
        ),
        (
            TensorSpec("model.norm.weight", torch.float32, (65,)),
            BatchValidationError,
            "tensors[0].shape",
        ),
        (
            TensorSpec("model.norm.weight", torch.int64, (64,)),
            BatchValidationError,
            "tensors[0].dtype",
        ),
    ],
    ids=["unknown-name", "wrong-shape", "int-dtype"],
)
def test_a_bad_header_is_refused_naming_the_field_and_nothing_changes(
    cache_dir: Path, spec: TensorSpec, error: type[Exception], field: str
) -> None:
    ex = ModelExecutor(config(cache_dir))
    before = digest(ex.model)
    with pytest.raises(error) as info:
        ex.weights.plan([spec], "", max_bytes=1 << 40)
    assert info.value.field == field  # type: ignore[attr-defined]
    assert digest(ex.model) == before and ex.weights.version == "0"


def test_duplicates_versions_and_sizes_are_refused(cache_dir: Path) -> None:
    ex = ModelExecutor(config(cache_dir))
    norm = TensorSpec("model.norm.weight", torch.float32, (64,))
    with pytest.raises(BatchValidationError, match="named twice"):
        ex.weights.plan([norm, norm], "", max_bytes=1 << 40)
    with pytest.raises(BatchValidationError, match="weight_version"):
        ex.weights.plan([norm], "bad\nversion", max_bytes=1 << 40)
    with pytest.raises(BatchTooLargeError, match="max_update_bytes"):
        ex.weights.plan([norm], "", max_bytes=100)


def test_quantized_linears_take_whole_fused_updates_only(cache_dir: Path) -> None:
    ex = ModelExecutor(config(cache_dir, quantization="int8"))
    q = TensorSpec("model.layers.0.self_attn.q_proj.weight", torch.float32, (64, 64))
    with pytest.raises(ModelStateError, match=r"missing: model\.layers\.0\.self_attn\.k_proj"):
        ex.weights.plan([q], "", max_bytes=1 << 40)
    norm = TensorSpec("model.norm.weight", torch.float32, (64,))  # float beside them: fine
    ex.weights.plan([norm], "", max_bytes=1 << 40)


def test_gguf_blocks_kept_quantized_refuse_an_update_saying_why(
    tmp_path: Path, cache_dir: Path
) -> None:
    import gguf

    cfg = TINY_CONFIGS["tiny-random"]
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, tiny_random_weights(cfg), gguf.GGMLQuantizationType.Q8_0)
    ex = ModelExecutor(config(cache_dir, str(path), quantization="gguf", quant_kernel="torch"))
    spec = TensorSpec("model.layers.0.mlp.down_proj.weight", torch.float32, (64, 128))
    with pytest.raises(ModelStateError, match="GGUF Q8_0 blocks"):
        ex.weights.plan([spec], "", max_bytes=1 << 40)
