"""Prometheus's own binaries for tests: promtool, and a real server on loopback.

`ensure_prometheus()` finds `promtool` and `prometheus` on PATH, or installs Debian's
`prometheus` package with `--no-install-recommends` (as root, or through `sudo -n`) without
starting its service. If that cannot be done it raises `PrometheusUnavailable` with the
reason; the tests turn that into a failure, never a skip.

`running_prometheus()` starts the server on a free loopback port with the scrape configs a
test gives (none: an empty TSDB) and answers queries through its HTTP API.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PACKAGE = "prometheus"
APT_TIMEOUT_S = 900
# Debian's invoke-rc.d asks this hook whether a package's postinst may start its service;
# exit 101 means "no". Written only for the install, only when no hook exists.
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")


class PrometheusUnavailable(RuntimeError):
    """promtool/prometheus are missing and could not be installed."""


@dataclass(frozen=True)
class PrometheusBinaries:
    promtool: str
    prometheus: str


def _find() -> PrometheusBinaries | None:
    promtool, prometheus = shutil.which("promtool"), shutil.which("prometheus")
    if promtool and prometheus:
        return PrometheusBinaries(promtool, prometheus)
    return None


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=APT_TIMEOUT_S, env=env, check=False
    )


def install_prometheus() -> None:
    """apt-get install --no-install-recommends prometheus (apt-get update first if needed)."""
    if shutil.which("apt-get") is None:
        raise PrometheusUnavailable("promtool is not on PATH and there is no apt-get to install it")
    prefix: list[str] = []
    if os.geteuid() != 0:
        if shutil.which("sudo") is None or _run(["sudo", "-n", "true"]).returncode != 0:
            raise PrometheusUnavailable(
                "promtool is not on PATH; installing Debian's prometheus package needs root "
                "(or password-less sudo): run `apt-get install -y --no-install-recommends "
                "prometheus` once"
            )
        prefix = ["sudo", "-n"]
    install = [*prefix, "apt-get", "install", "-y", "--no-install-recommends", PACKAGE]
    wrote_policy = False
    if not prefix and not POLICY_RC_D.exists():
        POLICY_RC_D.write_text("#!/bin/sh\n# written by tests/prometheus_tools.py\nexit 101\n")
        POLICY_RC_D.chmod(0o755)
        wrote_policy = True
    try:
        result = _run(install)
        if result.returncode != 0:  # a fresh machine has no package lists yet
            update = _run([*prefix, "apt-get", "update"])
            if update.returncode != 0:
                raise PrometheusUnavailable(f"apt-get update failed:\n{update.stderr[-2000:]}")
            result = _run(install)
        if result.returncode != 0:
            raise PrometheusUnavailable(
                f"apt-get install {PACKAGE} failed:\n{result.stderr[-2000:]}"
            )
    finally:
        if wrote_policy:
            POLICY_RC_D.unlink(missing_ok=True)


def ensure_prometheus() -> PrometheusBinaries:
    found = _find()
    if found is None:
        install_prometheus()
        found = _find()
    if found is None:
        raise PrometheusUnavailable(
            f"apt-get installed {PACKAGE} but promtool/prometheus are still not on PATH"
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    """A Prometheus process on 127.0.0.1 and a tiny client for its HTTP API."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.process = process
        self.url = url
        self.log = log

    def get(self, path: str, **params: str) -> Any:
        """GET /api/v1/...: the `data` of a success, or an AssertionError with the error."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:  # 400/422: a bad query, with a JSON error body
            body = json.load(e)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> Any:
        """An instant query; raises AssertionError with Prometheus's error if it fails."""
        params = {"query": promql}
        if at is not None:
            params["time"] = str(at)
        return self.get("/api/v1/query", **params)

    def query_range(self, promql: str, start: float, end: float, step: str = "15s") -> Any:
        return self.get(
            "/api/v1/query_range", query=promql, start=str(start), end=str(end), step=step
        )

    def metric_names(self) -> set[str]:
        """Every series name in the TSDB (after scrapes: every name the targets exported)."""
        return set(self.get("/api/v1/label/__name__/values"))

    def targets(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/targets")["activeTargets"])

    def wait_for_scrape(self, job: str, timeout: float = 60.0) -> None:
        """Until every target of `job` has been scraped successfully at least once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mine = [t for t in self.targets() if t["labels"].get("job") == job]
            if mine and all(t["health"] == "up" for t in mine):
                return
            time.sleep(0.5)
        raise TimeoutError(f"job {job!r} was not scraped within {timeout} s: {self.targets()}")


@contextmanager
def running_prometheus(
    binaries: PrometheusBinaries,
    workdir: Path,
    scrape_configs: list[dict[str, Any]] | None = None,
    rule_files: list[Path] | None = None,
    scrape_interval: str = "1s",
    ready_timeout: float = 60.0,
) -> Iterator[PrometheusServer]:
    """Start `prometheus` on a free loopback port; stop it on exit.

    A scrape config is Prometheus's own, e.g.
    `{"job_name": "model-executor", "static_configs": [{"targets": ["127.0.0.1:9464"]}]}`.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": scrape_configs or [],
        "rule_files": [str(p) for p in rule_files or []],
    }
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / "prometheus.log"
    with log.open("wb") as log_fh:
        process = subprocess.Popen(
            [
                binaries.prometheus,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log_fh,
            stderr=subprocess.STDOUT,
        )
    server = PrometheusServer(process, url, log)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {process.returncode}:\n{log.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus was not ready within {ready_timeout} s")
            time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
