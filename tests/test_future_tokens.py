"""Future-token references (overlap scheduling): the op, the table's rules, every path, and
the overlap scheduler's output against the plain one, in-process and over ForwardStream."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.client.allocator import FutureSlotAllocator, OutOfCapacityError
from executor.client.grpc_client import ExecutorClient
from executor.client.pipes import InlinePipe
from executor.client.scheduler import generate
from executor.config import ExecutorConfig
from executor.core.errors import BatchValidationError, FaultInjector, InjectedFault
from executor.core.forward_batch import ForwardBatch, SamplingParams
from executor.core.outputs import ForwardOutput
from executor.graphs.capture_rules import HostReadGuard
from executor.model_executor import ModelExecutor
from executor.service.codec import batch_from_proto, batch_to_proto
from ops.future_tokens import (
    resolve_future_tokens,
    resolve_future_tokens_reference,
    store_future_tokens,
)
from tests.server_util import Scrape, running_server, tiny_config

MakeExecutor = Callable[..., ModelExecutor]
T = torch.tensor

# graph_mode / eager_input_no_copy of each path, and the path a DECODE step then takes.
PATHS = {
    "eager": ({"graph_mode": "none"}, "eager"),
    "eager_no_copy": ({"graph_mode": "none", "eager_input_no_copy": True}, "eager_no_copy"),
    # One KV-length bucket (max_context_len 256): one capture per batch-size bucket.
    "full_graph": (
        {"graph_mode": "decode", "graph_batch_sizes": "4", "max_context_len": 256},
        "full_graph",
    ),
    "piecewise": ({"graph_mode": "extend", "piecewise_token_sizes": "8"}, "piecewise"),
}
PROMPTS = [[3, 4, 5, 6, 7], [9, 10, 11], [20] * 12]


# --- the op ------------------------------------------------------------------------------------
def test_resolve_matches_the_reference_and_keeps_its_input() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 500, (9,), generator=gen)
    table[0] = 0
    ids = torch.randint(-8, 500, (64,), generator=gen)
    before = ids.clone()
    out = resolve_future_tokens(ids, table)
    assert out.tolist() == resolve_future_tokens_reference(ids.tolist(), table.tolist())
    assert torch.equal(ids, before)  # a new tensor: the batch's own ids are never written
    assert (out >= 0).all()


def test_store_writes_only_the_named_slots() -> None:
    table = torch.zeros(6, dtype=torch.int64)
    store_future_tokens(table, T([4, 1]), T([77, 88], dtype=torch.int32))
    assert table.tolist() == [0, 88, 0, 0, 77, 0]


def test_the_slot_allocator_hands_back_released_slots_with_the_next_batch() -> None:
    alloc = FutureSlotAllocator(3)
    assert alloc.alloc(2) == [1, 2]
    alloc.release([1])
    assert alloc.free == 1 and alloc.has_released
    assert alloc.take_released() == [1] and not alloc.has_released
    assert alloc.alloc(2) == [1, 3]
    with pytest.raises(OutOfCapacityError, match="--future-slots"):
        alloc.alloc(1)
    with pytest.raises(ValueError, match="no future-token slots"):
        FutureSlotAllocator(0)


# --- every path resolves references exactly --------------------------------------------------
def _prefill(ex: ModelExecutor, slots: list[int]) -> list[int]:
    """Rows 1..2 prefilled, their first tokens stored in `slots`; the tokens."""
    out = ex.forward(
        dataclasses.replace(
            make_extend_batch(
                input_ids=PROMPTS[:2],
                req_pool_indices=[1, 2],
                out_cache_loc=[[1, 2, 3, 4, 5], [6, 7, 8]],
            ),
            future_token_slots=T(slots),
        )
    )
    return out.next_token_ids.tolist()


def _steps(ex: ModelExecutor, by_reference: bool) -> list[ForwardOutput]:
    """Prefill, a DECODE that feeds the tokens back, then an EXTEND of a new request whose
    prompt holds a token of row 1: by reference (-k) or by value."""
    first = _prefill(ex, [1, 2])
    decode = make_decode_batch(
        input_ids=[-1, -2] if by_reference else first,
        req_pool_indices=[1, 2],
        seq_lens=[6, 4],
        out_cache_loc=[9, 10],
    )
    second = ex.forward(
        dataclasses.replace(decode, future_token_slots=T([3, 4])), return_logits=True
    )
    mid = -3 if by_reference else int(second.next_token_ids[0])
    extend = make_extend_batch(
        input_ids=[[5, mid, 7, 8, 9, 10]], req_pool_indices=[3], out_cache_loc=[list(range(11, 17))]
    )
    # Slots 1 and 2 were read by the decode step: released now, and 1 assigned again at once.
    extend = dataclasses.replace(extend, future_token_slots=T([1]), released_future_slots=T([1, 2]))
    third = ex.forward(extend, return_logits=True)
    return [second, third]


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_reads_references_as_the_tokens_they_name(
    make_executor: MakeExecutor, path: str
) -> None:
    config, decode_path = PATHS[path]
    by_value = _steps(make_executor(**config), by_reference=False)
    ex = make_executor(**config)
    by_ref = _steps(ex, by_reference=True)
    for ref, val in zip(by_ref, by_value, strict=True):
        assert ref.logits is not None and val.logits is not None
        torch.testing.assert_close(ref.logits, val.logits, rtol=0, atol=0)
        assert ref.next_token_ids.tolist() == val.next_token_ids.tolist()
    assert by_ref[0].stats.future_refs == 2 and by_ref[1].stats.future_refs == 1
    # Graphs cover one mode each: the other mode's step runs eagerly (staged).
    extend_path = {"full_graph": "eager", "piecewise": "piecewise"}.get(path, decode_path)
    decode_path = "eager" if path == "piecewise" else decode_path
    assert (by_ref[0].stats.path, by_ref[1].stats.path) == (decode_path, extend_path)
    assert ex.future.assigned.nonzero()[0].tolist() == [1, 3, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("graph_mode", ["none", "both"])
def test_cuda_paths_read_references_as_the_tokens_they_name(
    make_executor: MakeExecutor, graph_mode: str
) -> None:
    """Real CUDA graphs: the gather inside the captured graph reads the table's buffer."""
    config = {
        "device": "cuda",
        "dtype": "float32",
        "graph_mode": graph_mode,
        "graph_backend": "cuda",
    }
    config |= {"graph_batch_sizes": "4", "piecewise_token_sizes": "8"}
    by_value = _steps(make_executor(**config), by_reference=False)
    by_ref = _steps(make_executor(**config), by_reference=True)
    for ref, val in zip(by_ref, by_value, strict=True):
        assert ref.next_token_ids.tolist() == val.next_token_ids.tolist()
        assert ref.logits is not None and val.logits is not None
        torch.testing.assert_close(ref.logits, val.logits, rtol=0, atol=0)
    if graph_mode == "both":
        assert [s.stats.path for s in by_ref] == ["full_graph", "piecewise"]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["eager", "eager_no_copy", "full_graph"])
