"""model-executor: a remote model executor for LLM serving."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("model-executor")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+local"
