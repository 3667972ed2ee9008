"""Model files from an untrusted place: safetensors headers are bounded before any reader
allocates for them, an index names only files of its directory, and a pinned digest refuses
files other than the reviewed ones."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import time
import tracemalloc
from pathlib import Path

import pytest

from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.models import safetensors_header
from executor.models.hf_loader import load_hf_directory, save_hf_directory
from executor.models.model_digest import model_sha256
from executor.models.safetensors_header import check_safetensors_header
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights


def _file(path: Path, header: object, data: bytes = b"", *, length: int | None = None) -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _f32(shape: list[int], begin: int) -> dict[str, object]:
    n = 4
    for d in shape:
        n *= d
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + n]}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "tiny"
    config = TINY_CONFIGS["tiny-random"]
    save_hf_directory(path, config, tiny_random_weights(config))
    return path


def test_a_real_file_passes(hf_dir: Path) -> None:
    count = check_safetensors_header(hf_dir / "model.safetensors")
    assert count == len(load_hf_directory(hf_dir)[1]) > 0
    ok = _file(
        Path(hf_dir.parent / "ok.safetensors"),
        {"a": _f32([2, 3], 0), "__metadata__": {"format": "pt"}},
        bytes(24),
    )
    assert check_safetensors_header(ok) == 1


@pytest.mark.parametrize(
    ("header", "data", "length", "rule"),
    [
        (b"{}", b"", 1 << 63, "exceeds"),  # the 45-byte classic: a length of 2**63
        (b"{}", b"", 1000, "runs past the file"),
        (b"\xff\xfe not json", b"", None, "not JSON"),
        ([1, 2], b"", None, "not a JSON object"),
        (
            {"a": {"dtype": "F4", "shape": [1], "data_offsets": [0, 1]}},
            b"\0",
            None,
            "unknown dtype",
        ),
        (
            {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
            bytes(4),
            None,
            "non-negative",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1] * 9, "data_offsets": [0, 4]}},
            bytes(4),
            None,
            "at most 8",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}},
            bytes(4),
            None,
            "[begin, end]",
        ),
        ({"a": _f32([1 << 40], 0)}, bytes(16), None, "outside"),  # claims 4 TiB of a 16-byte file
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}},
            bytes(16),
            None,
            "needs 16",
        ),
        ({"a": _f32([2], 0), "b": _f32([2], 4)}, bytes(16), None, "overlap"),
        ({"__metadata__": {"k": 1}}, b"", None, "strings to strings"),
        ({"a": "not an object"}, b"", None, "not an object"),
    ],
)
def test_hostile_headers_are_refused_naming_the_rule(
    tmp_path: Path, header: object, data: bytes, length: int | None, rule: str
) -> None:
    path = _file(tmp_path / "bad.safetensors", header, data, length=length)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=r"bad\.safetensors") as err:
            check_safetensors_header(path)
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rule in str(err.value)
    assert seconds < 1.0 and peak < 100 << 20


def test_the_tensor_count_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(safetensors_header, "MAX_TENSORS", 2)
    header = {name: _f32([1], 4 * i) for i, name in enumerate("abc")}
    with pytest.raises(ValueError, match="more than 2 tensors"):
        check_safetensors_header(_file(tmp_path / "many.safetensors", header, bytes(12)))


def test_the_loader_checks_every_shard_before_reading_it(hf_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    _file(bad / "model.safetensors", {"w": _f32([1 << 40], 0)}, bytes(16))
    with pytest.raises(ValueError, match="outside the 16-byte data section"):
        load_hf_directory(bad)


def test_an_index_names_only_files_of_its_directory(hf_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "traversal"
    shutil.copytree(hf_dir, bad)
    (bad / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../../etc/passwd"}})
    )
    with pytest.raises(ValueError, match="not a file of"):
        load_hf_directory(bad)


def _config(model: Path | str, **changes: object) -> ExecutorConfig:
    values: dict[str, object] = {
        "model": str(model),
        "device": "cpu",
        "max_reqs": 4,
        "kv_slots": 256,
        "max_context_len": 128,
        "dtype": "float32",
        "graph_mode": "none",
    }
    values.update(changes)
    return ExecutorConfig(**values)  # type: ignore[arg-type]


def test_the_digest_of_a_directory_is_sha256sum_of_its_sorted_lines(hf_dir: Path) -> None:
    names = sorted(
        p.name for p in hf_dir.iterdir() if p.name == "config.json" or ".safetensors" in p.name
    )
    lines = "".join(
        f"{hashlib.sha256((hf_dir / n).read_bytes()).hexdigest()}  {n}\n" for n in names
    )
    assert model_sha256(hf_dir) == hashlib.sha256(lines.encode()).hexdigest()
    if shutil.which("sha256sum") and shutil.which("sh"):  # the documented shell command
        out = subprocess.run(
            ["sh", "-c", "sha256sum config.json *.safetensors* | LC_ALL=C sort -k2 | sha256sum"],
            cwd=hf_dir, capture_output=True, text=True, check=True,
        ).stdout.split()[0]  # fmt: skip
        assert out == model_sha256(hf_dir)
    f = hf_dir / "model.safetensors"
    assert model_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()


def test_a_pinned_digest_loads_the_pinned_files_and_refuses_others(
    hf_dir: Path, tmp_path: Path
) -> None:
    pinned = model_sha256(hf_dir)
    ex = ModelExecutor(_config(hf_dir, model_sha256=pinned))
    assert ex.info.vocab_size == TINY_CONFIGS["tiny-random"].vocab_size
    changed = tmp_path / "changed"
    shutil.copytree(hf_dir, changed)
    config = json.loads((changed / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5 if config.get("rms_norm_eps") != 1e-5 else 1e-6
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"not the pinned model_sha256 {pinned}"):
        ModelExecutor(_config(changed, model_sha256=pinned))
    with pytest.raises(ValueError, match="has none"):
        ModelExecutor(_config("tiny-random", model_sha256=pinned))
    with pytest.raises(ValueError, match="64 lowercase hex"):
        _config(hf_dir, model_sha256="ABC")


def test_an_unpinned_load_does_not_hash(hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from executor.models import model_digest

    def refuse(path: Path) -> str:
        raise AssertionError("hashed without a pin")

    monkeypatch.setattr(model_digest, "_file_sha256", refuse)
    assert ModelExecutor(_config(hf_dir)).info.vocab_size > 0
