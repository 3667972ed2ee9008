"""The host kernels (`ops/host_kernels.py`): each answers what its Python path answers.

Every check runs twice on the same input, once with the kernel and once inside
`host_kernels.disabled()` (the pure-Python path a machine without a compiler takes), and the
two must agree exactly: the same refusal (type and message) or the same derived fields, the
same owner map, the same staged bytes, the same sampling plan, the same greedy tokens.
"""

from __future__ import annotations

import ast
import dataclasses
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from executor import validation
from executor.batch_prep import (
    complete_batch,
    make_decode_batch,
    make_extend_batch,
    make_idle_batch,
)
from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.core.forward_batch import (
    ForwardBatch,
    ForwardMode,
    LogprobsMode,
    SamplingBatch,
    SamplingParams,
)
from executor.core.limits import BatchLimits
from executor.kv_cache import ReqToTokenPool
from executor.sampling import Sampler
from executor.validation import validate_batch
from ops import host_kernels, native_build
from ops.h2d_staging import H2DStaging, StagedField
from ops.sampling import SamplingPlan, argmax_rows

CPU = torch.device("cpu")
MAX_CTX = 64


@pytest.fixture(scope="module", autouse=True)
def kernel(tmp_path_factory: pytest.TempPathFactory) -> host_kernels.HostKernels:
    loaded = host_kernels.load(tmp_path_factory.mktemp("host-kernels"))
    assert isinstance(loaded, host_kernels.HostKernels), loaded
    return loaded