def test_resolution_reads_nothing_on_the_host(make_executor: MakeExecutor, path: str) -> None:
    """Under the host-read guard, a step with references makes the same one counted transfer
    (the sampled tokens) as a step without."""
    ex = make_executor(**PATHS[path][0])
    _prefill(ex, [1, 2])
    ex.hooks.device_step_guard = HostReadGuard
    batch = make_decode_batch(
        input_ids=[-1, -2], req_pool_indices=[1, 2], seq_lens=[6, 4], out_cache_loc=[9, 10]
    )
    out = ex.forward(dataclasses.replace(batch, future_token_slots=T([3, 4])))
    plain = make_decode_batch(
        input_ids=[5, 6], req_pool_indices=[1, 2], seq_lens=[7, 5], out_cache_loc=[11, 12]
    )
    out_plain = ex.forward(plain)
    assert out.stats.path == PATHS[path][1] and out.stats.future_refs == 2
    assert out.stats.d2h_syncs == out_plain.stats.d2h_syncs == 1


# --- the rules: each refusal names its field and changes nothing -------------------------------
def _decode(ids: list[int], **fields: object) -> ForwardBatch:
    batch = make_decode_batch(
        input_ids=ids,
        req_pool_indices=[1, 2][: len(ids)],
        seq_lens=[6, 4][: len(ids)],
        out_cache_loc=[9, 10][: len(ids)],
    )
    return dataclasses.replace(batch, **fields)  # type: ignore[arg-type]


@pytest.fixture
def prefilled(make_executor: MakeExecutor) -> ModelExecutor:
    ex = make_executor(future_slots=8)
    _prefill(ex, [1, 2])  # slots 1 and 2 assigned
    return ex


