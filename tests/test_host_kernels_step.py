"""The host kernels in the step (`ops/host_kernels.py`): the pipelined step's admission and
staging call them, and a run through the Python paths ends in the same state."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from executor.batch_prep import complete_batch, make_decode_batch, make_extend_batch
from executor.core.forward_batch import LogprobsMode, SamplingBatch, SamplingParams
from ops import host_kernels
from ops.h2d_staging import H2DStaging

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> host_kernels.HostKernels:
    loaded = host_kernels.load(tmp_path_factory.mktemp("host-kernels"))
    assert isinstance(loaded, host_kernels.HostKernels), loaded
    return loaded


KERNEL_CALLS = ("check_decode", "decode_fields", "decode_cells", "owners_apply", "sampling", "pack")


def _pipelined_steps(ex: Any) -> tuple[list[list[Any]], list[np.ndarray]]:
    """A prefill, then DECODE steps as the pipelined device worker runs them (the next batch
    admitted and staged while one is on the device): mixed, processed-logprob and all-greedy
    sampling. Each step's tokens and logprobs, then the row table and the owner map."""
    from executor.core.clock import StepClock

    hot = SamplingParams(temperature=0.8, top_k=3, seed=7)
    processed = SamplingParams(logprobs_mode=LogprobsMode.PROCESSED)
    prefill = make_extend_batch(
        input_ids=[[3, 4, 5], [6, 7]],
        req_pool_indices=[1, 2],
        out_cache_loc=[[1, 2, 3], [4, 5]],
        sampling=[processed, hot],
        return_logprob=True,
        top_logprobs_num=2,
    )
    outs = [ex.forward(prefill)]
    a = make_decode_batch(
        input_ids=[8, 9], req_pool_indices=[1, 2], seq_lens=[4, 3], out_cache_loc=[6, 7],
        sampling=[hot, processed], return_logprob=True, top_logprobs_num=2,
    )  # fmt: skip
    b = make_decode_batch(input_ids=[10, 11], req_pool_indices=[1, 2], seq_lens=[5, 4],
                          out_cache_loc=[8, 9])  # fmt: skip
    sa = ex.prepare(a, StepClock())
    ex.launch(sa)
    sb = ex.prepare(b, StepClock())  # admitted against the state `a` leaves
    ex.launch(sb)
    outs += [ex.finish(sa), ex.finish(sb)]
    steps = [
        [o.next_token_ids.tolist(), o.next_token_logprobs, o.top_logprob_ids, o.top_logprobs]
        for o in outs
    ]
    pool = ex.req_to_token_pool
    state = [pool.req_to_token.numpy().copy(), pool.resident_lens.copy()]
    if pool.owners is not None:
        state += [pool.owners.table.copy(), pool.owners.refs.copy()]
    return steps, state


def test_the_pipelined_step_calls_the_kernels_and_agrees_with_its_python_paths(
    kernel: host_kernels.HostKernels,
    monkeypatch: pytest.MonkeyPatch,
    make_executor: Callable[..., Any],
) -> None:
    """The step's admission (the batch rules, derived fields, sampling plan, row table and
    owner map) and its one staged upload go through the kernels, and a run through the
    Python paths ends in the same tokens, logprobs, row table and owner map."""
    calls = dict.fromkeys(KERNEL_CALLS, 0)
    for name in KERNEL_CALLS:
        fn = getattr(kernel, name)

        def counted(*args: Any, _fn: Any = fn, _name: str = name) -> Any:
            calls[_name] += 1
            return _fn(*args)

        monkeypatch.setattr(kernel, name, counted)
    with_kernels = _pipelined_steps(make_executor(pipeline_steps="on"))
    assert all(calls.values()), calls
    with host_kernels.disabled():
        python = _pipelined_steps(make_executor(pipeline_steps="on"))
    for got, want in zip(with_kernels[0], python[0], strict=True):
        for x, y in zip(got, want, strict=True):
            assert x == y if not isinstance(x, torch.Tensor) else torch.equal(x, y)
    for x, y in zip(with_kernels[1], python[1], strict=True):
        assert np.array_equal(x, y)


def test_the_shared_greedy_parameters_are_not_staged(kernel: host_kernels.HostKernels) -> None:
    """A batch without sampling parameters shares `SamplingBatch.greedy(bs)`: the step uploads
    none of it, and its device batch gets the device's own all-greedy copy (every field)."""
    fb = complete_batch(
        make_decode_batch(
            input_ids=[3, 3], req_pool_indices=[1, 2], seq_lens=[4, 3], out_cache_loc=[6, 7]
        ),
        needs_cpu_seq_lens=False,
        max_context_len=16,
    )
    assert fb.sampling is SamplingBatch.greedy(2) and fb.sampling.is_shared_greedy()
    fields = fb.staged_fields()
    assert not any(f.name.startswith("sampling.") for f in fields)
    device = fb.on_device(H2DStaging(CPU).stage(fields))
    s = device.sampling
    assert s is not None and not s.is_shared_greedy()
    for f in dataclasses.fields(SamplingBatch):
        assert torch.equal(getattr(s, f.name), getattr(SamplingBatch.greedy(2), f.name)), f.name
    hot = dataclasses.replace(
        fb, sampling=SamplingBatch.from_params([SamplingParams(temperature=0.5)], 2)
    )
    staged = [f.name for f in hot.staged_fields() if f.name.startswith("sampling.")]
    assert len(staged) == len(dataclasses.fields(SamplingBatch))
    assert hot.on_device(H2DStaging(CPU).stage(hot.staged_fields())).sampling is not None