def both(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """`fn()` with the kernel and without it; an exception is returned as (type, message)."""

    def run() -> Any:
        try:
            return fn()
        except Exception as e:
            return (type(e), str(e))

    with_kernel = run()
    with host_kernels.disabled():
        without = run()
    return with_kernel, without


def limits(**overrides: int) -> BatchLimits:
    values: dict[str, Any] = {
        "max_batch_size": 8,
        "max_tokens_per_batch": 64,
        "max_context_len": MAX_CTX,
        "max_reqs": 6,
        "kv_slots": 100,
        "vocab_size": 50,
        "hidden_size": 16,
        "future_slots": 0,
    }
    values.update(overrides)
    return BatchLimits(**values)


def decode(rows: list[int], seq_lens: list[int], slots: list[int], **kw: Any) -> ForwardBatch:
    ids = kw.pop("ids", [3] * len(rows))
    return make_decode_batch(
        input_ids=ids, req_pool_indices=rows, seq_lens=seq_lens, out_cache_loc=slots, **kw
    )


def _t(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _with(fb: ForwardBatch, **changes: Any) -> ForwardBatch:
    return dataclasses.replace(fb, **changes)


def _sampling(*params: SamplingParams, bs: int) -> SamplingBatch:
    return SamplingBatch.from_params(list(params), bs)


RESIDENT = np.array([0, 4, 7, 0, 2, 9, 0], dtype=np.int64)  # rows 1..6 hold these lengths
GOOD = decode([1, 2, 4], [5, 8, 3], [10, 11, 12])


@dataclasses.dataclass(frozen=True)
class Case:
    """A batch and the executor state it is validated against."""

    name: str
    fb: ForwardBatch
    limits: dict[str, Any] = dataclasses.field(default_factory=dict)  # over `limits()`'s
    assigned: np.ndarray | None = None  # the future table's held slots
    resident: np.ndarray = dataclasses.field(default_factory=lambda: RESIDENT)


FUTURE = {"future_slots": 4}
HELD_FUTURE = np.array([False, True, False, True, False])  # slots 1 and 3 hold tokens
EXTEND = make_extend_batch(input_ids=[[1, 2], [3]], req_pool_indices=[3, 6], out_cache_loc=[[20, 21], [22]])  # fmt: skip
EMBEDS = _with(GOOD, input_ids=None, input_embeds=torch.zeros(3, 16))
OVERLAP = _with(  # slots 1 and 3 held: it reads them, writes 2 and 4
    decode([1, 2], [5, 8], [10, 11], ids=[-1, -3]),
    released_future_slots=_t([]),
    future_token_slots=_t([2, 4]),
)


def _cases() -> Iterator[Case]:
    """Valid batches, and for every refusal `validate_batch` can raise a batch that breaks
    that rule (`test_every_rule_has_a_case` holds the list to the source)."""
    for name, fb in _decode_cases():
        yield Case(name, fb)
    yield Case("more tokens than max_tokens_per_batch", GOOD, {"max_tokens_per_batch": 2})
    many = {"max_batch_size": 80, "max_tokens_per_batch": 80, "max_reqs": 80}
    long_rows = np.full(81, 4, dtype=np.int64)  # beyond 64 entries the kernel sorts a copy
    rows, slots = list(range(1, 81)), list(range(1, 81))
    yield Case("80 requests", decode(rows, [5] * 80, slots), many, resident=long_rows)
    yield Case("a slot twice of 80", decode(rows, [5] * 80, slots[:-1] + [7]), many, resident=long_rows)  # fmt: skip
    yield Case("int32 and a row past max_reqs", _with(GOOD, req_pool_indices=_t([1, 9, 4], torch.int32)))  # fmt: skip
    yield Case("negative min_p", _with(GOOD, sampling=_sampling(SamplingParams(min_p=-0.5), bs=3)))  # fmt: skip
    yield Case("not a tensor", _with(GOOD, seq_lens=[5, 8, 3]))
    yield Case("not on the host", _with(GOOD, seq_lens=torch.empty(3, dtype=torch.int64, device="meta")))  # fmt: skip
    yield Case("an unknown forward_mode", _with(GOOD, forward_mode="DECODE"))
    yield Case("a negative batch_size", _with(GOOD, batch_size=-1))
    yield Case("idle", make_idle_batch())
    yield Case("idle with future slots", _with(make_idle_batch(), future_token_slots=_t([1])), FUTURE)  # fmt: skip
    yield Case("idle with requests", _with(GOOD, forward_mode=ForwardMode.IDLE))
    yield Case("an empty decode", decode([], [], []))
    yield Case("two tokens for a request", _with(GOOD, input_ids=_t([3] * 4), out_cache_loc=_t([10, 11, 12, 13])))  # fmt: skip
    yield Case("extend fields on a decode", _with(GOOD, extend_prefix_lens=_t([0, 0, 0])))
    yield Case("a release out of range", _with(GOOD, released_req_pool_indices=_t([9])))
    yield Case("future slots on an executor without", _with(GOOD, future_token_slots=_t([1, 2, 4])))  # fmt: skip
    yield Case("future slots", _with(GOOD, future_token_slots=_t([2, 4, 3])), FUTURE)  # fmt: skip
    yield Case("a future slot still held", _with(GOOD, future_token_slots=_t([1, 2, 4])), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("future references", decode([1, 2, 4], [5, 8, 3], [10, 11, 12], ids=[-1, -3, 4]), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("a reference to an empty slot", decode([1, 2, 4], [5, 8, 3], [10, 11, 12], ids=[-1, -2, 4]), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("a reference past future_slots", decode([1, 2, 4], [5, 8, 3], [10, 11, 12], ids=[-9, 3, 4]), FUTURE, HELD_FUTURE)  # fmt: skip
    # An overlapping scheduler's step: references, its own slots, the slots it is done with.
    yield Case("an overlap step", OVERLAP, FUTURE, HELD_FUTURE)
    yield Case("a future slot released twice", _with(OVERLAP, released_future_slots=_t([3, 3])), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("a released slot past future_slots", _with(OVERLAP, released_future_slots=_t([5])), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("a float release", _with(OVERLAP, released_future_slots=torch.zeros(0)), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("a reference to a slot the step releases", _with(OVERLAP, released_future_slots=_t([1])), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("a held slot assigned again", _with(OVERLAP, future_token_slots=_t([3, 2])), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("a slot the step releases, assigned again", _with(OVERLAP, released_future_slots=_t([3]), future_token_slots=_t([3, 2]), input_ids=_t([-1, 4])), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("a future slot twice", _with(OVERLAP, future_token_slots=_t([2, 2])), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("one future slot for two requests", _with(OVERLAP, future_token_slots=_t([2])), FUTURE, HELD_FUTURE)  # fmt: skip
    yield Case("embeddings", EMBEDS)
    yield Case("embeddings switched off", EMBEDS, {"allow_input_embeds": False})
    yield Case("no input", _with(GOOD, input_ids=None))
    yield Case("embeddings of another width", _with(EMBEDS, input_embeds=torch.zeros(3, 8)))
    yield Case("embeddings with a NaN", _with(EMBEDS, input_embeds=torch.full((3, 16), float("nan"))))  # fmt: skip
    yield Case("extend", EXTEND)
    yield Case("extend without extend_seq_lens", _with(EXTEND, extend_seq_lens=None))
    yield Case("extend_seq_lens 0", _with(EXTEND, extend_seq_lens=_t([2, 0])))
    yield Case("seq_lens not prefix + extend", _with(EXTEND, seq_lens=_t([3, 1])))
    yield Case("extend_seq_lens not the tokens", _with(EXTEND, extend_seq_lens=_t([1, 1]), seq_lens=_t([1, 1])))  # fmt: skip
    shared = make_extend_batch(input_ids=[[1]], req_pool_indices=[1], out_cache_loc=[[30]], prefix_lens=[2], prefix_cache_loc=[[30, 31]])  # fmt: skip
    yield Case("a prefix slot written again", shared)
    yield Case("a prefix the row lacks", make_extend_batch(input_ids=[[1]], req_pool_indices=[3], out_cache_loc=[[30]], prefix_lens=[2]))  # fmt: skip


def _decode_cases() -> Iterator[tuple[str, ForwardBatch]]:
    yield "good", GOOD
    yield "one request", decode([5], [10], [40])
    yield (
        "int32 fields",
        _with(
            GOOD,
            input_ids=_t([3, 4, 5], torch.int32),
            req_pool_indices=_t([1, 2, 4], torch.int32),
            seq_lens=_t([5, 8, 3], torch.int32),
            out_cache_loc=_t([10, 11, 12], torch.int32),
        ),
    )
    yield "row 0", decode([0, 2, 4], [5, 8, 3], [10, 11, 12])
    yield "row past max_reqs", decode([1, 7, 4], [5, 8, 3], [10, 11, 12])
    yield "row twice", decode([1, 2, 1], [5, 8, 3], [10, 11, 12])
    yield "slot 0", decode([1, 2, 4], [5, 8, 3], [10, 0, 12])
    yield "slot past kv_slots", decode([1, 2, 4], [5, 8, 3], [10, 11, 101])
    yield "slot twice", decode([1, 2, 4], [5, 8, 3], [10, 12, 12])
    yield "seq_len 0", decode([1, 2, 4], [5, 0, 3], [10, 11, 12])
    yield "seq_len past max_context_len", decode([1, 2, 4], [5, 8, MAX_CTX + 1], [10, 11, 12])
    yield "a row behind its length", decode([1, 2, 4], [6, 8, 3], [10, 11, 12])
    yield "a fresh row decoding", decode([3], [2], [10])
    yield "token past vocab", decode([1, 2, 4], [5, 8, 3], [10, 11, 12], ids=[3, 50, 4])
    yield "negative token", decode([1, 2, 4], [5, 8, 3], [10, 11, 12], ids=[3, -1, 4])
    yield "too many requests", decode(list(range(1, 7)) * 2, [1] * 12, list(range(1, 13)))
    yield "top_logprobs_num", _with(GOOD, top_logprobs_num=99)
    yield "positions given", _with(GOOD, positions=_t([4, 7, 2]))
    yield "wrong positions", _with(GOOD, positions=_t([4, 7, 1]))
    yield "releases", _with(GOOD, released_req_pool_indices=_t([5]))
    yield "a release of its own row", _with(GOOD, released_req_pool_indices=_t([2]))
    yield "rows too short", _with(GOOD, req_pool_indices=_t([1, 2]))
    yield "a float field", _with(GOOD, seq_lens=torch.tensor([5.0, 8.0, 3.0]))
    yield "a matrix", _with(GOOD, out_cache_loc=_t([10, 11, 12]).reshape(3, 1))
    yield "a strided view", _with(GOOD, seq_lens=_t([5, 0, 8, 0, 3, 0])[::2])
    greedy = SamplingParams()
    hot = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3)
    yield "sampling", _with(GOOD, sampling=_sampling(greedy, hot, greedy, bs=3))
    for name, bad in (
        ("NaN temperature", SamplingParams(temperature=float("nan"))),
        ("infinite temperature", SamplingParams(temperature=float("inf"))),
        ("negative temperature", SamplingParams(temperature=-1.0)),
        ("top_p 0", SamplingParams(top_p=0.0)),
        ("top_p past 1", SamplingParams(top_p=1.5)),
        ("negative top_k", SamplingParams(top_k=-1)),
        ("min_p past 1", SamplingParams(min_p=2.0)),
    ):
        yield name, _with(GOOD, sampling=_sampling(hot, bad, greedy, bs=3))
    yield "sampling of another size", _with(GOOD, sampling=_sampling(hot, hot, bs=2))


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_validation_and_derived_fields_agree(case: Case) -> None:
    fb, lim = case.fb, limits(**case.limits)
    refused, refused_py = both(
        lambda: validate_batch(fb, lim, case.resident, future_assigned=case.assigned)
    )
    assert refused == refused_py
    if refused is not None:
        return
    done, done_py = both(
        lambda: complete_batch(fb, needs_cpu_seq_lens=True, max_context_len=MAX_CTX)
    )
    for f in dataclasses.fields(ForwardBatch):
        a, b = getattr(done, f.name), getattr(done_py, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        elif isinstance(a, SamplingBatch):
            fields = [x.name for x in dataclasses.fields(SamplingBatch)]
            assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in fields), f.name
        else:
            assert a == b, f.name


def _refusal_site(case: Case) -> tuple[int, str] | None:
    """Where in executor/validation.py the Python rules refuse `case` (None: accepted)."""
    with host_kernels.disabled():
        try:
            validate_batch(
                case.fb, limits(**case.limits), case.resident, future_assigned=case.assigned
            )
        except (BatchValidationError, BatchTooLargeError) as e:
            frames = traceback.extract_tb(e.__traceback__)
            last = [f for f in frames if f.filename == validation.__file__][-1]
            assert last.lineno is not None
            return last.lineno, str(e)
    return None


def test_every_rule_has_a_case() -> None:
    """Every `raise` in executor/validation.py is reached by a case above, so a rule added
    there (for a DECODE batch, which the kernel may pass first) runs through both paths in
    `test_validation_and_derived_fields_agree`: a kernel that misses it fails that test."""
    tree = ast.parse(Path(validation.__file__).read_text())
    raises = {node.lineno for node in ast.walk(tree) if isinstance(node, ast.Raise)}
    reached = {site[0] for case in CASES if (site := _refusal_site(case)) is not None}
    assert raises - reached == set(), "rules of validation.py no case breaks (lines)"
    valid = {c.name for c in CASES if _refusal_site(c) is None}
    assert {"good", "80 requests", "extend", "idle", "embeddings", "future references"} <= valid


@pytest.mark.parametrize("held", [False, True], ids=["free slots", "a slot a live row holds"])
def test_future_references_agree(held: bool) -> None:
    lim = limits(future_slots=4)
    assigned = np.array([False, True, False, True, False])
    fb = decode([1, 2, 4], [5, 8, 3], [10, 11, 12], ids=[-1, -3 if held else -2, 4])
    a, b = both(lambda: validate_batch(fb, lim, RESIDENT, future_assigned=assigned))
    assert a == b
    assert (a is None) == held  # slot 2 holds no token: refused


def _pool() -> ReqToTokenPool:
    """Rows 1 and 2 hold 3 and 2 tokens (slots 1-3 and 4-5)."""
    pool = ReqToTokenPool(4, 16, CPU, kv_slots=32)
    for rows, seq, slots in (([1, 2], [1, 1], [1, 4]), ([1, 2], [2, 2], [2, 5]), ([1], [3], [3])):
        pool.write_batch(_done(decode(rows, seq, slots)))
    return pool


def _done(fb: ForwardBatch) -> ForwardBatch:
    return complete_batch(fb, needs_cpu_seq_lens=False, max_context_len=16)


def _pool_state(pool: ReqToTokenPool) -> tuple[Any, ...]:
    assert pool.owners is not None
    return (
        pool.req_to_token.clone(),
        pool.resident_lens.copy(),
        pool.owners.table.copy(),
        pool.owners.refs.copy(),
    )


def _write(rows: list[int], seq: list[int], slots: list[int]) -> list[Any]:
    """On a fresh pool: the write's dropped slots, the state after it and after its undo; or
    the refusal."""
    pool, fb = _pool(), _done(decode(rows, seq, slots))
    try:
        plan = pool.check_write(fb)
    except Exception as e:
        return [type(e), str(e)]
    write = pool.write_batch(fb, plan=plan)
    after = _pool_state(pool)
    pool.undo(write)
    return [plan.dropped.tolist(), *after, *_pool_state(pool)]


@pytest.mark.parametrize(
    ("rows", "seq", "slots"),
    [
        ([1, 2], [4, 3], [6, 7]),  # appends
        ([2], [3], [3]),  # a slot row 1 holds: refused
        ([1], [2], [9]),  # rewinds row 1 (drops slots 2 and 3)
        ([3], [1], [8]),  # a fresh row
    ],
    ids=["append", "held slot", "rewind", "fresh row"],
)
def test_the_owner_check_and_write_agree(rows: list[int], seq: list[int], slots: list[int]) -> None:
    with_kernel, without = both(lambda: _write(rows, seq, slots))
    assert len(with_kernel) == len(without)
    for a, b in zip(with_kernel, without, strict=True):
        if isinstance(a, torch.Tensor | np.ndarray):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        else:
            assert a == b


def test_the_staged_bytes_agree() -> None:
    fields = [
        StagedField("ids", _t([1, 2, 3], torch.int32), torch.int64),
        StagedField("slots", _t([7, 8, 9]), torch.int32),
        StagedField("temps", torch.tensor([0.5, 1.0]), torch.float32),
        StagedField("flags", torch.tensor([True, False, True]), torch.bool),
        StagedField("empty", _t([]), torch.int64),
    ]
    staged = [H2DStaging(CPU).stage(fields)]
    with host_kernels.disabled():
        staged.append(H2DStaging(CPU).stage(fields))
    for f, a, b in zip(fields, *staged, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), f.name
    ids, slots = staged[0][:2]
    assert ids.tolist() == [1, 2, 3] and slots.dtype == torch.int32


def test_a_non_contiguous_source_is_staged_by_copies() -> None:
    strided = _t([1, 0, 2, 0, 3, 0])[::2]
    (x,) = H2DStaging(CPU).stage([StagedField("x", strided, torch.int64)])
    assert x.tolist() == [1, 2, 3]


def test_the_sampling_plans_agree() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        bs = int(torch.randint(1, 6, (), generator=g))
        params = [
            SamplingParams(
                temperature=float(
                    torch.tensor([0.0, 1e-6, 1e-5, 0.8])[torch.randint(4, (), generator=g)]
                ),
                top_k=int(torch.randint(0, 3, (), generator=g)),
                top_p=float(torch.tensor([1.0, 0.5])[torch.randint(2, (), generator=g)]),
                min_p=float(torch.tensor([0.0, 0.2])[torch.randint(2, (), generator=g)]),
                seed=None if torch.rand((), generator=g) < 0.5 else 7,
                logprobs_mode=LogprobsMode.PROCESSED
                if torch.rand((), generator=g) < 0.3
                else LogprobsMode.RAW,
            )
            for _ in range(bs)
        ]
        s = SamplingBatch.from_params(params, bs)
        plan = Sampler.plan(s)
        reference = SamplingPlan.from_host(
            s.temperatures, s.top_ks, s.top_ps, s.min_ps, s.has_seed, s.processed
        )
        assert plan == reference, params
    assert Sampler.plan(SamplingBatch.greedy(3)).all_greedy


def test_the_greedy_pick_agrees_with_torch() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=g)
    logits[1, 5] = logits[1, 9] = 1e9  # a tie: the first
    logits[2, 17] = float("nan")  # NaN is the largest
    logits[2, 40] = float("nan")
    logits[3] = float("-inf")
    logits[4, 0] = float("nan")
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    view = torch.randn(4, 64, generator=g)[:, :50]  # rows apart by a stride
    assert torch.equal(argmax_rows(view), view.argmax(-1))
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.0])
    for cols in (1, 3, 7, 8, 9, 31, 64, 513):  # the vector loops' edges and tails
        x = torch.randint(-3, 4, (40, cols), generator=g).float()  # many ties
        spots = torch.rand(40, cols, generator=g) < 0.05
        x[spots] = specials[torch.randint(len(specials), (int(spots.sum()),), generator=g)]
        assert torch.equal(argmax_rows(x), x.argmax(-1)), cols
    with host_kernels.disabled():
        assert torch.equal(argmax_rows(logits), logits.argmax(-1))


def test_without_a_compiler_the_python_paths_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_executor: Callable[..., Any]
) -> None:
    """No compiler and no prebuilt library: `load` says why, the executor logs it, and a step
    runs in Python."""
    monkeypatch.setattr(native_build.shutil, "which", lambda _: None)
    monkeypatch.setattr(host_kernels, "PREBUILT", tmp_path / "missing.so")
    monkeypatch.setattr(host_kernels, "_kernel", [])
    reason = host_kernels.load(tmp_path / "cache")
    assert isinstance(reason, str) and "no C compiler" in reason
    assert host_kernels.loaded() is None
    with capture_logs() as logs:
        ex = make_executor(cache_dir=str(tmp_path / "cache"))  # no library built there
    said = [e for e in logs if "host index kernels unavailable" in e["event"]]
    assert said and "no C compiler" in said[0]["reason"] and said[0]["log_level"] == "warning"
    out = ex.forward(decode([1], [1], [1]))
    assert out.next_token_ids.shape == (1,)


def test_the_prebuilt_library_loads_without_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prebuilt = native_build.build_library(host_kernels.SOURCE, tmp_path, host_kernels.CFLAGS)
    monkeypatch.setattr(native_build.shutil, "which", lambda _: None)
    monkeypatch.setattr(host_kernels, "PREBUILT", prebuilt)
    monkeypatch.setattr(host_kernels, "_kernel", [])
    loaded = host_kernels.load(tmp_path / "cache")
    assert isinstance(loaded, host_kernels.HostKernels) and loaded.path == prebuilt


def test_the_usual_batch_takes_the_kernel_paths() -> None:
    """The agreement above compares the kernels with Python, not Python with itself."""
    from executor.admission.host_checks import plain_decode_holds, sampling_holds
    from executor.batch_prep import _decode_fields

    assert plain_decode_holds(GOOD, limits(), RESIDENT, None)
    many = next(c for c in CASES if c.name == "80 requests")
    assert plain_decode_holds(many.fb, limits(**many.limits), many.resident, None)
    assert plain_decode_holds(OVERLAP, limits(**FUTURE), RESIDENT, HELD_FUTURE)
    again = next(c for c in CASES if c.name == "a slot the step releases, assigned again")
    assert plain_decode_holds(again.fb, limits(**FUTURE), RESIDENT, HELD_FUTURE)
    assert _decode_fields(GOOD, GOOD.seq_lens) is not None
    hot = SamplingParams(temperature=0.7, top_k=5)
    assert sampling_holds(_sampling(hot, hot, hot, bs=3), 3)
    pool, fb = _pool(), _done(decode([1, 2], [4, 3], [6, 7]))
    assert pool._decode_plan(fb) is not None
    with host_kernels.disabled():
        assert not plain_decode_holds(GOOD, limits(), RESIDENT, None)
