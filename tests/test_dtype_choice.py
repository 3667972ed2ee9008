"""`dtype=auto`: bfloat16 on CUDA and on CPUs with native bfloat16, float32 on other CPUs."""

from __future__ import annotations

import pytest
import torch

from executor import config as config_module
from executor.config import ExecutorConfig, choose_dtype


@pytest.mark.parametrize(
    ("native_bf16", "expected", "reason"),
    [(False, torch.float32, "no native bfloat16"), (True, torch.bfloat16, "has native bfloat16")],
)
def test_auto_dtype_on_cpu_follows_native_bf16(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool, expected: torch.dtype, reason: str
) -> None:
    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: native_bf16)
    choice = choose_dtype(ExecutorConfig(), torch.device("cpu"))
    assert choice.dtype == expected and reason in choice.reason


def test_auto_dtype_on_cuda_and_a_configured_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: False)
    assert choose_dtype(ExecutorConfig(), torch.device("cuda")).dtype == torch.bfloat16
    configured = choose_dtype(ExecutorConfig(dtype="bfloat16"), torch.device("cpu"))
    assert (configured.dtype, configured.reason) == (torch.bfloat16, "configured")


def test_this_machine_is_detected_as_it_is() -> None:
    native = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    assert config_module.cpu_has_native_bf16() is native
