"""A bad batch is refused with a message naming the field and rule, and nothing is lost."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.core.forward_batch import ForwardBatch, ForwardMode, SamplingBatch, SamplingParams
from executor.model_executor import ModelExecutor

PROMPT = [11, 22, 33, 44, 55]


def good_extend() -> ForwardBatch:
    return make_extend_batch(
        input_ids=[PROMPT], req_pool_indices=[1], out_cache_loc=[[1, 2, 3, 4, 5]]
    )


def good_decode(token: int) -> ForwardBatch:
    return make_decode_batch(
        input_ids=[token], req_pool_indices=[1], seq_lens=[6], out_cache_loc=[6]
    )


def _replace(fb: ForwardBatch, **changes: Any) -> ForwardBatch:
    return dataclasses.replace(fb, **changes)


def _t(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _sampling(**kw: Any) -> SamplingBatch:
    return SamplingBatch.from_params([SamplingParams(**kw)], 1)


# (name, batch factory taking the first step's sampled token, expected field prefix, error type)
BAD_DECODES: list[tuple[str, Callable[[int], ForwardBatch], str]] = [
    ("row 0", lambda t: _replace(good_decode(t), req_pool_indices=_t([0])), "req_pool_indices[0]"),
    (
        "row past max_reqs",
        lambda t: _replace(good_decode(t), req_pool_indices=_t([99])),
        "req_pool_indices[0]",
    ),
    ("slot 0", lambda t: _replace(good_decode(t), out_cache_loc=_t([0])), "out_cache_loc[0]"),
    (
        "slot past kv_slots",
        lambda t: _replace(good_decode(t), out_cache_loc=_t([10**6])),
        "out_cache_loc[0]",
    ),
    ("token past vocab", lambda t: _replace(good_decode(t), input_ids=_t([512])), "input_ids[0]"),
    ("negative token", lambda t: _replace(good_decode(t), input_ids=_t([-1])), "input_ids[0]"),
    (
        "seq_len past context",
        lambda t: _replace(good_decode(t), seq_lens=_t([5000])),
        "seq_lens[0]",
    ),
    ("prefix not held", lambda t: _replace(good_decode(t), seq_lens=_t([9])), "seq_lens[0]"),
    ("float ids", lambda t: _replace(good_decode(t), input_ids=torch.tensor([1.0])), "input_ids"),
    ("2-D ids", lambda t: _replace(good_decode(t), input_ids=_t([t]).view(1, 1)), "input_ids"),
    ("too few seq_lens", lambda t: _replace(good_decode(t), seq_lens=_t([])), "seq_lens"),
    (
        "two tokens in decode",
        lambda t: _replace(good_decode(t), out_cache_loc=_t([6, 7]), input_ids=_t([t, t])),
        "out_cache_loc",
    ),
    (
        "extend fields in decode",
        lambda t: _replace(good_decode(t), extend_seq_lens=_t([1])),
        "extend_seq_lens",
    ),
    (
        "positions past context",
        lambda t: _replace(good_decode(t), positions=_t([4096])),
        "positions[0]",
    ),
    (
        "temperature < 0",
        lambda t: _replace(good_decode(t), sampling=_sampling(temperature=-0.5)),
        "sampling_params[0].temperature",
    ),
    (
        "top_p 0",
        lambda t: _replace(good_decode(t), sampling=_sampling(top_p=0.0)),
        "sampling_params[0].top_p",
    ),
    (
        "top_p > 1",
        lambda t: _replace(good_decode(t), sampling=_sampling(top_p=1.5)),
        "sampling_params[0].top_p",
    ),
    (
        "top_k < 0",
        lambda t: _replace(good_decode(t), sampling=_sampling(top_k=-1)),
        "sampling_params[0].top_k",
    ),
    (
        "min_p > 1",
        lambda t: _replace(good_decode(t), sampling=_sampling(min_p=1.5)),
        "sampling_params[0].min_p",
    ),
    (
        "nan temperature",
        lambda t: _replace(good_decode(t), sampling=_sampling(temperature=float("nan"))),
        "sampling_params[0].temperature",
    ),
    (
        "top_logprobs_num past vocab",
        lambda t: _replace(good_decode(t), top_logprobs_num=10**6),
        "top_logprobs_num",
    ),
    ("no ids and no embeds", lambda t: _replace(good_decode(t), input_ids=None), "input_ids"),
    (
        "wrong embeds width",
        lambda t: _replace(good_decode(t), input_ids=None, input_embeds=torch.zeros(1, 3)),
        "input_embeds",
    ),
    (
        "non-finite embeds",
        lambda t: _replace(
            good_decode(t), input_ids=None, input_embeds=torch.full((1, 64), float("inf"))
        ),
        "input_embeds",
    ),
    (
        "empty DECODE",
        lambda t: _replace(
            good_decode(t),
            batch_size=0,
            input_ids=_t([]),
            req_pool_indices=_t([]),
            seq_lens=_t([]),
            out_cache_loc=_t([]),
        ),
        "batch_size",
    ),
    (
        "IDLE with tokens",
        lambda t: _replace(good_decode(t), forward_mode=ForwardMode.IDLE),
        "forward_mode",
    ),
    ("unknown mode", lambda t: _replace(good_decode(t), forward_mode=7), "forward_mode"),
    (
        "release row 0",
        lambda t: _replace(good_decode(t), released_req_pool_indices=_t([0])),
        "released_req_pool_indices[0]",
    ),
    (
        "release past max_reqs",
        lambda t: _replace(good_decode(t), released_req_pool_indices=_t([99])),
        "released_req_pool_indices[0]",
    ),
    (
        "release twice",
        lambda t: _replace(good_decode(t), released_req_pool_indices=_t([3, 3])),
        "released_req_pool_indices",
    ),
    (
        "release float rows",
        lambda t: _replace(good_decode(t), released_req_pool_indices=torch.tensor([1.0])),
        "released_req_pool_indices",
    ),
    (
        "release the decoding row",
        lambda t: _replace(good_decode(t), released_req_pool_indices=_t([1])),
        "seq_lens[0]",
    ),
]


def _bad_extends() -> list[tuple[str, ForwardBatch, str]]:
    two = make_extend_batch(
        input_ids=[[1, 2], [3]], req_pool_indices=[2, 3], out_cache_loc=[[40, 41], [42]]
    )
    return [
        ("duplicate rows", _replace(two, req_pool_indices=_t([2, 2])), "req_pool_indices"),
        ("duplicate slots", _replace(two, out_cache_loc=_t([40, 41, 40])), "out_cache_loc"),
        ("seq != prefix + extend", _replace(two, seq_lens=_t([3, 1])), "seq_lens[0]"),
        (
            "extend sum != tokens",
            _replace(two, extend_seq_lens=_t([1, 1]), seq_lens=_t([1, 1])),
            "extend_seq_lens",
        ),
        (
            "zero-length extend",
            _replace(
                two, extend_seq_lens=_t([3, 0]), extend_prefix_lens=_t([0, 1]), seq_lens=_t([3, 1])
            ),
            "extend_seq_lens[1]",
        ),
        ("missing extend lens", _replace(two, extend_seq_lens=None), "extend_seq_lens"),
        (
            "prefix the row lacks",
            make_extend_batch(
                input_ids=[[1]], req_pool_indices=[2], out_cache_loc=[[40]], prefix_lens=[3]
            ),
            "extend_prefix_lens[0]",
        ),
        (
            "prefix_cache_loc wrong length",
            make_extend_batch(
                input_ids=[[1]],
                req_pool_indices=[2],
                out_cache_loc=[[40]],
                prefix_lens=[3],
                prefix_cache_loc=[[1, 2]],
            ),
            "prefix_cache_loc",
        ),
        (
            "prefix_cache_loc slot 0",
            make_extend_batch(
                input_ids=[[1]],
                req_pool_indices=[2],
                out_cache_loc=[[40]],
                prefix_lens=[2],
                prefix_cache_loc=[[0, 1]],
            ),
            "prefix_cache_loc[0]",
        ),
        (
            "prefix overlaps new slots",
            make_extend_batch(
                input_ids=[[1]],
                req_pool_indices=[2],
                out_cache_loc=[[2]],
                prefix_lens=[2],
                prefix_cache_loc=[[1, 2]],
            ),
            "out_cache_loc[0]",
        ),
        (
            "wrong sampling count",
            _replace(two, sampling=SamplingBatch.greedy(3)),
            "sampling_params.temperatures",
        ),
        (
            "device tensor required on host",
            _replace(two, seq_lens=_t([2, 1]).to("meta")),
            "seq_lens",
        ),
    ]


def _state(ex: ModelExecutor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    return (
        ex.req_to_token_pool.req_to_token.clone(),
        ex.kv_pool.k.clone(),
        ex.kv_pool.v.clone(),
        ex.req_to_token_pool.resident_lens.tolist(),
    )


def _assert_same_state(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0], b[0]), "row table changed"
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]), "KV cache changed"
    assert a[3] == b[3], "resident lengths changed"


@pytest.fixture
def reference_tokens(make_executor: Callable[..., ModelExecutor]) -> tuple[int, int]:
    ex = make_executor()
    first = int(ex.forward(good_extend()).next_token_ids[0])
    second = int(ex.forward(good_decode(first)).next_token_ids[0])
    return first, second


@pytest.mark.parametrize(
    ("name", "make_bad", "field"), BAD_DECODES, ids=[c[0] for c in BAD_DECODES]
)
def test_bad_decode_is_refused_and_nothing_is_lost(
    make_executor: Callable[..., ModelExecutor],
    reference_tokens: tuple[int, int],
    name: str,
    make_bad: Callable[[int], ForwardBatch],
    field: str,
) -> None:
    ex = make_executor()
    first = int(ex.forward(good_extend()).next_token_ids[0])
    before = _state(ex)
    with pytest.raises(BatchValidationError) as err:
        ex.forward(make_bad(first))
    assert err.value.field.startswith(field), str(err.value)
    assert err.value.rule and err.value.field in str(err.value)
    _assert_same_state(before, _state(ex))
    assert int(ex.forward(good_decode(first)).next_token_ids[0]) == reference_tokens[1]


@pytest.mark.parametrize("case", range(len(_bad_extends())), ids=[c[0] for c in _bad_extends()])
def test_bad_extend_is_refused_and_nothing_is_lost(
    make_executor: Callable[..., ModelExecutor], reference_tokens: tuple[int, int], case: int
) -> None:
    name, bad, field = _bad_extends()[case]
    ex = make_executor()
    first = int(ex.forward(good_extend()).next_token_ids[0])
    before = _state(ex)
    with pytest.raises(BatchValidationError) as err:
        ex.forward(bad)
    assert err.value.field.startswith(field), f"{name}: {err.value}"
    _assert_same_state(before, _state(ex))
    assert int(ex.forward(good_decode(first)).next_token_ids[0]) == reference_tokens[1]


def test_oversized_batches_raise_too_large(make_executor: Callable[..., ModelExecutor]) -> None:
    ex = make_executor(max_batch_size=2, max_tokens_per_batch=8)
    with pytest.raises(BatchTooLargeError, match="max_batch_size"):
        ex.forward(
            make_extend_batch(
                input_ids=[[1], [2], [3]], req_pool_indices=[1, 2, 3], out_cache_loc=[[1], [2], [3]]
            )
        )
    with pytest.raises(BatchTooLargeError, match="max_tokens_per_batch"):
        ex.forward(
            make_extend_batch(
                input_ids=[list(range(9))], req_pool_indices=[1], out_cache_loc=[list(range(1, 10))]
            )
        )


def test_a_failure_inside_the_model_undoes_the_row_table(
    make_executor: Callable[..., ModelExecutor],
    monkeypatch: pytest.MonkeyPatch,
    reference_tokens: tuple[int, int],
) -> None:
    ex = make_executor()
    first = int(ex.forward(good_extend()).next_token_ids[0])
    before = _state(ex)

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device fell over")

    monkeypatch.setattr(ex.step.sampler, "draw", boom)
    with pytest.raises(RuntimeError, match="device fell over"):
        ex.forward(good_decode(first))
    monkeypatch.undo()
    after = _state(ex)
    assert torch.equal(before[0], after[0]) and before[3] == after[3]
    assert int(ex.forward(good_decode(first)).next_token_ids[0]) == reference_tokens[1]


def test_int32_index_fields_are_accepted(
    make_executor: Callable[..., ModelExecutor], reference_tokens: tuple[int, int]
) -> None:
    ex = make_executor()
    fb = good_extend()
    fb32 = _replace(
        fb,
        **{
            n: getattr(fb, n).to(torch.int32)
            for n in (
                "input_ids",
                "req_pool_indices",
                "seq_lens",
                "out_cache_loc",
                "extend_prefix_lens",
                "extend_seq_lens",
            )
        },
    )
    assert int(ex.forward(fb32).next_token_ids[0]) == reference_tokens[0]


def test_client_embeddings_are_refused_unless_enabled(tmp_path: Path) -> None:
    """Off by default (a client's embeddings reach the model unchecked): refused from the
    header, naming the setting; GetInfo says whether they are accepted."""
    import grpc

    from executor.batch_prep import make_extend_batch
    from executor.client.grpc_client import ExecutorClient
    from tests.server_util import running_server, tiny_config

    fb = make_extend_batch(input_ids=[[1, 2]], req_pool_indices=[1], out_cache_loc=[[1, 2]])
    embeds = dataclasses.replace(fb, input_ids=None, input_embeds=torch.zeros(2, 64))
    with (
        running_server(tiny_config(tmp_path, allow_input_embeds=False)) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as client,
    ):
        assert client.info().info.limits.allow_input_embeds is False
        with pytest.raises(grpc.RpcError) as err:
            client.forward(embeds)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input_embeds: is off on this executor" in err.value.details()
        # A release list longer than the row table is refused by its length alone (one far
        # beyond the receive limit never reaches the handler: gRPC refuses it).
        long = dataclasses.replace(
            fb, released_req_pool_indices=torch.ones(100_000, dtype=torch.int32)
        )
        with pytest.raises(grpc.RpcError) as err:
            client.forward(long)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "released_req_pool_indices: has 100000 entries; must be <= 32" in err.value.details()
