"""Every combination of settings serves a greedy generation or is refused at start-up, never
after "ready" (issue 36): a covering subset here, the whole product in
`benchmarks/settings_matrix.py`. The graph backends that compile are left to it (and to
`tests/test_compiled_graphs.py`, `tests/test_auto_choices.py`): what start-up decides does not
depend on the compile, and the stand-in captures in milliseconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.settings_matrix import AXES, Outcome, pairwise, try_combination, try_combination_tp

SETTING_NAMES = tuple(AXES) + ("device", "model", "tp_size", "quant_kernel")


def _check(outcome: Outcome) -> None:
    assert outcome.kind != "failed", str(outcome)
    if outcome.kind == "refused":  # one message that names what does not go together
        assert any(name in outcome.detail for name in SETTING_NAMES), str(outcome)


@pytest.mark.slow
def test_a_covering_set_of_combinations_serves_or_is_refused_at_start_up(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cache = tmp_path_factory.mktemp("matrix")
    axes = {**AXES, "graph_backend": ("standin", "cuda")}
    combinations = pairwise(axes)
    assert len(combinations) <= 30
    outcomes = [try_combination(c, cache) for c in combinations]
    for outcome in outcomes:
        _check(outcome)
    kinds = {o.kind for o in outcomes}
    assert kinds == {"served", "refused"}, [str(o) for o in outcomes]


@pytest.mark.parametrize(
    "combination",
    [
        # The default on a CPU with a backend that cannot be captured: auto is none (it
        # used to pick decode graphs and fail at start-up).
        pytest.param({"attention_backend": "torch_native"}, marks=pytest.mark.slow),
        {"attention_backend": "torch_native", "graph_mode": "decode"},  # refused, both named
    ],
)
def test_torch_native_at_default_settings_serves(
    tmp_path: Path, combination: dict[str, str]
) -> None:
    outcome = try_combination(combination, tmp_path)
    _check(outcome)
    if "graph_mode" in combination:
        assert outcome.kind == "refused"
        assert "graph_mode=decode and attention_backend=torch_native" in outcome.detail
    else:
        assert (outcome.kind, outcome.detail) == ("served", "graph_mode=none")


@pytest.mark.slow
def test_auto_settings_at_tp2_serve(tmp_path: Path) -> None:
    """tp 2 at default settings (spawned ranks): the auto choices start on every rank."""
    outcome = try_combination_tp({}, tmp_path, tp_size=2)
    _check(outcome)
    assert outcome.kind == "served", str(outcome)
