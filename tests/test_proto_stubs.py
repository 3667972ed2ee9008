"""The committed Python stubs are exactly what grpcio-tools generates from the .proto."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("executor_pb2.py", "executor_pb2.pyi", "executor_pb2_grpc.py")


def test_stubs_are_not_stale(tmp_path: Path) -> None:
    src = tmp_path / "proto"
    shutil.copytree(
        ROOT / "proto" / "model_executor",
        src / "model_executor",
        ignore=shutil.ignore_patterns("*_pb2*", "__pycache__"),
    )
    args = [
        "protoc",
        f"-I{src}",
        f"--python_out={src}",
        f"--pyi_out={src}",
        f"--grpc_python_out={src}",
        str(src / "model_executor" / "v1" / "executor.proto"),
    ]
    assert protoc.main(args) == 0, "protoc failed"
    for name in GENERATED:
        fresh = (src / "model_executor" / "v1" / name).read_text()
        committed = (ROOT / "proto" / "model_executor" / "v1" / name).read_text()
        assert fresh == committed, (
            f"proto/model_executor/v1/{name} is stale: regenerate it (see proto/README.md)"
        )
    assert sys.modules  # the generated modules import cleanly in this interpreter
    from model_executor.v1 import executor_pb2, executor_pb2_grpc  # noqa: F401
