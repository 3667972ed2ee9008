"""The docs that are an API: the configuration tables and the metric list match the code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from executor.observability.metrics import ExecutorMetrics

ROOT = Path(__file__).resolve().parent.parent


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_configuration", ROOT / "docs" / "gen_configuration.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_md_is_up_to_date() -> None:
    gen = _generator()
    current = (ROOT / "docs" / "configuration.md").read_text()
    assert gen.render(current) == current, (
        "docs/configuration.md is out of date: run python docs/gen_configuration.py"
    )


def test_configuration_md_lists_every_flag_and_env_var() -> None:
    from executor.config import ExecutorConfig
    from executor.service.server_config import ServerConfig
    from executor.service.settings import describe

    text = (ROOT / "docs" / "configuration.md").read_text()
    for cls in (ExecutorConfig, ServerConfig):
        for _name, flag, env, _default, _help in describe(cls):
            assert f"`{flag}`" in text and f"`{env}`" in text


def test_metrics_md_documents_exactly_the_exported_metrics() -> None:
    exported = set()
    for family in ExecutorMetrics().registry.collect():
        exported.add(family.name + "_total" if family.type == "counter" else family.name)
    text = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(model_executor_[a-z0-9_]+)` \|", text, re.M))
    assert documented == exported
    for name in ("model_executor_toggle_eager_input_no_copy", "model_executor_toggle_needs_cpu_seq_lens",
                 "model_executor_toggle_graph_mode_info"):  # fmt: skip
        assert name in exported  # the dashboards and alerts of issue 8 use these names
