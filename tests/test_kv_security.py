"""The KV plane's hardening, each reproduction of the turn-4 review as a test
(../shared/design/reviews/security-turn4.md): runs whose int64 sums wrap are refused and the
server lives (H-1); another caller's rows cannot be read, released or overwritten (C-1);
PushKV dials only its kv_peers (H-2); imported K/V must be finite and ids in the vocabulary
(H-4); KV calls are bounded in time and bytes (H-5); and the plane is off by default."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.client.grpc_client import ExecutorClient
from executor.client.kv_client import PushSpec
from executor.client.speculation import make_verify_batch
from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.core.forward_batch import SamplingParams
from executor.kv_transfer.layout import KVTransferLimits, check_run_bounds, plan_chunks
from executor.service.admission import ByteBudget
from executor.service.codec import tensor_to_proto
from executor.service.info_codec import layout_from_proto
from executor.service.kv_codec import runs_to_proto
from executor.service.kv_peers import PeerList
from executor.service.server import RunningServer
from executor.service.server_config import ServerConfig
from model_executor.v1 import executor_pb2 as pb
from model_executor.v1 import executor_pb2_grpc as pb_grpc
from tests.server_util import free_port, running_server, tiny_config

PROMPT = [101, 7, 333, 42, 250, 9, 77, 500, 13, 411, 64, 128]
WRAPS = np.array([[2**62 + 1, 2**62]] * 4, dtype=np.int64)  # lengths sum to 0 in int64
TOKENS = {"victim": "victim-call-token", "attacker": "attacker-call-token"}
KV_TOKENS = {"victim": "victim-kv-token", "attacker": "attacker-kv-token"}


@pytest.fixture(scope="module")
def silent() -> Iterator[tuple[socket.socket, list[socket.socket]]]:
    """A TCP listener that accepts and never answers (a tarpit), and what it accepted."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield sock, accepted
    sock.close()
    for s in accepted:
        s.close()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, silent: tuple[socket.socket, list[socket.socket]]
) -> Iterator[RunningServer]:
    """Two schedulers told apart by named tokens; the KV plane with its own tokens; the
    tarpit is the one listed peer."""
    d = tmp_path_factory.mktemp("kvsec")
    (d / "call").write_text("".join(f"{who} {t}\n" for who, t in TOKENS.items()))
    (d / "kv").write_text("".join(f"{who} {t}\n" for who, t in KV_TOKENS.items()))
    with running_server(
        tiny_config(d / "cache", kv_slots=4096),
        call_token_file=str(d / "call"),
        kv_transfer=True,
        kv_token_file=str(d / "kv"),
        kv_peers=f"127.0.0.1:{silent[0].getsockname()[1]}",
        kv_call_timeout_s=1.5,
        kv_chunk_timeout_s=0.5,
        refusal_log_interval_s=0,
    ) as running:
        yield running


def _as(server: RunningServer, who: str) -> ExecutorClient:
    return ExecutorClient(f"127.0.0.1:{server.port}", token=TOKENS[who], kv_token=KV_TOKENS[who])


def _prefill(c: ExecutorClient, row: int, first: int, prompt: list[int] = PROMPT) -> int:
    out = c.forward(
        make_extend_batch(
            input_ids=[prompt], req_pool_indices=[row],
            out_cache_loc=[list(range(first, first + len(prompt)))],
        )
    )  # fmt: skip
    return int(out.next_token_ids[0])


def _decode(c: ExecutorClient, row: int, token: int, slot: int, n: int = 4) -> list[int]:
    out = []
    for k in range(n):
        res = c.forward(
            make_decode_batch(
                input_ids=[token], req_pool_indices=[row], seq_lens=[len(PROMPT) + 1 + k],
                out_cache_loc=[slot + k],
            )
        )  # fmt: skip
        token = int(res.next_token_ids[0])
        out.append(token)
    return out


def _release(c: ExecutorClient, *rows: int) -> None:
    c.forward(
        dataclasses.replace(
            make_idle_batch(), released_req_pool_indices=torch.tensor(rows, dtype=torch.int64)
        )
    )


