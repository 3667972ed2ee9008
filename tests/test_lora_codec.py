"""LoRA on the wire: a batch's adapter entries and GetInfo's LoRA fields survive the codec,
and oversized claims are refused from the header."""

from __future__ import annotations

import dataclasses

import pytest

from executor.batch_prep import make_extend_batch
from executor.core.errors import BatchTooLargeError
from executor.core.limits import BatchLimits
from executor.core.lora_types import LoadedAdapter, LoraInfo, RowAdapter
from executor.info import ExecutorInfo
from executor.service.codec import batch_from_proto, batch_to_proto, check_size_claims
from executor.service.lora_codec import add_lora_info_to_proto, lora_info_from_proto
from model_executor.v1 import executor_pb2 as pb

LIMITS = BatchLimits(
    max_reqs=8,
    kv_slots=64,
    max_context_len=32,
    vocab_size=100,
    hidden_size=8,
    max_batch_size=2,
    max_tokens_per_batch=64,
)


def _batch() -> pb.ForwardBatch:
    fb = make_extend_batch(
        input_ids=[[1, 2], [3]], req_pool_indices=[1, 2], out_cache_loc=[[1, 2], [3]]
    )
    fb = dataclasses.replace(fb, row_adapters=(RowAdapter(1, "tenant-a/v3"), RowAdapter(2, "")))
    return batch_to_proto(fb)


def test_row_adapters_round_trip() -> None:
    msg = _batch()
    check_size_claims(msg, LIMITS)
    got = batch_from_proto(pb.ForwardBatch.FromString(msg.SerializeToString()), LIMITS)
    assert got.row_adapters == (RowAdapter(1, "tenant-a/v3"), RowAdapter(2, ""))


def test_too_many_entries_or_a_long_name_is_refused_from_the_header() -> None:
    msg = _batch()
    msg.row_adapters.add(req_pool_index=3, adapter="x")  # 3 entries, max_batch_size 2
    with pytest.raises(BatchTooLargeError, match="row_adapters"):
        check_size_claims(msg, LIMITS)
    msg = _batch()
    msg.row_adapters[0].adapter = "a" * 129
    with pytest.raises(BatchTooLargeError, match=r"row_adapters\[0\].adapter.*128"):
        check_size_claims(msg, LIMITS)


def test_getinfo_lists_adapters_and_caps() -> None:
    info = LoraInfo(
        adapters=(LoadedAdapter("a", "/p/a", 1, 8, ("q_proj", "v_proj"), 0.25),),
        max_loras=4,
        max_lora_rank=16,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
    )
    msg = pb.GetInfoResponse()
    add_lora_info_to_proto(info, msg)
    assert lora_info_from_proto(pb.GetInfoResponse.FromString(msg.SerializeToString())) == info
    assert ExecutorInfo.__dataclass_fields__["lora"].default_factory() == LoraInfo()  # type: ignore[misc]
