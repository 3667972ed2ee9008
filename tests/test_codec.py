"""The wire codec: round trips, zero-copy decoding, and field-naming errors."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.core.errors import BatchValidationError
from executor.core.forward_batch import (
    TENSOR_FIELDS,
    WIRE_TENSOR_FIELDS,
    ForwardBatch,
    ForwardMode,
    LogprobsMode,
    SamplingParams,
)
from executor.core.outputs import ForwardOutput, StepStats
from executor.service.codec import (
    batch_from_proto,
    batch_to_proto,
    response_from_proto,
    response_to_proto,
    tensor_from_proto,
    tensor_to_proto,
)
from model_executor.v1 import executor_pb2 as pb


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16]
)
def test_tensor_round_trip(dtype: torch.dtype) -> None:
    t = (torch.arange(24) - 5).reshape(2, 3, 4).to(dtype)
    back = tensor_from_proto(tensor_to_proto(t), "x")
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_decoding_does_not_copy_the_payload() -> None:
    """The tensor views the bytes object it is given (protobuf's own accessor makes that
    object; the codec adds no second copy)."""
    payload = np.arange(1000, dtype="<i8").tobytes()
    msg = SimpleNamespace(dtype=pb.INT64, shape=[10, 100], data=payload)
    t = tensor_from_proto(msg, "x")  # type: ignore[arg-type]
    assert t.data_ptr() == np.frombuffer(payload, dtype=np.uint8).ctypes.data
    assert t.shape == (10, 100) and int(t[9, 99]) == 999


def test_wire_bytes_are_little_endian_row_major() -> None:
    msg = tensor_to_proto(torch.tensor([[1, 2], [3, 256]], dtype=torch.int32))
    assert msg.data == np.array([1, 2, 3, 256], dtype="<i4").tobytes()
    assert list(msg.shape) == [2, 2] and msg.dtype == pb.INT32


def test_size_mismatch_and_bad_dtype_name_the_field() -> None:
    with pytest.raises(
        BatchValidationError, match=r"^seq_lens: data has 7 bytes, shape \[1\] of INT64 needs 8"
    ):
        tensor_from_proto(pb.Tensor(dtype=pb.INT64, shape=[1], data=b"\0" * 7), "seq_lens")
    with pytest.raises(BatchValidationError, match=r"^input_ids: dtype must be one of"):
        tensor_from_proto(
            pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 8), "input_ids"
        )


def test_batch_round_trip_keeps_every_field() -> None:
    fb = make_extend_batch(
        input_ids=[[1, 2, 3], [4]],
        req_pool_indices=[3, 9],
        out_cache_loc=[[10, 11, 12], [13]],
        prefix_lens=[2, 0],
        prefix_cache_loc=[[5, 6], []],
        sampling=[
            SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=2**64 - 1),
            SamplingParams(logprobs_mode=LogprobsMode.PROCESSED),
        ],
        return_logprob=True,
        top_logprobs_num=5,
    )
    fb = dataclasses.replace(fb, released_req_pool_indices=torch.tensor([7, 8]))
    back = batch_from_proto(batch_to_proto(fb))
    assert back.forward_mode is ForwardMode.EXTEND and back.batch_size == 2
    for name in (
        "input_ids",
        "req_pool_indices",
        "seq_lens",
        "out_cache_loc",
        "extend_prefix_lens",
        "extend_seq_lens",
        "prefix_cache_loc",
        "released_req_pool_indices",
    ):
        assert torch.equal(getattr(back, name), getattr(fb, name)), name
    assert back.positions is None and back.input_embeds is None
    assert back.sampling is not None and fb.sampling is not None
    for f in dataclasses.fields(fb.sampling):
        assert torch.equal(getattr(back.sampling, f.name), getattr(fb.sampling, f.name)), f.name
    assert back.sampling.processed.tolist() == [False, True]
    assert back.return_logprob and back.top_logprobs_num == 5


def test_proto3_defaults_mean_greedy_and_no_truncation() -> None:
    msg = batch_to_proto(
        make_decode_batch(input_ids=[1], req_pool_indices=[1], seq_lens=[2], out_cache_loc=[2])
    )
    msg.sampling_params.add()  # all zero
    s = batch_from_proto(msg).sampling
    assert s is not None
    assert (
        s.temperatures.tolist() == [0.0] and s.top_ps.tolist() == [1.0] and s.top_ks.tolist() == [0]
    )
    assert not bool(s.has_seed[0]) and not bool(s.processed[0])  # LOGPROBS_MODE_RAW


def test_an_unknown_logprobs_mode_is_refused_naming_the_field() -> None:
    msg = batch_to_proto(
        make_decode_batch(
            input_ids=[1, 2], req_pool_indices=[1, 2], seq_lens=[2, 2], out_cache_loc=[2, 3]
        )
    )
    msg.sampling_params.add(logprobs_mode=pb.LOGPROBS_MODE_PROCESSED)
    msg.sampling_params.add(logprobs_mode=7)  # proto3 enums are open: it decodes
    with pytest.raises(BatchValidationError, match=r"sampling_params\[1\]\.logprobs_mode"):
        batch_from_proto(msg)


def test_int32_fields_and_input_embeds_decode() -> None:
    msg = pb.ForwardBatch(forward_mode=pb.DECODE)
    for name, values in (("req_pool_indices", [2]), ("seq_lens", [4]), ("out_cache_loc", [7])):
        getattr(msg, name).CopyFrom(tensor_to_proto(torch.tensor(values, dtype=torch.int32)))
    msg.input_embeds.CopyFrom(tensor_to_proto(torch.ones(1, 8, dtype=torch.bfloat16)))
    fb = batch_from_proto(msg)
    assert fb.req_pool_indices.dtype == torch.int32 and fb.input_ids is None
    assert fb.input_embeds is not None and fb.input_embeds.shape == (1, 8)


def test_idle_batch_needs_no_tensors() -> None:
    fb = batch_from_proto(pb.ForwardBatch(forward_mode=pb.IDLE))
    assert fb.forward_mode is ForwardMode.IDLE and fb.batch_size == 0 and fb.num_tokens == 0


def test_response_round_trip() -> None:
    out = ForwardOutput(
        next_token_ids=torch.tensor([5, 9]),
        stats=StepStats("eager", 2, 2, 7, 7, {"forward": 123, "total": 456}),
        next_token_logprobs=torch.tensor([-0.5, -1.5]),
        top_logprob_ids=torch.tensor([[5, 1], [9, 2]]),
        top_logprobs=torch.tensor([[-0.5, -2.0], [-1.5, -3.0]]),
    )
    back = response_from_proto(response_to_proto(out, batch_id=42))
    assert torch.equal(back.next_token_ids, out.next_token_ids)
    assert torch.equal(back.top_logprob_ids, out.top_logprob_ids)
    assert back.stats == out.stats


def test_the_field_table_names_every_tensor_field_of_the_wire_batch() -> None:
    """`TENSOR_FIELDS` is the codec's list: every Tensor field of the message but the vocab
    mask's (decoded into a `VocabMask` by the controls' codec), and only them; every
    `ForwardBatch` tensor field the step uploads is a row too."""
    wire = {
        f.name
        for f in pb.ForwardBatch.DESCRIPTOR.fields
        if f.message_type is not None and f.message_type.name == "Tensor"
    }
    assert set(WIRE_TENSOR_FIELDS) == wire - {"vocab_mask", "vocab_mask_rows"}
    names = {f.name for f in TENSOR_FIELDS}
    batch_fields = {f.name for f in dataclasses.fields(ForwardBatch)}
    assert names <= batch_fields
    device = {f.name for f in TENSOR_FIELDS if f.device}
    staged = {
        s.name
        for s in make_extend_batch(
            input_ids=[[1, 2]], req_pool_indices=[1], out_cache_loc=[[1, 2]]
        ).staged_fields()
    }
    assert {n for n in staged if "." not in n} <= device
