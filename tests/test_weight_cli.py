"""The weight and memory subcommands (`model-executor update-weights`, `release-memory`,
`resume-memory`) against a served executor: operator calls, with the runtime-config token."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.client import cli
from executor.client.grpc_client import ExecutorClient
from executor.model_executor import ModelExecutor
from tests.server_util import running_server
from tests.weights_util import config, greedy, new_weights, saved

# Every test here loads an executor or starts a server: over half a second each.
pytestmark = pytest.mark.slow


def test_cli_updates_releases_and_resumes(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = saved(tmp_path, "tiny-random", new_weights())
    want = greedy(ModelExecutor(config(cache_dir, str(source))))
    token = tmp_path / "token"
    token.write_text("operator-secret\n")
    with running_server(config(cache_dir), runtime_config_token_file=str(token)) as srv:
        address = f"127.0.0.1:{srv.port}"
        target = ["--target", address, "--token-file", str(token)]
        update = ["update-weights", *target, "--from", str(source), "--weight-version", "cli"]
        assert cli.main(update) == 0
        assert '"version": "cli"' in capsys.readouterr().out
        with ExecutorClient(address) as client:
            limits = client.info().info.limits
            assert greedy(_Remote(client.forward, limits)) == want
            assert cli.main(["release-memory", *target, "--tags", "kv_cache"]) == 0
            assert '"kv_cache"' in capsys.readouterr().out
            assert client.info().info.memory.released == ("kv_cache",)  # type: ignore[union-attr]
            assert cli.main(["resume-memory", *target]) == 0
            assert '"kv_epoch": 1' in capsys.readouterr().out
            assert client.info().info.weight_version == "cli"  # kv_cache only: weights stay
        assert cli.main(["release-memory", "--target", address, "--token-file", ""]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert srv.executor is not None and srv.executor.weights.memory.released == ()


class _Remote:
    def __init__(self, forward: object, limits: object) -> None:
        self.forward = forward
        self.limits = limits
