"""The Prometheus set-up fails loudly, with the reason, when it cannot install promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import tests.prometheus_tools as tools


def _no_binaries(monkeypatch: pytest.MonkeyPatch, *, sudo: bool) -> None:
    real = tools.shutil.which
    hidden = {"promtool", "prometheus"} | (set() if sudo else {"sudo"})
    monkeypatch.setattr(tools.shutil, "which", lambda name: None if name in hidden else real(name))


def test_without_root_or_sudo_it_says_what_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_binaries(monkeypatch, sudo=False)
    monkeypatch.setattr(tools.os, "geteuid", lambda: 1000)
    with pytest.raises(tools.PrometheusUnavailable, match="needs root"):
        tools.ensure_prometheus()


def test_a_failing_apt_is_reported_and_the_service_hook_removed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tools.os, "geteuid", lambda: 0)
    # Only apt-get exists: no promtool, no prometheus.
    monkeypatch.setattr(
        tools.shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None
    )
    hook = tmp_path / "policy-rc.d"
    monkeypatch.setattr(tools, "POLICY_RC_D", hook)
    calls: list[list[str]] = []

    def apt(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        assert hook.read_text().strip().endswith("exit 101")  # no service starts meanwhile
        if cmd[1] == "update":
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package prometheus")

    monkeypatch.setattr(tools, "_run", apt)
    with pytest.raises(
        tools.PrometheusUnavailable, match=r"install prometheus failed:\n.*Unable to locate"
    ):
        tools.ensure_prometheus()
    assert [c[:2] for c in calls] == [
        ["apt-get", "install"],
        ["apt-get", "update"],
        ["apt-get", "install"],
    ]
    assert "--no-install-recommends" in calls[0]
    assert not hook.exists()