def _import_stream(
    layout: pb.KvLayout, row: int, first: int, n: int, fill: bytes, tokens: list[int] | None
) -> list[pb.KvImportRequest]:
    """A whole import of `n` slots whose K/V bytes repeat `fill`."""
    lay = layout_from_proto(layout, "kv_layout")
    header = pb.KvImportHeader(
        transfer_id=int.from_bytes(np.random.bytes(7), "little") + 1, req_pool_index=row,
        slots=runs_to_proto(np.array([[first, n]])), layout=layout,
    )  # fmt: skip
    if tokens is not None:
        header.token_ids.CopyFrom(tensor_to_proto(torch.tensor(tokens, dtype=torch.int64)))
    out = [pb.KvImportRequest(header=header)]
    for spec in plan_chunks(n, lay, layout.chunk_bytes):
        size = spec.count * lay.slot_bytes
        data = (fill * (size // len(fill) + 1))[:size]
        chunk = pb.KvChunk(
            rank=0, layer=spec.layer, kind=spec.kind, first=spec.first, count=spec.count,
            data=data, crc32=zlib.crc32(data) & 0xFFFFFFFF,
        )  # fmt: skip
        out.append(pb.KvImportRequest(chunk=chunk))
    return out


def _refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    return err.value


# --- H-1: run arithmetic -------------------------------------------------------------------


def test_runs_are_checked_in_python_integers() -> None:
    limits = KVTransferLimits(max_slots=1024, max_runs=64)
    with pytest.raises(BatchValidationError, match=r"length must be in 1\.\.max_transfer_slots"):
        check_run_bounds(WRAPS, "runs", limits, 4096)
    many = np.array([[1 + 600 * i, 600] for i in range(4)], dtype=np.int64)
    with pytest.raises(BatchTooLargeError, match="max_transfer_slots"):
        check_run_bounds(many, "runs", limits, 4096)
    edges = np.array([[2**63 - 1, 1]], dtype=np.int64)
    with pytest.raises(BatchValidationError, match=r"1\.\.kv_slots"):
        check_run_bounds(edges, "runs", limits, 4096)
    assert check_run_bounds(np.array([[5, 3], [20, 2]]), "runs", limits, 4096) == 5


def test_runs_that_wrap_int64_are_refused_on_every_kv_path_and_the_server_lives(
    server: RunningServer,
) -> None:
    """The review's crash (SIGSEGV in np.repeat) through ExportKV, ImportKV and PushKV (its
    source and its target runs, which would have crashed the peer)."""
    runs = runs_to_proto(WRAPS)
    with _as(server, "victim") as c:
        stub, kv = c.stub, c._kv_auth
        layout = stub.GetInfo(pb.GetInfoRequest(), timeout=10, metadata=c._auth).kv_layout
        header = pb.KvImportHeader(transfer_id=1, req_pool_index=3, slots=runs, layout=layout)
        peer = server.servicer.kv.channels.peers
        target = next(iter(peer.exact))
        calls = {
            "export": lambda: list(stub.ExportKV(pb.KvExportRequest(slots=runs), metadata=kv)),
            "import": lambda: stub.ImportKV(iter([pb.KvImportRequest(header=header)]), metadata=kv),
            "push source": lambda: stub.PushKV(
                pb.KvPushRequest(transfers=[pb.KvPushTransfer(
                    transfer_id=1, source_slots=runs, target=f"{target[0]}:{target[1]}",
                    target_req_pool_index=1, target_slots=runs_to_proto(np.array([[1, 1]])),
                )]), metadata=kv),
            "push target": lambda: stub.PushKV(
                pb.KvPushRequest(transfers=[pb.KvPushTransfer(
                    transfer_id=1, source_slots=runs_to_proto(np.array([[1, 1]])),
                    target=f"{target[0]}:{target[1]}", target_req_pool_index=1, target_slots=runs,
                )]), metadata=kv),
        }  # fmt: skip
        for name, call in calls.items():
            err = _refused(call)
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (name, err.details())
            assert "runs" in (err.details() or ""), name
        assert c.health() == "SERVING" and len(server.servicer.kv.channels) == 0


# --- C-1: another caller's rows ------------------------------------------------------------


def test_another_callers_rows_cannot_be_read_released_or_overwritten(
    server: RunningServer,
) -> None:
    victim, attacker = _as(server, "victim"), _as(server, "attacker")
    with victim, attacker:
        first = _prefill(victim, 6, 1000)
        reference = _decode(victim, 6, first, 1000 + len(PROMPT))
        assert _prefill(victim, 5, 2300) == first
        # the victim itself exports its own request, token ids included
        assert victim.kv.export(list(range(2300, 2312))).token_ids == PROMPT
        # read: refused whole, and a live slot reads the same as a free one (no slot map)
        err = _refused(lambda: attacker.kv.export(list(range(2300, 2312))))
        free = _refused(lambda: attacker.kv.export([3900]))
        assert err.code() is free.code() is grpc.StatusCode.PERMISSION_DENIED
        assert err.details() == free.details()
        assert "2300" not in (err.details() or "") and "101" not in (err.details() or "")
        # release through Forward, then import over it: both refused
        err = _refused(lambda: _release(attacker, 5))
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "released_req_pool_indices" in (err.details() or "")
        layout = attacker.stub.GetInfo(
            pb.GetInfoRequest(), timeout=10, metadata=attacker._auth
        ).kv_layout
        nan = _import_stream(layout, 5, 2300, len(PROMPT), struct.pack("<f", 0.5), PROMPT)
        err = _refused(lambda: attacker.stub.ImportKV(iter(nan), metadata=attacker._kv_auth))
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED
        # its decode steps and a prefix read of the victim's slots are refused too
        err = _refused(lambda: _decode(attacker, 5, first, 2400, n=1))
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED
        steal = make_extend_batch(
            input_ids=[[7]], req_pool_indices=[9], out_cache_loc=[[3000]], prefix_lens=[12],
            prefix_cache_loc=[list(range(2300, 2312))],
        )  # fmt: skip
        err = _refused(lambda: attacker.forward(steal))
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "prefix_cache_loc" in (err.details() or "")
        # the victim's request is untouched
        assert _decode(victim, 5, first, 2300 + len(PROMPT)) == reference
        _release(victim, 5, 6)
        # a scheduler holding only the call token does not open the KV plane
        plain = ExecutorClient(f"127.0.0.1:{server.port}", token=TOKENS["victim"])
        with plain:
            err = _refused(lambda: plain.kv.export([1]))
            assert err.code() is grpc.StatusCode.UNAUTHENTICATED
            assert "kv_token_file" in (err.details() or "")


# --- H-4, imports: finite K/V, ids in the vocabulary ---------------------------------------


def test_imports_need_finite_kv_and_ids_in_the_vocabulary(server: RunningServer) -> None:
    with _as(server, "victim") as c:
        layout = c.stub.GetInfo(pb.GetInfoRequest(), timeout=10, metadata=c._auth).kv_layout
        vocab = c.info().info.vocab_size
        for fill, tokens, field in (
            (struct.pack("<f", float("nan")), [5] * 8, "data"),
            (struct.pack("<f", float("inf")), [5] * 8, "data"),
            (struct.pack("<f", 0.25), [5] + [10**9] * 7, "token_ids[1]"),
            (struct.pack("<f", 0.25), [5, vocab, 5, 5, 5, 5, 5, 5], "token_ids[1]"),
            (struct.pack("<f", 0.25), [-2] * 8, "token_ids[0]"),
        ):
            stream = _import_stream(layout, 20, 3000, 8, fill, tokens)
            err = _refused(lambda s=stream: c.stub.ImportKV(iter(s), metadata=c._kv_auth))
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
            assert field in (err.details() or "")
        assert server.executor is not None
        assert server.executor.req_to_token_pool.resident_lens[20] == 0
        # unknown ids (-1) are allowed, and prompt lookup never drafts them into the model
        stream = _import_stream(layout, 20, 3000, 8, struct.pack("<f", 0.25), [5] + [-1] * 7)
        assert c.stub.ImportKV(iter(stream), metadata=c._kv_auth).num_slots == 8
        verify = make_verify_batch(
            last_tokens=[5], req_pool_indices=[20], prefix_lens=[8],
            slots=[[3008, 3009, 3010]], ngrams=[1], sampling=[SamplingParams()],
        )  # fmt: skip
        out = c.forward(verify)
        assert int(out.next_token_ids.numel()) >= 1
        _release(c, 20)


# --- H-2: only configured peers ------------------------------------------------------------


def test_a_push_dials_only_its_kv_peers(
    server: RunningServer, silent: tuple[socket.socket, list[socket.socket]]
) -> None:
    """The review's SSRF and port scan: every target that kv_peers does not name is refused
    before a channel exists; the answer is the same whatever listens there."""
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(4)
    listening = f"127.0.0.1:{other.getsockname()[1]}"
    with _as(server, "victim") as c:
        _prefill(c, 4, 1500)
        for target in (
            listening, f"127.0.0.1:{free_port()}", f"127.0.0.1:{server.port}",
            f"127.0.0.1:{server.metrics_port}", "unix:/tmp/no-such-socket",
            "dns:///no-such-host.invalid:50051", "unix-abstract:x", "a" * 4000,
        ):  # fmt: skip
            err = _refused(
                lambda t=target: c.kv.push(
                    [PushSpec(list(range(1500, 1512)), t, 3, list(range(1, 13)))]
                )
            )
            assert err.code() is grpc.StatusCode.PERMISSION_DENIED, target
            assert "not one of this executor's kv_peers" in (err.details() or "")
            assert len(err.details() or "") < 300
        assert len(server.servicer.kv.channels) == 0  # nothing was dialed
        other.settimeout(0.2)
        with pytest.raises(TimeoutError):
            other.accept()
        _release(c, 4)
    other.close()


def test_peer_lists_parse_and_match_exactly() -> None:
    peers = PeerList.parse(
        "exec-0.exec.llm.svc:50051, *.exec.llm.svc:50052, [::1]:7, unix:/run/p, "
        "10.244.0.0/16:50051, [fd00::/8]:50051"
    )
    field = "transfers[0].target"
    assert peers.admit("exec-0.exec.llm.svc:50051", field) == "exec-0.exec.llm.svc:50051"
    assert peers.admit("dns:///EXEC-0.exec.llm.svc:50051", field) == "exec-0.exec.llm.svc:50051"
    assert peers.admit("exec-9.exec.llm.svc:50052", field) == "exec-9.exec.llm.svc:50052"
    assert peers.admit("[::1]:7", field) == "[::1]:7" and peers.admit("unix:/run/p", field)
    assert peers.admit("10.244.3.7:50051", field) == "10.244.3.7:50051"
    assert peers.admit("[fd00::3]:50051", field) == "[fd00::3]:50051"
    for refused in (
        "exec-0.exec.llm.svc:50053", "exec.llm.svc:50052", "evil.svc:50052", "exec.llm.svc.evil:50052",
        "dns://8.8.8.8/exec-0.exec.llm.svc:50051", "unix:/run/other", "ipv4:127.0.0.1:7",
        "exec-0.exec.llm.svc:50051/x", "10.245.0.1:50051", "10.244.3.7:50052",
        "10-244-3-7.pod:50051",
    ):  # fmt: skip
        with pytest.raises(PermissionError):
            peers.admit(refused, field)
    with pytest.raises(PermissionError, match="kv_peers is empty"):
        PeerList.parse("").admit("a:1", field)
    with pytest.raises(ValueError):
        PeerList.parse("a*.b:1")


# --- H-5: KV calls are bounded in time and bytes -------------------------------------------


@pytest.mark.slow
def test_kv_calls_end_at_their_server_side_deadline(
    server: RunningServer, silent: tuple[socket.socket, list[socket.socket]]
) -> None:
    """A half-sent import is cancelled after kv_chunk_timeout_s, a push to a tarpit after
    kv_call_timeout_s, whatever deadline the caller set; their places are free again."""
    with _as(server, "victim") as c:
        layout = c.stub.GetInfo(pb.GetInfoRequest(), timeout=10, metadata=c._auth).kv_layout
        header = _import_stream(layout, 11, 3500, 4, b"\0", None)[0]
        hold = threading.Event()

        def half_sent() -> Iterator[pb.KvImportRequest]:
            yield header
            hold.wait(30)

        t0 = time.monotonic()
        err = _refused(lambda: c.stub.ImportKV(half_sent(), timeout=60, metadata=c._kv_auth))
        hold.set()
        assert err.code() is grpc.StatusCode.CANCELLED and time.monotonic() - t0 < 5
        _prefill(c, 4, 1500)
        tarpit = f"127.0.0.1:{silent[0].getsockname()[1]}"
        t0 = time.monotonic()
        [result] = c.kv.push(
            [PushSpec(list(range(1500, 1512)), tarpit, 3, list(range(1, 13)), timeout_s=1e9)],
            timeout=60,
        )
        assert not result.ok and result.code == "DEADLINE_EXCEEDED"
        assert time.monotonic() - t0 < 5
        assert server.servicer.kv_calls._taken == 0
        _release(c, 4)


def test_import_staging_counts_against_the_byte_budget(server: RunningServer) -> None:
    kv = server.servicer.kv
    real = kv.byte_budget
    with _as(server, "victim") as c:
        layout = c.stub.GetInfo(pb.GetInfoRequest(), timeout=10, metadata=c._auth).kv_layout
        stream = _import_stream(layout, 12, 3600, 8, struct.pack("<f", 0.5), None)
        kv.byte_budget = ByteBudget(1000)  # less than 8 slots of this layout
        try:
            err = _refused(lambda: c.stub.ImportKV(iter(stream), metadata=c._kv_auth))
            assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "batch_budget_mib" in (err.details() or "")
            kv.byte_budget = ByteBudget(1 << 20)
            assert c.stub.ImportKV(iter(stream), metadata=c._kv_auth).num_slots == 8
            assert kv.byte_budget.taken == 0  # given back when the import ended
        finally:
            kv.byte_budget = real
        _release(c, 12)


# --- the door: off by default, and its settings --------------------------------------------


def test_the_kv_plane_is_off_by_default(tmp_path: Path) -> None:
    with running_server(tiny_config(tmp_path)) as srv, ExecutorClient(f"127.0.0.1:{srv.port}") as c:
        for call in (
            lambda: c.kv.export([1]),
            lambda: c.kv.push([PushSpec([1], "127.0.0.1:1", 1, [1])]),
        ):
            err = _refused(call)
            assert err.code() is grpc.StatusCode.UNIMPLEMENTED
            assert "--kv-transfer" in (err.details() or "")
        stub = pb_grpc.ModelExecutorStub(c.channel)
        err = _refused(lambda: stub.ImportKV(iter([]), timeout=5))
        assert err.code() is grpc.StatusCode.UNIMPLEMENTED


def test_kv_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="own credential"):
        ServerConfig(host="0.0.0.0", kv_transfer=True)
    ServerConfig(host="0.0.0.0", kv_transfer=True, kv_token_file="kv")
    with pytest.raises(ValueError, match="kv_peers needs kv_transfer"):
        ServerConfig(kv_peers="a:1")
    with pytest.raises(ValueError, match="allowed_kv_identities needs tls_client_ca_file"):
        ServerConfig(allowed_kv_identities="x")
    with pytest.raises(ValueError, match="rpc_threads"):
        ServerConfig(kv_transfer=True, rpc_threads=8, max_forward_calls=7)
    with pytest.raises(ValueError, match="loopback"):
        ServerConfig(host="0.0.0.0", operator_calls_open=True)
    with pytest.raises(ValueError, match="tls_client_ca_file"):
        ServerConfig(kv_transfer=True, kv_peers="a:1", tls_cert_file="c", tls_key_file="k")
