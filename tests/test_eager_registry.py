"""The eager path through the input registry, against the no-copy path (the previous eager).

Two tiny-random executors take the same stream of random, valid batches; one stages through
the eager registries, the other runs on the batch's own tensors. Every step must agree bit
for bit, in next tokens and in logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from executor.batch_prep import (
    complete_batch,
    make_decode_batch,
    make_extend_batch,
    make_idle_batch,
)
from executor.eager_inputs import EAGER_DECODE, EAGER_EXTEND, EagerInputs, next_power_of_2
from executor.forward_batch import ForwardBatch
from executor.model_executor import ModelExecutor
from executor.step.paths import GraphMode, SeqLensPolicy
from executor.step.toggles import Toggles
from tests.random_batches import BatchGenerator

MakeExecutor = Callable[..., ModelExecutor]


def test_200_random_batches_are_bit_identical_on_the_registry_and_no_copy_paths(
    make_executor: MakeExecutor,
) -> None:
    staged = make_executor(kv_slots=4096)
    direct = make_executor(kv_slots=4096, eager_input_no_copy=True)
    gen = BatchGenerator(seed=4, limits=staged.limits)
    capacities: set[tuple[str, tuple[int, int]]] = set()
    for step in range(200):
        fb = gen.next_batch(step)
        a = staged.forward(fb, return_logits=True)
        b = direct.forward(fb, return_logits=True)
        where = f"step {step} ({fb.forward_mode.name}, bs={fb.batch_size}, T={fb.num_tokens})"
        assert torch.equal(a.next_token_ids, b.next_token_ids), where
        assert a.logits is not None and b.logits is not None
        assert torch.equal(a.logits, b.logits), where
        assert (a.stats.path, b.stats.path) == ("eager", "eager_no_copy"), where
        assert b.stats.fill_registry is None and b.stats.fill_tensors == 0, where
        if not fb.forward_mode.is_idle():
            gen.observe(fb, a.next_token_ids)
        inputs = staged.runner.eager_inputs
        capacities |= {(c.name, c.capacity) for c in (inputs.decode, inputs.extend)}
    # The stream covered what it claims to cover.
    for kind in ("idle", "decode", "extend", "fresh", "chunk", "shared_prefix", "input_embeds"):
        assert gen.kinds[kind] > 0, (kind, gen.kinds)
    inputs = staged.runner.eager_inputs
    assert inputs.decode.builds >= 3 and inputs.extend.builds >= 3, capacities
    assert inputs.decode.capacity[0] >= 8 and inputs.extend.capacity[1] >= 128
    assert direct.runner.eager_inputs.decode.builds == 0  # no-copy never stages


def _prefill(ex: ModelExecutor, rows: list[int], lens: list[int]) -> list[list[int]]:
    """One EXTEND of fresh prompts; returns the slots each row got."""
    slot, locs = 1 + 64 * min(rows), []
    for n in lens:
        locs.append(list(range(slot, slot + n)))
        slot += n
    ids = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate(lens)]
    ex.forward(make_extend_batch(input_ids=ids, req_pool_indices=rows, out_cache_loc=locs))
    return locs


def _decode_batch(rows: list[int], seq_lens: list[int], first_slot: int) -> ForwardBatch:
    return make_decode_batch(
        input_ids=[5] * len(rows),
        req_pool_indices=rows,
        seq_lens=seq_lens,
        out_cache_loc=list(range(first_slot, first_slot + len(rows))),
    )


@pytest.mark.parametrize(
    ("backend", "decode_tensors"),
    [("torch_native", 6), ("torch_paged", 5)],  # torch_paged needs no seq_lens_cpu mirror
)
def test_step_stats_report_the_path_and_what_the_fill_copied(
    make_executor: MakeExecutor, backend: str, decode_tensors: int
) -> None:
    ex = make_executor(attention_backend=backend)
    fb = make_extend_batch(
        input_ids=[[4, 5, 6], [7, 8]], req_pool_indices=[1, 2], out_cache_loc=[[1, 2, 3], [4, 5]]
    )
    s = ex.forward(fb).stats
    assert (s.path, s.fill_registry) == ("eager", EAGER_EXTEND)
    # input_ids, positions, out_cache_loc: 5 int64 tokens each, one dtype group.
    assert (s.fill_tensors, s.fill_bytes, s.fill_copy_calls) == (3, 3 * 5 * 8, 1)
    s = ex.forward(_decode_batch([1, 2], [4, 3], first_slot=6)).stats
    assert (s.path, s.fill_registry) == ("eager", EAGER_DECODE)
    # + req_pool_indices, seq_lens and (only when it is needed) the host mirror seq_lens_cpu.
    assert (s.fill_tensors, s.fill_bytes, s.fill_copy_calls) == (
        decode_tensors,
        decode_tensors * 2 * 8,
        1,
    )
    s = ex.forward(make_idle_batch()).stats
    assert (s.path, s.fill_registry, s.fill_tensors) == ("eager", None, 0)


def test_the_config_flag_selects_the_no_copy_path(make_executor: MakeExecutor) -> None:
    ex = make_executor(eager_input_no_copy=True)
    assert ex.toggles.eager_input_no_copy is True
    _prefill(ex, [1], [4])
    s = ex.forward(_decode_batch([1], [5], first_slot=200)).stats
    assert (s.path, s.fill_registry, s.fill_tensors, s.fill_bytes) == ("eager_no_copy", None, 0, 0)
    assert ex.runner.eager_inputs.decode.registry is None


def test_toggling_no_copy_between_batches_switches_the_path(make_executor: MakeExecutor) -> None:
    ex, ref = make_executor(), make_executor()
    for e in (ex, ref):
        _prefill(e, [1, 2], [5, 3])
    paths = []
    for i, no_copy in enumerate([False, True, True, False, True]):
        ex.toggles.eager_input_no_copy = no_copy
        fb = _decode_batch([1, 2], [6 + i, 4 + i], first_slot=300 + 2 * i)
        out, want = ex.forward(fb, return_logits=True), ref.forward(fb, return_logits=True)
        paths.append((out.stats.path, out.stats.fill_registry))
        assert torch.equal(out.logits, want.logits)
    staged, direct = ("eager", EAGER_DECODE), ("eager_no_copy", None)
    assert paths == [staged, direct, direct, staged, direct]


def test_the_model_and_attention_read_the_staged_view(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = make_executor()
    seen: list[ForwardBatch] = []
    real = ex.attn_backend.init_forward_metadata

    def spy(fb: ForwardBatch) -> object:
        seen.append(fb)
        return real(fb)

    monkeypatch.setattr(ex.attn_backend, "init_forward_metadata", spy)
    embeds = torch.randn(3, ex.limits.hidden_size)
    host = make_extend_batch(input_ids=[[1, 2, 3]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]])
    host = dataclasses.replace(host, input_ids=None, input_embeds=embeds)
    fb = complete_batch(
        host, needs_cpu_seq_lens=True, max_context_len=ex.limits.max_context_len
    ).to(ex.device)
    out = ex.runner.forward(fb)
    reg = ex.runner.eager_inputs.extend.registry
    assert reg is not None and len(seen) == 1
    view = seen[0]
    for name in ("positions", "out_cache_loc"):
        assert getattr(view, name).data_ptr() == reg.get_slot(name).require_buffer().data_ptr()
    assert view.input_ids is None  # absent this step: carried, never a stale buffer
    assert view.input_embeds is embeds  # not registered for eager: carried by identity
    assert view.extend_seq_lens is fb.extend_seq_lens and view.sampling is fb.sampling
    assert fb.attn_metadata is None  # the caller's batch is not mutated
    assert out.fill_registry == EAGER_EXTEND and out.fill_stats.tensors_copied == 2

    ex.toggles.eager_input_no_copy = True
    ex.runner.forward(fb)
    assert seen[1] is not fb and seen[1].positions is fb.positions


def test_registries_are_rebuilt_at_the_next_power_of_two(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    decode, extend = ex.runner.eager_inputs.decode, ex.runner.eager_inputs.extend
    assert decode.capacity == (0, 0) and extend.capacity == (0, 0)
    rows = list(range(1, 10))
    _prefill(ex, rows[:3], [5, 6, 7])
    assert (extend.capacity, extend.builds) == ((4, 32), 1)
    ex.forward(_decode_batch(rows[:3], [6, 7, 8], first_slot=1000))
    assert (decode.capacity, decode.builds) == ((4, 4), 1)
    first = decode.registry
    ex.forward(_decode_batch(rows[:2], [7, 8], first_slot=1010))  # fits: no rebuild
    assert decode.registry is first and decode.builds == 1
    _prefill(ex, rows[3:9], [1] * 6)  # 6 requests > 4: the bs axis grows
    assert (extend.capacity, extend.builds) == ((8, 32), 2)
    ex.forward(_decode_batch(rows[:9], [8, 9, 9, 2, 2, 2, 2, 2, 2], first_slot=1020))
    assert (decode.capacity, decode.builds) == ((16, 16), 2)
    assert decode.registry is not first
    _prefill(ex, [10], [40])  # 40 tokens > 32: the token axis grows, bs keeps its max
    assert (extend.capacity, extend.builds) == ((8, 64), 3)


def test_needs_cpu_seq_lens_decides_whether_the_host_mirror_is_staged() -> None:
    toggles = Toggles(GraphMode.NONE, SeqLensPolicy.AUTO, False, eager_input_no_copy=False)
    inputs = EagerInputs(torch.device("cpu"), toggles)
    host = _decode_batch([1, 2], [3, 4], first_slot=10)
    fb = complete_batch(host, needs_cpu_seq_lens=False, max_context_len=1024)
    staged = inputs.stage(fb)
    reg = inputs.decode.registry
    assert reg is not None and not reg.has_slot("seq_lens_cpu")
    assert staged.fb.seq_lens_cpu is None and staged.stats.tensors_copied == 5
    toggles.needs_cpu_seq_lens = True  # a runtime change rebuilds the decode registry
    staged = inputs.stage(complete_batch(host, needs_cpu_seq_lens=True, max_context_len=1024))
    reg = inputs.decode.registry
    assert reg is not None and reg.has_slot("seq_lens_cpu")
    assert staged.fb.seq_lens_cpu is not None and staged.fb.seq_lens_cpu.tolist() == [3, 4]
    assert staged.stats.tensors_copied == 6


@pytest.mark.parametrize(("n", "want"), [(0, 1), (1, 1), (2, 2), (3, 4), (64, 64), (65, 128)])
def test_next_power_of_2(n: int, want: int) -> None:
    assert next_power_of_2(n) == want


def test_idle_steps_stage_nothing(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    out = ex.runner.forward(
        complete_batch(make_idle_batch(), needs_cpu_seq_lens=True, max_context_len=1024)
    )
    assert out.logits.shape[0] == 0 and out.fill_registry is None
    assert ex.runner.eager_inputs.decode.registry is None
