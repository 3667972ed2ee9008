"""Deciding whether batches carry the host `seq_lens` mirror, and the shape bounds they carry."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import pytest
import torch

from attention import TorchNativeBackend, TorchPagedBackend, decide_needs_cpu_seq_lens
from attention.base import AttentionBackend
from executor.batch_prep import (
    complete_batch,
    make_decode_batch,
    make_extend_batch,
    make_idle_batch,
)
from executor.config import ExecutorConfig
from executor.core.buckets import length_bound
from executor.core.names import GraphMode
from executor.model_executor import ModelExecutor
from tests.attention_cases import make_case, make_layout

MakeExecutor = Callable[..., ModelExecutor]


def decide(
    backends: list[AttentionBackend | None], policy: str = "auto", graph_mode: str = "none"
) -> bool:
    return decide_needs_cpu_seq_lens(
        policy, backends, piecewise_mode=GraphMode(graph_mode).piecewise_mode
    )


def _backends() -> tuple[AttentionBackend, AttentionBackend]:
    from executor.core.forward_batch import ForwardMode

    case = make_case(ForwardMode.DECODE, [1], [1], make_layout(4, 2, 32))
    args = (case.layout, case.req_to_token_pool, case.kv_pool)
    return TorchPagedBackend(*args), TorchNativeBackend(*args)


class Undeclared:
    """A backend-like object that does not say whether it reads the mirror."""

    name: ClassVar[str] = "undeclared"


def test_auto_is_false_when_no_backend_needs_the_mirror() -> None:
    paged, _ = _backends()
    assert decide([paged]) is False
    assert decide([paged, None]) is False  # absent ones ignored


def test_auto_is_true_when_any_backend_needs_it() -> None:
    paged, native = _backends()
    assert decide([native]) is True
    assert decide([paged, native]) is True


def test_a_backend_that_does_not_declare_the_flag_counts_as_needing_it() -> None:
    paged, _ = _backends()
    assert decide([paged, Undeclared()]) is True  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("graph_mode", "expected"),
    [("none", False), ("decode", False), ("extend", True), ("both", True)],
)
def test_auto_is_true_when_the_piecewise_path_is_enabled(graph_mode: str, expected: bool) -> None:
    paged, _ = _backends()
    assert decide([paged], graph_mode=graph_mode) is expected


def test_on_forces_the_mirror() -> None:
    paged, _ = _backends()
    assert decide([paged], "on") is True


def test_off_drops_the_mirror_where_nothing_needs_it() -> None:
    paged, _ = _backends()
    assert decide([paged], "off") is False


def test_off_is_refused_with_a_backend_that_needs_it() -> None:
    paged, native = _backends()
    with pytest.raises(
        ValueError,
        match="needs_cpu_seq_lens=off, but attention backend 'torch_native' reads seq_lens_cpu",
    ):
        decide([paged, native], "off")


def test_off_is_refused_with_the_piecewise_path() -> None:
    paged, _ = _backends()
    with pytest.raises(ValueError, match="graph_mode='both' enables the piecewise path"):
        decide([paged], "off", "both")


def test_the_executor_decides_at_start_up(make_executor: MakeExecutor) -> None:
    assert make_executor(attention_backend="torch_paged").toggles.needs_cpu_seq_lens is False
    assert make_executor(attention_backend="torch_native").toggles.needs_cpu_seq_lens is True
    assert make_executor(needs_cpu_seq_lens="on").toggles.needs_cpu_seq_lens is True
    with pytest.raises(ValueError, match="needs_cpu_seq_lens=off"):
        make_executor(attention_backend="torch_native", needs_cpu_seq_lens="off")


@pytest.mark.parametrize(
    ("field", "value"),
    [("attention_backend", "flash"), ("graph_mode", "full"), ("needs_cpu_seq_lens", "yes")],
)
def test_config_refuses_unknown_values(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be one of .*got {value!r}"):
        ExecutorConfig(**{field: value})  # type: ignore[arg-type]


# --- what complete_batch fills -------------------------------------------------------------


def test_without_the_mirror_batches_carry_none() -> None:
    fb = make_decode_batch(
        input_ids=[1, 2], req_pool_indices=[1, 2], seq_lens=[5, 9], out_cache_loc=[3, 4]
    )
    off = complete_batch(fb, needs_cpu_seq_lens=False, max_context_len=64)
    assert off.seq_lens_cpu is None and off.seq_lens_sum is None
    on = complete_batch(fb, needs_cpu_seq_lens=True, max_context_len=64)
    assert on.seq_lens_cpu is not None and on.seq_lens_cpu.tolist() == [5, 9]
    assert on.seq_lens_sum == 14


def test_length_bound_rounds_up_to_an_eighth_of_an_octave_capped() -> None:
    cases = {1: 1, 2: 2, 3: 3, 16: 16, 17: 18, 33: 36, 64: 64, 65: 72, 129: 144, 513: 576}
    assert {n: length_bound(n, 10_000) for n in cases} == cases
    assert length_bound(1000, 1000) == 1000 and length_bound(999, 1000) == 1000
    for n in range(1, 5000):
        bound = length_bound(n, 10_000)
        assert n <= bound <= max(n + 1, n * 9 // 8 + 1), n  # at most 12.5% padding
    assert len({length_bound(n, 8192) for n in range(1, 8193)}) <= 8 * 13 + 16


def test_complete_batch_records_shape_bounds_either_way() -> None:
    extend = make_extend_batch(
        input_ids=[[1] * 3, [2] * 20],
        req_pool_indices=[1, 2],
        out_cache_loc=[[1, 2, 3], list(range(4, 24))],
        prefix_lens=[40, 0],
    )
    for needs in (False, True):
        fb = complete_batch(extend, needs_cpu_seq_lens=needs, max_context_len=50)
        assert fb.seq_len_bound == 44  # max 43 -> 44 (steps of 4 between 32 and 64)
        assert fb.extend_len_bound == 20
        capped = complete_batch(extend, needs_cpu_seq_lens=needs, max_context_len=43)
        assert capped.seq_len_bound == 43
    decode = make_decode_batch(
        input_ids=[1], req_pool_indices=[1], seq_lens=[17], out_cache_loc=[5]
    )
    fb = complete_batch(decode, needs_cpu_seq_lens=False, max_context_len=64)
    assert fb.seq_len_bound == 18 and fb.extend_len_bound is None
    idle = complete_batch(make_idle_batch(), needs_cpu_seq_lens=False, max_context_len=64)
    assert idle.seq_len_bound is None and idle.extend_len_bound is None
    assert torch.equal(fb.seq_lens, torch.tensor([17]))
