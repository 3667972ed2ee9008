"""Configuration precedence: flags > MODEL_EXECUTOR_* environment > TOML file > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.client.cli import build_parser
from executor.config import ExecutorConfig
from executor.service import settings
from executor.service.server_config import ServerConfig


def _serve_args(*argv: str) -> dict:
    return vars(build_parser().parse_args(["serve", *argv]))


def test_flags_beat_env_beat_file_beat_defaults(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(
        '[executor]\nkv_slots = 111\nmax_reqs = 7\nmodel = "tiny-random"\n[server]\nport = 6000\n'
    )
    file_values = settings.load_file(cfg_file)
    env = {
        "MODEL_EXECUTOR_KV_SLOTS": "222",
        "MODEL_EXECUTOR_PORT": "6001",
        "MODEL_EXECUTOR_SEED": "9",
    }
    args = _serve_args("--kv-slots", "333")
    ex = settings.build(ExecutorConfig, args=args, env=env, file_values=file_values["executor"])
    srv = settings.build(ServerConfig, args=args, env=env, file_values=file_values["server"])
    assert ex.kv_slots == 333  # flag
    assert ex.seed == 9  # env
    assert ex.max_reqs == 7 and ex.model == "tiny-random"  # file
    assert ex.max_tokens_per_batch == ExecutorConfig().max_tokens_per_batch  # default
    assert srv.port == 6001  # env beats file


def test_every_field_has_a_flag_and_an_env_var() -> None:
    args = _serve_args()
    assert args.keys() == {"command", "func", "config"}  # unset flags stay absent
    for cls in (ExecutorConfig, ServerConfig):
        for name, flag, env, _default, help_text in settings.describe(cls):
            assert flag == "--" + name.replace("_", "-") and env == "MODEL_EXECUTOR_" + name.upper()
            assert help_text, f"{cls.__name__}.{name} has no help text"


def test_booleans_and_bad_values_are_explained() -> None:
    field = next(f for f in ExecutorConfig.__dataclass_fields__.values() if f.name == "max_reqs")
    with pytest.raises(ValueError, match=r"MODEL_EXECUTOR_MAX_REQS: expected int, got 'many'"):
        settings.build(ExecutorConfig, env={"MODEL_EXECUTOR_MAX_REQS": "many"})
    assert settings.parse_value(field, "12", "x") == 12
    with pytest.raises(ValueError, match="max_reqs must be >= 1"):
        settings.build(ExecutorConfig, args={"max_reqs": "0"})
    with pytest.raises(ValueError, match="unknown keys"):
        settings.build(ExecutorConfig, file_values={"kv_slot": 3})


def test_config_rejects_wrong_types() -> None:
    with pytest.raises(ValueError, match="seed must be int"):
        ExecutorConfig(seed=None)  # type: ignore[arg-type]