REFUSALS: dict[str, tuple[Callable[[], ForwardBatch], str, str]] = {
    "reference below -future_slots": (lambda: _decode([-9, 5]), "input_ids[0]", "-8..-1"),
    "reference to a slot never assigned": (
        lambda: _decode([-5, 5]),
        "input_ids[0]",
        "holds no token",
    ),
    "reference to a slot released in the batch": (
        lambda: _decode([-1, 5], released_future_slots=T([1])),
        "input_ids[0]",
        "released since",
    ),
    "future slots not unique": (
        lambda: _decode([5, 6], future_token_slots=T([3, 3])),
        "future_token_slots",
        "unique",
    ),
    "future slot 0": (
        lambda: _decode([5, 6], future_token_slots=T([0, 3])),
        "future_token_slots[0]",
        "1..8",
    ),
    "future slot beyond the table": (
        lambda: _decode([5, 6], future_token_slots=T([3, 9])),
        "future_token_slots[1]",
        "1..8",
    ),
    "future slots not one per request": (
        lambda: _decode([5, 6], future_token_slots=T([3])),
        "future_token_slots",
        "2 entries",
    ),
    "assigning a slot still held": (
        lambda: _decode([5, 6], future_token_slots=T([3, 2])),
        "future_token_slots[1]",
        "unreleased",
    ),
    "released slot out of range": (
        lambda: _decode([5, 6], released_future_slots=T([9])),
        "released_future_slots[0]",
        "1..8",
    ),
    "released slots not unique": (
        lambda: _decode([5, 6], released_future_slots=T([1, 1])),
        "released_future_slots",
        "unique",
    ),
    "IDLE assigning slots": (
        lambda: dataclasses.replace(make_idle_batch(), future_token_slots=T([3])),
        "future_token_slots",
        "IDLE",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_reference_or_slot_is_refused_and_changes_nothing(
    prefilled: ModelExecutor, case: str
) -> None:
    build, field, rule = REFUSALS[case]
    held = prefilled.future.assigned.copy()
    table = prefilled.future.tokens.clone()
    lens = prefilled.req_to_token_pool.resident_lens.copy()
    with pytest.raises(BatchValidationError) as err:
        prefilled.forward(build())
    assert err.value.field == field and rule in str(err.value)
    assert np.array_equal(prefilled.future.assigned, held)
    assert torch.equal(prefilled.future.tokens, table)
    assert np.array_equal(prefilled.req_to_token_pool.resident_lens, lens)


def test_a_slot_released_and_assigned_in_one_batch_is_accepted(prefilled: ModelExecutor) -> None:
    out = prefilled.forward(
        _decode([5, -2], future_token_slots=T([1, 3]), released_future_slots=T([1]))
    )
    assert out.stats.future_refs == 1
    assert prefilled.future.tokens[[1, 3]].tolist() == out.next_token_ids.tolist()
    assert prefilled.future.assigned.nonzero()[0].tolist() == [1, 2, 3]


def test_a_refused_batch_assigns_and_releases_nothing(prefilled: ModelExecutor) -> None:
    """Refused later in the step (a KV slot a live row holds): slots 3, 4 stay free, 1 held."""
    bad = _decode([5, 6], future_token_slots=T([3, 4]), released_future_slots=T([1]))
    bad = dataclasses.replace(bad, out_cache_loc=T([1, 10]))  # slot 1 holds row 1's prompt
    with pytest.raises(BatchValidationError, match="out_cache_loc"):
        prefilled.forward(bad)
    assert prefilled.future.assigned.nonzero()[0].tolist() == [1, 2]
    with pytest.raises(BatchValidationError, match="holds no token"):
        prefilled.forward(_decode([-3, 6]))


def test_a_step_that_fails_on_the_device_is_undone(prefilled: ModelExecutor) -> None:
    prefilled.hooks.faults = FaultInjector()
    prefilled.hooks.faults.arm("sampler")
    table = prefilled.future.tokens.clone()
    with pytest.raises(InjectedFault):
        prefilled.forward(
            _decode([-1, 6], future_token_slots=T([3, 4]), released_future_slots=T([2]))
        )
    assert prefilled.future.assigned.nonzero()[0].tolist() == [1, 2]
    assert torch.equal(prefilled.future.tokens, table)
    assert prefilled.forward(_decode([-1, -2])).stats.future_refs == 2  # still readable


def test_embeddings_store_a_future_token_but_cannot_carry_a_reference(
    prefilled: ModelExecutor,
) -> None:
    embeds = torch.zeros(1, prefilled.limits.hidden_size)
    batch = make_extend_batch(input_ids=[[0]], req_pool_indices=[3], out_cache_loc=[[20]])
    with_embeds = dataclasses.replace(
        batch, input_ids=None, input_embeds=embeds, future_token_slots=T([5])
    )
    token = int(prefilled.forward(with_embeds).next_token_ids[0])
    assert int(prefilled.future.tokens[5]) == token
    both = dataclasses.replace(batch, input_ids=T([-5]), input_embeds=embeds)
    with pytest.raises(BatchValidationError, match="exactly one of input_ids and input_embeds"):
        prefilled.forward(both)


# --- the overlap scheduler -------------------------------------------------------------------
def _outputs(
    ex: ModelExecutor, overlap: bool, eos: list[int], sampling: SamplingParams | None
) -> list[list[int]]:
    return generate(
        ex.forward,
        ex.limits,
        PROMPTS,
        max_new_tokens=8,
        eos_token_ids=eos,
        sampling=sampling,
        overlap=overlap,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "seeded", "depth"),
    [
        ("eager", False, 2),
        ("eager", True, 2),
        ("eager_no_copy", True, 2),
        ("full_graph", False, 2),
        ("eager", True, 3),
        ("full_graph", False, 3),
    ],
    ids=[
        "eager-greedy",
        "eager-seeded",
        "eager_no_copy-seeded",
        "full_graph-greedy",
        "eager-seeded-depth3",
        "full_graph-greedy-depth3",
    ],
)
def test_overlap_gives_the_tokens_of_the_plain_scheduler(
    make_executor: MakeExecutor, path: str, seeded: bool, depth: int
) -> None:
    """Steps in flight (`depth`: sent and not yet read) change no token; a request that
    stopped mid-run was in the steps after its stop, whose tokens are dropped."""
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=11) if seeded else None
    ex = make_executor(**PATHS[path][0])
    free = _outputs(ex, overlap=False, eos=[], sampling=sampling)
    eos = [free[0][3], free[2][6]]  # stops mid-run: read one step late in overlap
    plain = _outputs(ex, overlap=False, eos=eos, sampling=sampling)
    assert len(plain[0]) <= 3
    steps: list[ForwardOutput] = []

    def recording(batch: ForwardBatch) -> ForwardOutput:
        steps.append(ex.forward(batch))
        return steps[-1]

    class Counting(InlinePipe):
        """Counts the steps sent and not yet read."""

        unread = most = 0

        def send(self, batch: ForwardBatch) -> int:
            self.unread += 1
            self.most = max(self.most, self.unread)
            return super().send(batch)

        def recv(self) -> Any:
            self.unread -= 1
            return super().recv()

    pipe = Counting(recording)
    overlapped = generate(
        recording,
        ex.limits,
        PROMPTS,
        max_new_tokens=8,
        eos_token_ids=eos,
        sampling=sampling,
        overlap=True,
        pipe=pipe,
        overlap_depth=depth,
    )
    assert overlapped == plain
    assert pipe.most == depth
    assert any(s.stats.future_refs and s.stats.path == PATHS[path][1] for s in steps)
    # Everything went back: rows, KV slots and future slots.
    assert ex.req_to_token_pool.rows_in_use() == 0 and ex.future.slots_in_use() == 0


