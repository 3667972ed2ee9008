"""A server that loads what its compile worker compiled keeps inductor's own processes away
from its steps (issue 36): the vector-ISA probes run first, at start-up; a load preprocesses
no precompiled header."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config
from torch._inductor import cpu_vec_isa

from executor.graphs import compile_cache
from executor.graphs.compile_cache import loading_compiled, probe_vec_isas


def test_a_load_precompiles_no_header_and_the_setting_comes_back() -> None:
    before = inductor_config.cpp_cache_precompile_headers
    with loading_compiled():
        assert inductor_config.cpp_cache_precompile_headers is False
    assert inductor_config.cpp_cache_precompile_headers == before


def test_the_probes_run_once_a_process_and_a_failure_is_only_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probe_vec_isas()  # (this process's, if not run before)
    hits = cpu_vec_isa.valid_vec_isa_list.cache_info().hits
    probe_vec_isas()  # a later load's: from the process's cache, no process started
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().hits == hits + 1

    def broken() -> None:
        raise RuntimeError("no compiler")

    logged: list[str] = []
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", broken)
    monkeypatch.setattr(compile_cache.log, "warning", lambda event, **kw: logged.append(event))
    probe_vec_isas()
    assert logged == ["vector ISA probes failed"]
