"""The real gRPC server on a loopback port, driven the way a remote scheduler drives it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.client.scheduler import ReferenceScheduler, generate
from executor.model_executor import ModelExecutor
from executor.service.codec import batch_to_proto
from executor.service.server import RunningServer
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.server_util import Scrape, running_server, tiny_config

PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 3, 77, 250, 12, 9, 31], [9]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with running_server(tiny_config(tmp_path_factory.mktemp("cache"))) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[ExecutorClient]:
    with ExecutorClient(f"127.0.0.1:{server.port}") as c:
        yield c


def local(tmp_path: Path) -> ModelExecutor:
    return ModelExecutor(tiny_config(tmp_path))


def test_get_info_tells_a_scheduler_how_to_allocate(client: ExecutorClient) -> None:
    remote = client.info()
    lim = remote.info.limits
    assert (lim.max_reqs, lim.kv_slots, lim.max_context_len) == (32, 8192, 1024)
    assert lim.max_batch_size == 32 and lim.max_tokens_per_batch == 8192
    assert remote.info.vocab_size == 512 and remote.info.eos_token_ids == (2,)
    assert remote.model_spec == "tiny-random"
    assert remote.info.version and remote.info.attention_backend


def test_forward_gives_the_in_process_tokens(client: ExecutorClient, tmp_path: Path) -> None:
    ex = local(tmp_path)
    remote_limits = client.info().info.limits
    expected = generate(ex.forward, ex.limits, PROMPTS, max_new_tokens=10, ignore_eos=True)
    got = generate(client.forward, remote_limits, PROMPTS, max_new_tokens=10, ignore_eos=True)
    assert got == expected


def test_forward_stream_pipelines_and_keeps_order(client: ExecutorClient, tmp_path: Path) -> None:
    ex = local(tmp_path)
    rows = [20, 21, 22, 23]
    prefills = [
        make_extend_batch(
            input_ids=[p],
            req_pool_indices=[r],
            out_cache_loc=[list(range(200 * r, 200 * r + len(p)))],
            return_logprob=True,
            top_logprobs_num=2,
        )
        for p, r in zip(PROMPTS, rows, strict=True)
    ]
    expected = [ex.forward(b) for b in prefills]
    got = list(client.stream(prefills))  # four independent batches in flight on one stream
    assert [o.next_token_ids.tolist() for o in got] == [o.next_token_ids.tolist() for o in expected]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.next_token_logprobs, e.next_token_logprobs)
        assert torch.equal(g.top_logprob_ids, e.top_logprob_ids)
    # Then dependent decode steps over one interactive session.
    session = client.open_stream()
    tokens = [int(o.next_token_ids[0]) for o in got]
    seq = [len(p) + 1 for p in PROMPTS]
    for step in range(5):
        batch = make_decode_batch(
            input_ids=tokens,
            req_pool_indices=rows,
            seq_lens=seq,
            out_cache_loc=[200 * r + s - 1 for r, s in zip(rows, seq, strict=True)],
        )
        session.send(batch)
        out = session.recv()
        ref = ex.forward(batch)
        assert out.next_token_ids.tolist() == ref.next_token_ids.tolist(), f"step {step}"
        tokens = out.next_token_ids.tolist()
        seq = [s + 1 for s in seq]
        assert out.stats.path == "eager" and out.stats.batch_size == 4
        assert {"queue", "forward", "total"} <= set(out.stats.timings_ns)
    session.close()


def test_reflection_lists_the_services(server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {
        "model_executor.v1.ModelExecutor",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services


def _raw_forward(server: RunningServer, batch: pb.ForwardBatch) -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ModelExecutorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Forward(pb.ForwardRequest(batch_id=7, batch=batch))
    return err.value


def _good() -> pb.ForwardBatch:
    return batch_to_proto(
        make_extend_batch(
            input_ids=[[5, 6, 7]], req_pool_indices=[30], out_cache_loc=[[8000, 8001, 8002]]
        )
    )


def _bad_batches() -> list[tuple[str, pb.ForwardBatch, str]]:
    cases = []
    b = _good()
    b.req_pool_indices.data = b.req_pool_indices.data[:4]
    cases.append(("truncated tensor bytes", b, "req_pool_indices: data has 4 bytes"))
    b = _good()
    b.input_ids.dtype = pb.DTYPE_UNSPECIFIED
    cases.append(("unspecified dtype", b, "input_ids: dtype must be one of"))
    b = _good()
    b.input_ids.dtype = pb.FLOAT32
    b.input_ids.data = b.input_ids.data[:12]
    cases.append(("float token ids", b, "input_ids: dtype must be int32 or int64"))
    b = _good()
    b.ClearField("seq_lens")
    cases.append(("missing seq_lens", b, "seq_lens: is required"))
    b = _good()
    b.forward_mode = 0
    cases.append(("unspecified mode", b, "forward_mode"))
    b = _good()
    b.out_cache_loc.data = (0).to_bytes(8, "little") + b.out_cache_loc.data[8:]
    cases.append(("slot 0", b, "out_cache_loc[0]: must be in 1..8192"))
    b = _good()
    b.sampling_params.add(temperature=-1.0)
    cases.append(("negative temperature", b, "sampling_params[0].temperature"))
    b = _good()
    b.sampling_params.add(top_p=1.5)
    cases.append(("top_p > 1", b, "sampling_params[0].top_p"))
    b = _good()
    b.req_pool_indices.data = (0).to_bytes(8, "little")
    cases.append(("row 0", b, "req_pool_indices[0]: must be in 1..32"))
    b = _good()
    b.extend_prefix_lens.data = (2).to_bytes(8, "little")
    b.seq_lens.data = (5).to_bytes(8, "little")
    cases.append(("prefix the row does not hold", b, "extend_prefix_lens[0]: row 30 holds"))
    return cases


@pytest.mark.parametrize("case", range(len(_bad_batches())), ids=[c[0] for c in _bad_batches()])
def test_invalid_batches_get_invalid_argument_and_the_next_batch_still_works(
    server: RunningServer, client: ExecutorClient, tmp_path: Path, case: int
) -> None:
    name, bad, message = _bad_batches()[case]
    err = _raw_forward(server, bad)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    assert message in err.details(), err.details()
    good = make_extend_batch(
        input_ids=[[5, 6, 7]], req_pool_indices=[31], out_cache_loc=[[8100, 8101, 8102]]
    )
    assert (
        client.forward(good).next_token_ids.tolist()
        == local(tmp_path).forward(good).next_token_ids.tolist()
    )


def test_oversized_batch_gets_resource_exhausted(server: RunningServer) -> None:
    n = 33
    big = make_extend_batch(
        input_ids=[[1]] * n,
        req_pool_indices=list(range(1, n + 1)),
        out_cache_loc=[[i] for i in range(1, n + 1)],
    )
    err = _raw_forward(server, batch_to_proto(big))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_batch_size" in err.details()


def test_a_bad_batch_ends_only_its_own_stream(
    server: RunningServer, client: ExecutorClient
) -> None:
    good = make_extend_batch(
        input_ids=[[3, 4]], req_pool_indices=[29], out_cache_loc=[[7000, 7001]]
    )
    bad = make_extend_batch(input_ids=[[3, 4]], req_pool_indices=[0], out_cache_loc=[[7002, 7003]])
    results = []
    with pytest.raises(grpc.RpcError) as err:
        for out in client.stream([good, bad, good]):
            results.append(out)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(results) == 1
    assert client.health() == "SERVING"
    assert client.forward(good).next_token_ids.shape == (1,)


@pytest.mark.slow
def test_eight_concurrent_clients_fifty_steps_each(server: RunningServer, tmp_path: Path) -> None:
    def run(worker: int) -> list[int]:
        row, base = 1 + worker, 1 + worker * 100
        with ExecutorClient(f"127.0.0.1:{server.port}") as c:
            out = c.forward(
                make_extend_batch(
                    input_ids=[[10 + worker, 11]],
                    req_pool_indices=[row],
                    out_cache_loc=[[base, base + 1]],
                )
            )
            tokens = [int(out.next_token_ids[0])]
            for step in range(49):
                seq = 3 + step
                out = c.forward(
                    make_decode_batch(
                        input_ids=[tokens[-1]],
                        req_pool_indices=[row],
                        seq_lens=[seq],
                        out_cache_loc=[base + seq - 1],
                    )
                )
                tokens.append(int(out.next_token_ids[0]))
        return tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    assert all(len(r) == 50 for r in results)
    ex = local(tmp_path)
    for worker in (0, 7):  # spot-check against the in-process executor
        assert (
            generate(
                ex.forward, ex.limits, [[10 + worker, 11]], max_new_tokens=50, ignore_eos=True
            )[0]
            == results[worker]
        )


def test_full_queue_answers_resource_exhausted(tmp_path: Path) -> None:
    with running_server(tiny_config(tmp_path), queue_size=1) as srv:
        assert srv.worker is not None
        gate = threading.Event()
        real_prepare = srv.worker.executor.prepare

        def blocked_prepare(batch, clock):  # type: ignore[no-untyped-def]
            gate.wait(10)
            return real_prepare(batch, clock)

        srv.worker.executor.prepare = blocked_prepare  # type: ignore[method-assign]
        batches = [
            make_extend_batch(input_ids=[[1]], req_pool_indices=[r], out_cache_loc=[[r]])
            for r in (1, 2, 3)
        ]
        with ExecutorClient(f"127.0.0.1:{srv.port}") as c, ThreadPoolExecutor(3) as pool:
            running = pool.submit(c.forward, batches[0])
            while srv.worker.depth or not srv.worker._in_flight:  # the first one is on the device
                time.sleep(0.01)
            queued = pool.submit(c.forward, batches[1])
            while srv.worker.depth < 1:
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as err:
                c.forward(batches[2])
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue is full" in err.value.details()
            gate.set()
            assert running.result().next_token_ids.shape == (1,)
            assert queued.result().next_token_ids.shape == (1,)


def test_reference_scheduler_through_the_server_equals_in_process(
    client: ExecutorClient, tmp_path: Path
) -> None:
    remote = client.info()
    sched = ReferenceScheduler(client.forward, remote.info.limits, remote.info.eos_token_ids)
    streamed: dict[int, list[int]] = {}
    reqs = [
        sched.add_request(
            p,
            max_new_tokens=12,
            ignore_eos=True,
            on_token=lambda r, t: streamed.setdefault(r.rid, []).append(t),
        )
        for p in PROMPTS
    ]
    sched.run()
    ex = local(tmp_path)
    expected = generate(ex.forward, ex.limits, PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert [r.output_ids for r in reqs] == expected
    assert [streamed[r.rid] for r in reqs] == expected  # tokens were streamed back as they came


@pytest.mark.slow
def test_rows_the_scheduler_releases_stop_counting_as_used(tmp_path: Path) -> None:
    with running_server(tiny_config(tmp_path)) as srv, ExecutorClient(f"127.0.0.1:{srv.port}") as c:
        remote = c.info()
        sched = ReferenceScheduler(c.forward, remote.info.limits, remote.info.eos_token_ids)
        for p in PROMPTS:
            sched.add_request(p, max_new_tokens=4, ignore_eos=True)
        sched.step()  # the prefill: four rows now hold tokens
        assert Scrape(srv).get("model_executor_req_rows_used") == 4
        sched.run()  # finishes, then releases every row on an IDLE step
        scrape = Scrape(srv)
        assert scrape.get("model_executor_req_rows_used") == 0
        assert scrape.get("model_executor_kv_slots_used") == 0
