"""Write requirements.lock: the service's runtime dependencies, pinned, with sha256 hashes.

    python tools/lock_requirements.py            # rewrites requirements.lock (needs PyPI)
    python tools/lock_requirements.py --check    # exit 1 if pyproject.toml has a dependency
                                                 # the lock does not pin

The image (Dockerfile) installs torch first from the PyTorch index (its CUDA or CPU build,
TORCH_VERSION), then `pip install --require-hashes --no-deps -r requirements.lock`, then the
project itself with `--no-deps`: every other distribution in the image is the one locked here,
byte for byte. The lock is resolved by pip itself (`install --dry-run --report`) for the
image's interpreter and platform (CPython 3.12, manylinux x86_64, wheels only), with torch and
triton stood in by empty local wheels of the image's versions: they come from the PyTorch
index, whose files differ per build, so they are pinned by version in the Dockerfile instead.
Their own dependencies (jinja2, sympy, ...) are resolved and locked here like any other.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
PYTHON_VERSION = "3.12"  # ubuntu:24.04 / nvidia/cuda:*-ubuntu24.04's python3
PLATFORMS = (
    "manylinux_2_39_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# Installed from the PyTorch index by the Dockerfile, not from this lock: (version, requires).
STAND_INS = {
    "torch": (
        "2.13.0",
        [
            "filelock",
            "typing-extensions>=4.10.0",
            "setuptools>=77.0.3",
            "sympy>=1.13.3",
            "networkx>=2.5.1",
            "jinja2",
            "fsspec>=0.8.5",
        ],
    ),
    "triton": ("3.9.0", []),
}


STAND_IN = "lockstandin"  # the local version label of the stand-in wheels


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements() -> list[str]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"cannot read a name from {requirement!r}")
    return normalize(match.group(1))


def locked() -> dict[str, str]:
    """name -> version of every pin in requirements.lock."""
    pins = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", LOCK.read_text(), re.M)
    return {normalize(name): version for name, version in pins}


def missing_from_lock() -> list[str]:
    """pyproject runtime dependencies the lock does not pin (torch is the Dockerfile's)."""
    pins = locked()
    return [
        r
        for r in runtime_requirements()
        if requirement_name(r) not in pins | dict.fromkeys(STAND_INS)
    ]


def _stand_in_wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    dist = f"{name}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as whl:
        meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        meta += [f"Requires-Dist: {r}" for r in requires]
        whl.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n")
        whl.writestr(
            f"{dist}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: lock\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        whl.writestr(f"{dist}.dist-info/RECORD", "")


def resolve() -> list[tuple[str, str, str]]:
    """(name, version, sha256) of every distribution pip picks, stand-ins left out."""
    with tempfile.TemporaryDirectory() as tmp:
        stand_ins = Path(tmp) / "stand-ins"
        stand_ins.mkdir()
        for name, (version, requires) in STAND_INS.items():
            _stand_in_wheel(stand_ins, name, f"{version}+{STAND_IN}", requires)
        # The stand-ins by their local version: PyPI's own torch 2.13.0 must not be picked.
        pins = [f"{n}=={v}+{STAND_IN}" for n, (v, _) in STAND_INS.items()]
        report = Path(tmp) / "report.json"
        command = [
            sys.executable, "-m", "pip", "--isolated", "install", "--dry-run",
            "--ignore-installed", "--quiet", "--no-cache-dir",
            "--index-url", "https://pypi.org/simple", "--find-links", str(stand_ins),
            "--python-version", PYTHON_VERSION, "--implementation", "cp",
            *[arg for p in PLATFORMS for arg in ("--platform", p)],
            "--only-binary=:all:", "--target", str(Path(tmp) / "unused"),
            "--report", str(report), *pins,
            *[r for r in runtime_requirements() if requirement_name(r) not in STAND_INS],
        ]  # fmt: skip
        subprocess.run(command, check=True)
        items = json.loads(report.read_text())["install"]
    out = []
    for item in items:
        name = normalize(item["metadata"]["name"])
        if name in STAND_INS:
            continue
        hashes = item["download_info"]["archive_info"].get("hashes") or {}
        digest = hashes.get("sha256") or item["download_info"]["archive_info"]["hash"].split("=")[1]
        out.append((name, item["metadata"]["version"], digest))
    return sorted(out)


def write(pins: list[tuple[str, str, str]]) -> None:
    lines = [
        "# The service's runtime dependencies, pinned with hashes, for the image (Dockerfile):",
        f"# CPython {PYTHON_VERSION}, manylinux x86_64. Generated by tools/lock_requirements.py;",
        "# do not edit. torch and triton come from the PyTorch index (Dockerfile TORCH_VERSION).",
    ]
    for name, version, digest in pins:
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{digest}")
    LOCK.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the lock's coverage")
    args = parser.parse_args()
    if not args.check:
        write(resolve())
    missing = missing_from_lock()
    if missing:
        print(f"requirements.lock does not pin: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"{LOCK.name}: {len(locked())} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
