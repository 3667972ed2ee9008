"""The seeded structured fuzzer (tests/fuzzer.py) against a live tiny-random server: every
answer is OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED, a refused message changes nothing, the
server stays SERVING, and afterwards it still gives the in-process greedy tokens.
`benchmarks/fuzz.py --messages 100000` is the long run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from executor.batch_prep import make_idle_batch
from executor.client.grpc_client import ExecutorClient
from executor.client.scheduler import generate
from executor.core.errors import BatchValidationError
from executor.model_executor import ModelExecutor
from executor.service.codec import tensor_from_proto
from model_executor.v1 import executor_pb2 as pb
from tests.fuzzer import Fuzzer
from tests.server_util import free_port, running_server, tiny_config

MESSAGES = 1000
KV_KINDS = {"kv_export", "kv_import", "kv_import_chunks", "kv_push"}
PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 3, 77, 250, 12, 9, 31]]


@pytest.mark.slow
def test_fuzzed_batches_are_refused_cleanly_and_leave_the_server_correct(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    dead = f"127.0.0.1:{free_port()}"  # a listed peer where nothing listens
    with running_server(config, queue_size=4, kv_transfer=True, kv_peers=dead) as server:
        fuzzer = Fuzzer(server, seed=14, kv_peer=dead)
        try:
            report = fuzzer.run(MESSAGES)
        finally:
            fuzzer.close()
        assert report.violations == [], report.violations[:10]
        assert report.messages == MESSAGES
        # The run exercised every mutation, and both refusals and accepted work.
        kinds = set(fuzzer.mutators) | {"bit_flip", "truncate", "valid"} | KV_KINDS
        assert kinds == set(report.mutations)
        assert report.codes["OK"] > MESSAGES // 5
        assert report.codes["INVALID_ARGUMENT"] > MESSAGES // 3
        with ExecutorClient(f"127.0.0.1:{server.port}") as client:
            assert client.health() == "SERVING"
            limits = client.info().info.limits
            remote = generate(client.forward, limits, PROMPTS, max_new_tokens=8, ignore_eos=True)
    local = ModelExecutor(config)
    expected = generate(local.forward, local.limits, PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert remote == expected


def test_an_idle_batch_with_top_logprobs_beyond_the_vocabulary_is_refused(tmp_path: Path) -> None:
    """Found by the fuzzer: IDLE skipped this check and the sampler's topk raised (INTERNAL)."""
    ex = ModelExecutor(tiny_config(tmp_path))
    idle = dataclasses.replace(make_idle_batch(), top_logprobs_num=ex.limits.vocab_size + 1)
    with pytest.raises(BatchValidationError, match="top_logprobs_num"):
        ex.forward(idle)


def test_an_empty_tensor_whose_shape_overflows_strides_is_refused() -> None:
    """Found by the fuzzer: shape [0, 2**31, 2**31, 2**31] raised inside torch (INTERNAL)."""
    msg = pb.Tensor(dtype=pb.INT64, shape=[0, 2**31, 2**31, 2**31], data=b"")
    with pytest.raises(BatchValidationError, match=r"input_ids: shape .* is too large"):
        tensor_from_proto(msg, "input_ids")
