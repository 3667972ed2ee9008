"""Files derived from a model file (dequantized weights, tokenizer), keyed by its sha256.

The sha256 is memoized per (path, size, mtime) in `sha256.json`, so a restart does not
hash a multi-gigabyte file again; a changed file gets a new key and a fresh derivation.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def file_sha256(path: Path, cache_dir: Path) -> str:
    """sha256 of `path`, memoized in `cache_dir/sha256.json` by (realpath, size, mtime_ns)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index_path = cache_dir / "sha256.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return str(index[key])
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    index[key] = digest
    atomic_write(index_path, json.dumps(index).encode())
    return digest


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def cache_path(model_file: Path, cache_dir: Path, suffix: str) -> Path:
    """`cache_dir/gguf/<sha256><suffix>` for a file derived from `model_file`."""
    folder = cache_dir / "gguf"
    return folder / f"{file_sha256(model_file, folder)}{suffix}"
