"""Loaders: GGUF (every supported type, Q/K un-permutation, the sha256-keyed cache), HF directories."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from executor.models import gguf_loader
from executor.models.gguf_loader import load_gguf, unpermute_qk
from executor.models.hf_loader import load_hf_directory, save_hf_directory
from executor.models.loader import load_model, packaged_smollm2_path, resolve_model_spec
from executor.models.registry import create_model, hf_config
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights
from executor.models.weights import load_hf_weights
from tests.gguf_writer import permute_qk, write_gguf

Q = gguf.GGMLQuantizationType


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(48 * 5, dtype=np.float32).reshape(48, 5)
    for n_head in (1, 3, 6):
        assert np.array_equal(unpermute_qk(permute_qk(w, n_head), n_head), w)
    b = np.arange(48, dtype=np.float32)
    assert np.array_equal(unpermute_qk(permute_qk(b, 4), 4), b)
    assert not np.array_equal(permute_qk(w, 3), w)


@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-qwen2"])
def test_float32_gguf_loads_the_exact_weights(tmp_path: Path, model: str) -> None:
    config, tensors = TINY_CONFIGS[model], tiny_random_weights(TINY_CONFIGS[model])
    write_gguf(tmp_path / "m.gguf", config, tensors)
    loaded_config, loaded = load_gguf(tmp_path / "m.gguf", cache_dir=None)
    assert loaded_config.architecture == config.architecture
    assert loaded_config.num_kv_heads == config.num_kv_heads
    assert loaded_config.tie_word_embeddings == config.tie_word_embeddings
    assert loaded_config.attention_bias == config.attention_bias
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t), name


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_each_supported_type_dequantizes_like_ggml(tmp_path: Path, qtype: Q) -> None:
    config = TINY_CONFIGS["tiny-random"]
    tensors = tiny_random_weights(config)
    write_gguf(tmp_path / "m.gguf", config, tensors, qtype_2d=qtype)
    _, loaded = load_gguf(tmp_path / "m.gguf", cache_dir=None)
    tolerance = {Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.05, Q.Q4_0: 0.6, Q.Q4_1: 0.6}[qtype]
    for name, t in tensors.items():
        if t.dim() != 2:
            continue
        # What ggml itself reconstructs from the stored blocks, in HF row order.
        data = t.numpy()
        if ".q_proj." in name or ".k_proj." in name:
            n = config.num_heads if ".q_proj." in name else config.num_kv_heads
            expected = unpermute_qk(
                gguf.quants.dequantize(gguf.quants.quantize(permute_qk(data, n), qtype), qtype), n
            )
        else:
            expected = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
        assert np.array_equal(loaded[name].numpy(), expected), name
        assert float((loaded[name] - t).abs().max()) < tolerance, name


def test_gguf_cache_is_reused_on_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, tensors = TINY_CONFIGS["tiny-random"], tiny_random_weights(TINY_CONFIGS["tiny-random"])
    path = tmp_path / "m.gguf"
    write_gguf(path, config, tensors, qtype_2d=Q.Q8_0)
    cache = tmp_path / "cache"
    first_config, first = load_gguf(path, cache)
    assert len(list((cache / "gguf").glob("*.safetensors"))) == 1

    def must_not_dequantize(*args: object) -> None:
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(gguf_loader, "dequantize_gguf", must_not_dequantize)
    second_config, second = load_gguf(path, cache)
    assert second_config == first_config
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_sharded_hf_directory_loads(tmp_path: Path) -> None:
    config, tensors = TINY_CONFIGS["tiny-random"], tiny_random_weights(TINY_CONFIGS["tiny-random"])
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    (tmp_path / "config.json").write_text(json.dumps(hf_config(config)))
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded_config, loaded = load_hf_directory(tmp_path)
    assert loaded_config.num_layers == config.num_layers
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_missing_and_misshaped_tensors_are_named(tmp_path: Path) -> None:
    config = TINY_CONFIGS["tiny-random"]
    tensors = tiny_random_weights(config)
    model = create_model(config, 64, device=torch.device("cpu"), dtype=torch.float32)
    broken = dict(tensors)
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_weights(model, broken)
    broken = dict(tensors)
    broken["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        load_hf_weights(model, broken)


def test_model_specs_resolve_or_explain(tmp_path: Path) -> None:
    assert resolve_model_spec("smollm2").path == packaged_smollm2_path()
    assert resolve_model_spec("tiny-random").kind == "tiny-random"
    save_hf_directory(
        tmp_path / "hf",
        TINY_CONFIGS["tiny-random"],
        tiny_random_weights(TINY_CONFIGS["tiny-random"]),
    )
    assert resolve_model_spec(str(tmp_path / "hf")).kind == "hf"
    with pytest.raises(ValueError, match="not 'smollm2'"):
        resolve_model_spec(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no such GGUF"):
        resolve_model_spec(str(tmp_path / "missing.gguf"))


def test_load_model_builds_in_the_requested_dtype() -> None:
    loaded = load_model(
        "tiny-random",
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        max_positions=128,
        cache_dir=None,
    )
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.model.rotary.cos_cache.dtype == torch.float32


@pytest.mark.parametrize(
    "body, message",
    [
        (struct.pack("<IQQ", 3, 2**63, 1) + bytes(21), "tensors cannot fit"),
        (struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**60) + b"k" * 13, "at most 65536"),
        (
            struct.pack("<IQQ", 3, 0, 1)
            + struct.pack("<Q", 1)
            + b"k"
            + struct.pack("<IIQ", 9, 4, 2**62),
            "claims 4611686018427387904 items",
        ),
        (struct.pack("<IQQ", 7, 0, 0), "version 7"),
    ],
)
def test_a_hostile_gguf_header_is_refused_before_any_allocation(
    tmp_path: Path, body: bytes, message: str
) -> None:
    """45-byte files whose header claims 2**63 tensors, a 2**60-byte key or a 2**62-item
    array: refused at once, naming the claim (a reader would size its allocations by them)."""
    import time

    from executor.models.gguf_header import check_gguf_header, open_gguf

    path = tmp_path / "hostile.gguf"
    path.write_bytes(b"GGUF" + body)
    for read in (check_gguf_header, open_gguf):
        start = time.perf_counter()
        with pytest.raises(ValueError, match=message):
            read(path)
        assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "qtype",
    [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q4_1],
)
def test_the_gguf_walk_reads_what_the_gguf_package_reads(
    tmp_path: Path, qtype: gguf.GGMLQuantizationType
) -> None:
    """`open_gguf` (the bounded walk) against `gguf.GGUFReader`: every metadata value, and
    every tensor's name, shape, type and bytes."""
    from executor.models.gguf_header import open_gguf

    config = TINY_CONFIGS["tiny-random"]
    path = tmp_path / "m.gguf"
    write_gguf(path, config, tiny_random_weights(config), qtype)
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
    keys = {k for k in theirs.fields if not k.startswith("GGUF.")}  # the reader's own entries
    assert set(ours.fields) == keys
    for key in keys:
        assert ours.fields[key].contents() == pytest.approx(theirs.fields[key].contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (list(a.shape), a.tensor_type) == (list(b.shape), b.tensor_type), a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
