"""Fill `.whl/` with the wheels the GPU check needs on a machine with no network.

    python tools/device_wheels.py                        # CPython 3.12 (the GPU machine's)
    python tools/device_wheels.py --python-version 3.11  # for a dry run on this machine

The GPU machine this project is lent has Python, torch, triton, numpy, transformers,
tokenizers, safetensors, pytest and jinja2 preinstalled, and reaches no package index.
`benchmarks/device_check.sh` installs `.whl/*.whl` there with `pip --no-index --target`.
`DEVICE_WHEELS` is what its imports need beyond that image, at the versions
requirements.lock pins (the image's own lock). The folder is emptied first, so it holds one
version of each. The tree that travels to that machine (tracked files plus these wheels)
must stay under `--limit-mib`; the tool states the sizes and fails past it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
# Each package the check imports that the GPU machine's image lacks (or has at an unknown
# version the generated stubs refuse), and why it is needed.
DEVICE_WHEELS = {
    "structlog": "the executor's logs (every executor module)",
    "isal": "the chunks' CRC-32 as the image computes it (ops/checksum.py; zlib's without it)",
    "gguf": "GGUF reading (tests/gguf_writer.py, test_quantized)",
    "grpcio": "the stubs need >= 1.85.1; the image's version is unknown",
    "protobuf": "the stubs need >= 7.35.1; the image's version is unknown",
    "prometheus-client": "the server's metrics (pinned ==)",
    "grpcio-health-checking": "the server's readiness (occupancy stage, test_future_tokens)",
    "grpcio-reflection": "the server",
    "opentelemetry-api": "the server's traces",
    "opentelemetry-sdk": "the server's traces",
    "opentelemetry-exporter-otlp-proto-grpc": "the server's trace exporter",
    "opentelemetry-exporter-otlp-proto-common": "needed by the exporter",
    "opentelemetry-exporter-otlp-common": "needed by the exporter",
    "opentelemetry-proto": "needed by the exporter",
    "opentelemetry-semantic-conventions": "needed by the sdk",
    "googleapis-common-protos": "needed by the exporter",
}
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def pinned_versions(lock: Path = LOCK) -> dict[str, str]:
    """name -> version, from requirements.lock's `name==version` lines."""
    pins = {}
    for line in lock.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.-]+)==([^ \\]+)", line):
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def tracked_bytes() -> int:
    """Bytes of the files git tracks: the rest of what travels to the GPU machine."""
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    return sum(
        (ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file()
    )


def download(specs: list[str], dest: Path, python_version: str) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *platforms,
        "--dest",
        str(dest),
        *specs,
    ]
    subprocess.run(command, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--limit-mib", type=float, default=60.0)
    args = parser.parse_args()
    pins = pinned_versions()
    missing = [n for n in DEVICE_WHEELS if n not in pins]
    if missing:
        raise SystemExit(f"requirements.lock pins no version of {', '.join(missing)}")
    specs = [f"{name}=={pins[name]}" for name in DEVICE_WHEELS]
    args.dest.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dest) as tmp:  # inside the ignored folder
        download(specs, Path(tmp), args.python_version)
        for old in args.dest.glob("*.whl"):
            old.unlink()
        for wheel in sorted(Path(tmp).glob("*.whl")):
            wheel.rename(args.dest / wheel.name)
    wheels = sorted(args.dest.glob("*.whl"))
    if len(wheels) != len(DEVICE_WHEELS):
        raise SystemExit(f"expected {len(DEVICE_WHEELS)} wheels, got {len(wheels)}")
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    tree = tracked_bytes()
    for w in wheels:
        print(f"{w.stat().st_size:>10,}  {w.name}")
    total_mib = (wheel_bytes + tree) / 2**20
    print(
        f"{len(wheels)} wheels for CPython {args.python_version}: {wheel_bytes / 2**20:.2f} MiB; "
        f"tracked tree {tree / 2**20:.2f} MiB; together {total_mib:.2f} MiB "
        f"(limit {args.limit_mib:g} MiB)"
    )
    if total_mib > args.limit_mib:
        print(f"too large: {total_mib:.2f} MiB > {args.limit_mib:g} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