@pytest.mark.slow
def test_overlap_over_forward_stream_matches_unary_and_counts_resolved_tokens(
    tmp_path: Path,
) -> None:
    with (
        running_server(tiny_config(tmp_path, future_slots=64)) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as client,
    ):
        remote = client.info()
        assert remote.info.limits.future_slots == 64
        assert client.future_slots().alloc(64)[-1] == 64
        limits = remote.info.limits
        plain = generate(client.retrying(), limits, PROMPTS, max_new_tokens=8, eos_token_ids=[])
        session = client.open_stream()
        overlapped = generate(
            client.retrying(), limits, PROMPTS, max_new_tokens=8, overlap=True, pipe=session
        )
        session.close()
        assert overlapped == plain
        resolved = Scrape(srv).get("model_executor_future_tokens_resolved_total")
        assert resolved == sum(len(o) - 1 for o in plain)  # every decode input by reference
        with pytest.raises(grpc.RpcError) as err:
            client.forward(_decode([-7, 5]))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "input_ids[0]" in str(err.value.details())


def test_the_codec_carries_the_future_fields() -> None:
    batch = _decode([-1, 5], future_token_slots=T([3, 4]), released_future_slots=T([1]))
    back = batch_from_proto(batch_to_proto(batch))
    assert back.input_ids is not None and back.input_ids.tolist() == [-1, 5]
    assert back.future_token_slots is not None and back.future_token_slots.tolist() == [3, 4]
    assert back.released_future_slots is not None and back.released_future_slots.tolist() == [1]


def test_future_slots_default_to_four_per_row() -> None:
    from executor.config import resolve_future_slots

    assert resolve_future_slots(ExecutorConfig(max_reqs=10)) == 40
    assert resolve_future_slots(ExecutorConfig(max_reqs=10, future_slots=7)) == 7
    with pytest.raises(ValueError, match="future_slots must be >= 0"):
        ExecutorConfig(future_slots=-1)


@pytest.mark.slow
def test_cli_generate_overlap_prints_what_generate_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from executor.client.cli import main

    monkeypatch.setattr("executor.client.cli_session.configure_logging", lambda *a, **k: None)
    args = ["generate", "hi", "there", "--model", "tiny-random", "--max-new-tokens", "6"]
    args += ["--cache-dir", str(tmp_path), "--max-reqs", "4"]
    # stdout may carry the embedded server's log lines too: compare the answers only.
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--overlap"]) == 0
    overlapped = capsys.readouterr().out

    def answers(out: str) -> list[str]:
        return [line for line in out.splitlines() if not re.match(r"\d{4}-\d\d-\d\d ", line)]

    assert "--- [1] length" in plain
    assert answers(overlapped) == answers(plain)
