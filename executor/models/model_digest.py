"""The pinned digest of the model files (`model_sha256`): refused at load when they differ.

A model file is code in all but name to the executor (its header sizes allocations, its
weights decide every token), so an operator can pin what was reviewed. The digest is the
sha256 of:
- a single file (a `.gguf`): its bytes, as `sha256sum model.gguf` prints it;
- a Hugging Face directory: the `sha256sum` lines of `config.json` and every `*.safetensors`
  (and the index, when there is one), sorted by name, as
  `cd DIR && sha256sum config.json *.safetensors* | LC_ALL=C sort -k2 | sha256sum` prints it.
The files are hashed in full at every load (about 1-2 GB/s on one core): no memo a writer of
the cache directory could forge.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def model_sha256(path: Path) -> str:
    """The digest of a model file or directory (see the module doc)."""
    if path.is_file():
        return _file_sha256(path)
    names = sorted(
        p.name
        for p in path.iterdir()
        if p.is_file() and (p.name == "config.json" or ".safetensors" in p.name)
    )
    manifest = "".join(f"{_file_sha256(path / name)}  {name}\n" for name in names)
    return hashlib.sha256(manifest.encode()).hexdigest()


def verify_model_digest(path: Path, expected: str) -> None:
    """Nothing when `expected` is "" or matches; ValueError naming both digests otherwise."""
    if not expected:
        return
    actual = model_sha256(path)
    if actual != expected:
        raise ValueError(
            f"model {path} has sha256 {actual}, not the pinned model_sha256 {expected}: "
            "refusing to load files other than the pinned ones"
        )
