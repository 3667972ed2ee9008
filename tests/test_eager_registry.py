"""The eager path's input registry, against the no-copy path.

The registry path fills the step's staged upload into the eager registries' own buffers
(`eager_decode` / `eager_extend`) and runs the model on them; the no-copy path runs the model
on the staged upload itself. Two tiny-random executors take the same stream of random,
valid batches, one per path: every step must agree bit for bit, in next tokens and in
logits. Data pointers and fill statistics tell the two paths apart.
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
from executor.core.forward_batch import ForwardBatch
from executor.core.names import EAGER_DECODE, EAGER_EXTEND
from executor.model_executor import ModelExecutor
from ops.h2d_staging import StagedField
from registry import FillStats
from tests.random_batches import BatchGenerator

MakeExecutor = Callable[..., ModelExecutor]


@pytest.mark.slow
def test_200_random_batches_are_bit_identical_on_the_registry_and_no_copy_paths(
    make_executor: MakeExecutor,
) -> None:
    staged = make_executor(kv_slots=4096)
    direct = make_executor(kv_slots=4096, eager_input_no_copy=True)
    gen = BatchGenerator(seed=4, limits=staged.limits)
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
            # One upload on either path; the registry path adds its own grouped copy.
            assert (a.stats.h2d_copies, b.stats.h2d_copies) == (1, 1), where
            assert a.stats.fill_copy_calls >= 1 and b.stats.fill_copy_calls == 0, where
    # The stream covered what it claims to cover.
    for kind in ("idle", "decode", "extend", "fresh", "chunk", "shared_prefix", "input_embeds"):
        assert gen.kinds[kind] > 0, (kind, gen.kinds)


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
    # torch_native's host mirror seq_lens_cpu is carried from the batch, never copied.
    [("torch_native", 5), ("torch_paged", 5)],
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
    # + req_pool_indices and seq_lens, in the same one staged copy.
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


def test_the_registry_path_reads_registry_views_and_carries_what_it_does_not_hold(
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
    view = seen[0]
    registry = ex.runner.eager_inputs.extend.registry
    assert registry is not None
    assert view is not fb and fb.attn_metadata is None  # the caller's batch is not mutated
    # A registered field the batch lacks is carried as None, never a stale buffer.
    assert view.input_ids is None
    # Registered fields are the registry's buffers, holding the batch's values.
    for name in ("positions", "out_cache_loc"):
        buf = registry.get_slot(name).require_buffer()
        assert getattr(view, name).data_ptr() == buf.data_ptr(), name
        assert torch.equal(getattr(view, name), getattr(fb, name)), name
    # The computed slot is exposed; unregistered fields are the batch's own tensors.
    assert view.num_token_non_padded is not None and view.num_token_non_padded.item() == 3
    assert view.input_embeds is fb.input_embeds and view.extend_seq_lens is fb.extend_seq_lens
    assert out.fill_registry == EAGER_EXTEND and out.fill_stats.tensors_copied == 2  # no ids

    ex.toggles.eager_input_no_copy = True
    out = ex.runner.forward(fb)
    assert seen[1] is fb and fb.attn_metadata is None
    assert (out.fill_registry, out.fill_stats) == (None, FillStats())


@pytest.mark.parametrize("no_copy", [False, True])
def test_data_pointers_tell_the_registry_path_from_the_no_copy_path(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch, no_copy: bool
) -> None:
    """Registry path: the model reads the registry's buffers, filled by one grouped copy
    from the staged upload. No-copy: it reads the staged upload, and no fill is counted."""
    ex = make_executor(attention_backend="torch_native", eager_input_no_copy=no_copy)
    staged: list[dict[str, torch.Tensor]] = []
    read: list[ForwardBatch] = []
    real_stage, real_metadata = ex.step.staging.stage, ex.attn_backend.init_forward_metadata

    def stage(fields: list[StagedField]) -> tuple[torch.Tensor, ...]:
        views = real_stage(fields)
        staged.append({f.name: v for f, v in zip(fields, views, strict=True)})
        return views

    def metadata(fb: ForwardBatch) -> object:
        read.append(fb)
        return real_metadata(fb)

    monkeypatch.setattr(ex.step.staging, "stage", stage)
    monkeypatch.setattr(ex.attn_backend, "init_forward_metadata", metadata)
    _prefill(ex, [1, 2], [3, 2])
    s = ex.forward(_decode_batch([1, 2], [4, 3], first_slot=100)).stats
    assert [fb.forward_mode.name for fb in read] == ["EXTEND", "DECODE"]
    names = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")
    decode = ex.runner.eager_inputs.decode.registry
    for name in names:
        ptr = read[1].__dict__[name].data_ptr()
        assert (ptr == staged[1][name].data_ptr()) is no_copy, name
        if not no_copy:
            assert decode is not None
            assert ptr == decode.get_slot(name).require_buffer().data_ptr(), name
    assert (s.h2d_copies, s.h2d_syncs) == (1, 0)
    if no_copy:
        assert (s.path, s.fill_registry, s.fill_tensors, s.fill_copy_calls) == (
            "eager_no_copy",
            None,
            0,
            0,
        )
        assert decode is None  # never built
    else:
        assert (s.path, s.fill_registry, s.fill_copy_calls) == ("eager", EAGER_DECODE, 1)
        assert (s.fill_tensors, s.fill_bytes) == (5, 5 * 2 * 8)


def test_the_registries_grow_by_powers_of_two_and_keep_their_buffers(
    make_executor: MakeExecutor,
) -> None:
    ex = make_executor()
    inputs = ex.runner.eager_inputs
    assert inputs.decode.capacity == inputs.extend.capacity == (0, 0)
    _prefill(ex, [1, 2, 3], [3, 2, 4])
    assert inputs.extend.capacity == (4, 16)
    ex.forward(_decode_batch([1, 2, 3], [4, 3, 5], first_slot=100))
    assert inputs.decode.capacity == (4, 4)
    decode = inputs.decode.registry
    assert decode is not None
    assert decode.slot_names() == [
        "input_ids",
        "positions",
        "out_cache_loc",
        "req_pool_indices",
        "seq_lens",
        "num_token_non_padded",
    ]
    ptr = decode.get_slot("input_ids").require_buffer().data_ptr()
    ex.forward(_decode_batch([1, 2], [5, 4], first_slot=110))  # fits: the same buffers
    assert inputs.decode.registry is decode
    assert decode.get_slot("input_ids").require_buffer().data_ptr() == ptr
    _prefill(ex, [4, 5, 6, 7, 8], [1, 1, 1, 1, 1])
    ex.forward(_decode_batch([4, 5, 6, 7, 8], [2] * 5, first_slot=120))
    assert inputs.decode.capacity == (8, 8) and inputs.decode.registry is not decode


def test_needs_cpu_seq_lens_decides_whether_the_batch_carries_the_host_mirror(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = make_executor(attention_backend="torch_paged")
    read: list[ForwardBatch] = []
    real = ex.attn_backend.init_forward_metadata
    monkeypatch.setattr(
        ex.attn_backend, "init_forward_metadata", lambda fb: read.append(fb) or real(fb)
    )
    _prefill(ex, [1, 2], [2, 3])
    s = ex.forward(_decode_batch([1, 2], [3, 4], first_slot=10)).stats
    assert read[-1].seq_lens_cpu is None and s.fill_tensors == 5
    ex.control.set_needs_cpu_seq_lens("on")  # a runtime change reaches the next batch
    s = ex.forward(_decode_batch([1, 2], [4, 5], first_slot=20)).stats
    mirror = read[-1].seq_lens_cpu
    assert mirror is not None and mirror.tolist() == [4, 5]
    assert s.fill_tensors == 5  # carried from the host batch, not copied


def test_idle_steps_stage_nothing(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    out = ex.runner.forward(
        complete_batch(make_idle_batch(), needs_cpu_seq_lens=True, max_context_len=1024)
    )
    assert out.logits.shape[0] == 0 and out.fill_registry is None
