"""The KV data plane end to end: a request prefilled on executor A and decoded on executor B
(after a push, or an export and an import) samples what one executor alone samples; a
migration between steps too; every refusal leaves both caches exactly as they were."""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.client.disaggregated import DisaggregatedScheduler, TransferFailed, migrate
from executor.client.grpc_client import ExecutorClient
from executor.client.kv_client import ExportedKV, PushSpec, slot_runs
from executor.client.scheduler import ReferenceScheduler, generate
from executor.core.errors import BatchValidationError, KVChecksumError
from executor.kv_transfer.layout import coalesce, expand_runs, plan_chunks
from executor.kv_transfer.staging import Chunk, ImportHeader, ImportStaging
from executor.model_executor import ModelExecutor
from executor.service.server import RunningServer
from executor.service.tls import channel_credentials
from model_executor.v1 import executor_pb2 as pb
from ops.checksum import checksum
from tests.server_util import Scrape, free_port, running_server, tiny_config
from tests.tls_util import Issued, TestCA

PROMPTS = [
    [11, 42, 7, 300, 5, 91, 18, 256, 3],
    [77, 4, 4, 123, 401, 60],
    [500, 2, 31, 8, 19, 250, 333, 41, 12, 9, 140, 27, 15],
]
NEW_TOKENS = 8


DEAD = free_port()  # a peer A may push to (listed in its kv_peers) where nothing listens


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, RunningServer]]:
    cache = tmp_path_factory.mktemp("cache")
    with running_server(tiny_config(cache, kv_slots=512), kv_transfer=True) as b:
        peers = f"127.0.0.1:{b.port},127.0.0.1:{DEAD}"
        with running_server(
            tiny_config(cache, kv_slots=1024), kv_transfer=True, kv_peers=peers
        ) as a:
            yield a, b


def _client(server: RunningServer) -> ExecutorClient:
    return ExecutorClient(f"127.0.0.1:{server.port}")


def cache_digest(executor: ModelExecutor) -> str:
    """Everything a transfer may change: all K/V, the row table, resident lengths, the slot
    owners and each slot's token. Call while the server is idle."""
    pool, kv = executor.req_to_token_pool, executor.kv_pool
    h = hashlib.sha256()
    for t in (kv.k, kv.v, pool.req_to_token, executor.controls.slot_tokens.tokens):
        h.update(t.cpu().contiguous().view(-1).numpy().view(np.uint8).tobytes())
    h.update(pool.resident_lens.tobytes())
    assert pool.owners is not None
    h.update(pool.owners.refs.tobytes())
    h.update(pool.owners.table.tobytes())
    return h.hexdigest()


def _prefill(c: ExecutorClient, prompt: list[int], row: int, slots: list[int]) -> int:
    out = c.forward(
        make_extend_batch(input_ids=[prompt], req_pool_indices=[row], out_cache_loc=[slots])
    )
    return int(out.next_token_ids[0])


def _decode(
    c: ExecutorClient, token: int, row: int, held: int, slots: list[int], steps: int
) -> list[int]:
    """`steps` greedy DECODE steps of a row holding `held` tokens whose next input is `token`."""
    out = []
    for i in range(steps):
        res = c.forward(
            make_decode_batch(
                input_ids=[token],
                req_pool_indices=[row],
                seq_lens=[held + i + 1],
                out_cache_loc=[slots[i]],
            )
        )
        token = int(res.next_token_ids[0])
        out.append(token)
    return out


def _release(c: ExecutorClient, row: int) -> None:
    """Free a row: an IDLE batch that releases it (its slots are free again)."""
    batch = dataclasses.replace(
        make_idle_batch(), released_req_pool_indices=torch.tensor([row], dtype=torch.int64)
    )
    c.forward(batch)


def _alone(c: ExecutorClient, prompt: list[int], row: int, base: int) -> list[int]:
    n = len(prompt)
    first = _prefill(c, prompt, row, list(range(base, base + n)))
    rest = _decode(c, first, row, n, list(range(base + n, base + n + NEW_TOKENS)), NEW_TOKENS - 1)
    _release(c, row)
    return [first, *rest]


def test_runs_coalesce_and_expand() -> None:
    slots = np.array([5, 6, 7, 9, 10, 3], dtype=np.int64)
    runs = coalesce(slots)
    assert runs.tolist() == [[5, 3], [9, 2], [3, 1]]
    assert expand_runs(runs).tolist() == slots.tolist()


def test_get_info_reports_the_kv_layout_and_caps(pair: tuple[RunningServer, RunningServer]) -> None:
    a, _ = pair
    with _client(a) as c:
        info = c.info().info
    layout, limits = info.kv_layout, info.kv_transfer_limits
    assert layout is not None and limits is not None
    ex = a.executor
    assert layout.num_layers == ex.kv_pool.num_layers
    assert layout.kv_heads == ex.kv_pool.num_kv_heads and layout.head_dim == ex.kv_pool.head_dim
    assert layout.kv_slots == 1024 and layout.tp_size == 1
    assert layout.bytes_per_slot == 2 * ex.kv_pool.k[:, 1].numel() * ex.kv_pool.k.element_size()
    assert limits.max_slots == ex.limits.max_context_len and limits.chunk_bytes > 0
    assert limits == ex.kv_transfer.limits  # every cap travels (pushes, transfer-id memory)


def test_a_push_of_more_transfers_than_the_cap_is_refused_whole(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    a, b = pair
    cap = a.executor.kv_transfer.limits.max_push_transfers
    spec = PushSpec([1], f"127.0.0.1:{b.port}", 1, [1])
    with _client(a) as ca, pytest.raises(grpc.RpcError) as err:
        ca.kv.push([spec] * (cap + 1))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_push_transfers" in (err.value.details() or "")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_on_a_push_decode_on_b_equals_one_executor(
    pair: tuple[RunningServer, RunningServer], prompt: list[int]
) -> None:
    a, b = pair
    with _client(a) as ca, _client(b) as cb:
        want = _alone(ca, prompt, row=3, base=1)
        n = len(prompt)
        a_slots = list(range(200, 200 + n))
        first = _prefill(ca, prompt, 2, a_slots)
        b_slots = [400 - i for i in range(n)]  # descending: one run per slot on B
        results = ca.kv.push([PushSpec(a_slots, f"127.0.0.1:{b.port}", 5, b_slots)])
        assert results[0].ok, results[0]
        assert results[0].nbytes == n * b.executor.kv_transfer.layout.bytes_per_slot
        _release(ca, 2)
        rest = _decode(cb, first, 5, n, list(range(1, NEW_TOKENS)), NEW_TOKENS - 1)
        _release(cb, 5)
    assert [first, *rest] == want


def test_export_then_import_through_the_scheduler_equals_one_executor(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    a, b = pair
    prompt = PROMPTS[0]
    n = len(prompt)
    with _client(a) as ca, _client(b) as cb:
        want = _alone(ca, prompt, row=3, base=1)
        first = _prefill(ca, prompt, 2, list(range(100, 100 + n)))
        exported = ca.kv.export(list(range(100, 100 + n)))
        assert exported.token_ids == prompt  # each slot's token travels with its KV
        answer = cb.kv.import_(exported, 6, list(range(50, 50 + n)))
        assert answer.num_slots == n and not answer.replayed
        _release(ca, 2)
        rest = _decode(cb, first, 6, n, list(range(60, 60 + NEW_TOKENS)), NEW_TOKENS - 1)
        back = cb.kv.export(list(range(50, 50 + n)))
        assert back.token_ids == prompt
        _release(cb, 6)
    assert [first, *rest] == want


def test_a_request_migrates_between_two_decode_steps(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    a, b = pair
    prompt = PROMPTS[2]
    n, before = len(prompt), 3
    with _client(a) as ca, _client(b) as cb:
        want = _alone(ca, prompt, row=3, base=1)
        slots_a = list(range(300, 300 + n + before))
        first = _prefill(ca, prompt, 4, slots_a[:n])
        got = [first, *_decode(ca, first, 4, n, slots_a[n:], before)]
        held = n + before  # the KV of the prompt and of `before` decoded inputs
        slots_b = list(range(10, 10 + held))
        [result] = ca.kv.push([PushSpec(slots_a, f"127.0.0.1:{b.port}", 7, slots_b)])
        assert result.ok, result
        _release(ca, 4)
        got += _decode(cb, got[-1], 7, held, list(range(100, 120)), NEW_TOKENS - len(got))
        _release(cb, 7)
    assert got == want


def test_a_corrupted_chunk_is_data_loss_and_changes_nothing(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    a, b = pair
    prompt = PROMPTS[1]
    n = len(prompt)
    with _client(a) as ca, _client(b) as cb:
        _prefill(ca, prompt, 2, list(range(100, 100 + n)))
        before_a = cache_digest(a.executor)
        exported = ca.kv.export(list(range(100, 100 + n)))
        assert cache_digest(a.executor) == before_a  # an export changes nothing
        _release(ca, 2)
        damaged = bytearray(exported.chunks[-1].data)
        damaged[3] ^= 0x40
        exported.chunks[-1].data = bytes(damaged)
        before = cache_digest(b.executor)
        with pytest.raises(grpc.RpcError) as err:
            cb.kv.import_(exported, 6, list(range(50, 50 + n)))
        assert err.value.code() is grpc.StatusCode.DATA_LOSS
        assert "crc32 mismatch" in (err.value.details() or "")
        assert cache_digest(b.executor) == before


def test_an_imported_prefix_is_continued_by_an_extend_and_shared_through_prefix_cache_loc(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    """The imported row continues with an EXTEND (its prefix held), and another row reads the
    imported slots through prefix_cache_loc: both sample what a whole-prompt prefill does."""
    a, b = pair
    prompt, k = PROMPTS[2], 8
    n = len(prompt)
    with _client(a) as ca, _client(b) as cb:
        want = _prefill(ca, prompt, 3, list(range(1, 1 + n)))
        _release(ca, 3)
        _prefill(ca, prompt[:k], 2, list(range(100, 100 + k)))
        exported = ca.kv.export(list(range(100, 100 + k)))
        _release(ca, 2)
        cb.kv.import_(exported, 6, list(range(50, 50 + k)))
        rest = list(range(60, 60 + n - k))
        continued = cb.forward(
            make_extend_batch(
                input_ids=[prompt[k:]], req_pool_indices=[6], out_cache_loc=[rest], prefix_lens=[k]
            )
        )
        shared = cb.forward(
            make_extend_batch(
                input_ids=[prompt[k:]],
                req_pool_indices=[7],
                out_cache_loc=[list(range(80, 80 + n - k))],
                prefix_lens=[k],
                prefix_cache_loc=[list(range(50, 50 + k))],
            )
        )
        _release(cb, 6)
        _release(cb, 7)
    assert int(continued.next_token_ids[0]) == want == int(shared.next_token_ids[0])


def test_an_import_into_a_held_slot_or_row_is_refused_and_changes_nothing(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    a, b = pair
    prompt = PROMPTS[1]
    n = len(prompt)
    with _client(a) as ca, _client(b) as cb:
        _prefill(ca, prompt, 2, list(range(100, 100 + n)))
        exported = ca.kv.export(list(range(100, 100 + n)))
        _release(ca, 2)
        _prefill(cb, [1, 2, 3], 8, [70, 71, 72])  # a live request on B holds 70..72
        before = cache_digest(b.executor)
        with pytest.raises(grpc.RpcError) as err:
            cb.kv.import_(exported, 6, [68, 69, 70, 71, 72, 73])
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "position 2" in (err.value.details() or "")  # its own list: no slot map
        with pytest.raises(grpc.RpcError) as err:
            cb.kv.import_(exported, 8, list(range(50, 50 + n)))
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "row 8" in (err.value.details() or "")
        assert cache_digest(b.executor) == before
        _release(cb, 8)


def test_a_push_to_an_unreachable_peer_fails_per_transfer_and_changes_nothing(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    a, b = pair
    with _client(a) as ca:
        _prefill(ca, PROMPTS[0], 2, list(range(100, 109)))
        before = cache_digest(a.executor), cache_digest(b.executor)
        scrape = Scrape(a)
        dead = f"127.0.0.1:{DEAD}"
        peer = f"127.0.0.1:{b.port}"
        results = ca.kv.push(
            [
                PushSpec(list(range(100, 109)), dead, 5, list(range(1, 10)), timeout_s=5),
                PushSpec([500], peer, 9, [20]),  # a slot A does not hold
            ],
            attempts=2,  # the unreachable one is tried twice, the refused one once
        )
        assert cache_digest(b.executor) == before[1]  # neither reached B's cache
        failed = {"direction": "push", "outcome": "failed"}
        tries = Scrape(a).get("model_executor_kv_transfers_total", **failed) - scrape.get(
            "model_executor_kv_transfers_total", **failed
        )
        assert tries == 3  # the unreachable transfer twice, the refused one once
        [ok] = ca.kv.push([PushSpec(list(range(100, 109)), peer, 8, list(range(1, 10)))])
        assert ok.ok  # the peer and the source are fine: the failures were the transfers'
        assert not results[0].ok and results[0].code == "UNAVAILABLE", results[0]
        assert dead in results[0].message
        assert not results[1].ok and results[1].code == "FAILED_PRECONDITION"
        assert "transfer slot 0" in results[1].message
        assert cache_digest(a.executor) == before[0]  # a push never changes its source
        with _client(b) as cb:
            _release(cb, 8)
        _release(ca, 2)


def test_a_retried_import_applies_nothing_twice(pair: tuple[RunningServer, RunningServer]) -> None:
    a, b = pair
    n = 4
    with _client(a) as ca, _client(b) as cb:
        _prefill(ca, [9, 8, 7, 6], 2, list(range(100, 100 + n)))
        exported = ca.kv.export(list(range(100, 100 + n)))
        _release(ca, 2)
        first = cb.kv.import_(exported, 6, list(range(30, 30 + n)), transfer_id=4242)
        assert not first.replayed
        after = cache_digest(b.executor)
        again = cb.kv.import_(exported, 6, list(range(30, 30 + n)), transfer_id=4242)
        assert again.replayed and cache_digest(b.executor) == after
        with pytest.raises(grpc.RpcError) as err:  # the same id for another import
            cb.kv.import_(exported, 9, list(range(40, 40 + n)), transfer_id=4242)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "transfer_id" in (err.value.details() or "")
        _release(cb, 6)
        # A push resent under its transfer id (its answer was lost) is answered from memory.
        _prefill(ca, [9, 8, 7, 6], 2, list(range(100, 100 + n)))
        spec = PushSpec(list(range(100, 100 + n)), f"127.0.0.1:{b.port}", 6, [31, 33, 35, 37])
        [first_push] = ca.kv.push([dataclasses.replace(spec, transfer_id=4343)])
        after = cache_digest(b.executor)
        [again_push] = ca.kv.push([dataclasses.replace(spec, transfer_id=4343)], attempts=3)
        assert first_push.ok and not first_push.replayed
        assert again_push.ok and again_push.replayed and cache_digest(b.executor) == after
        _release(ca, 2)
        _release(cb, 6)


def test_sizes_are_refused_from_the_header(pair: tuple[RunningServer, RunningServer]) -> None:
    a, _ = pair
    limits = a.executor.kv_transfer.limits
    with _client(a) as c:
        too_many = list(range(1, 2 * limits.max_runs + 2, 2))  # every slot its own run
        with pytest.raises(grpc.RpcError) as err:
            c.kv.export(too_many)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_transfer_runs" in (err.value.details() or "")
        for slots, rule in (([0, 1], "1..kv_slots"), ([5, 5], "twice"), ([2000], "1..kv_slots")):
            with pytest.raises(grpc.RpcError) as err:
                c.kv.export(slots)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert rule in (err.value.details() or "")


def test_chunks_are_bounded_and_carry_their_checksum(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    a, _ = pair
    kvt = a.executor.kv_transfer
    n = 20
    with _client(a) as c:
        _prefill(c, list(range(1, n + 1)), 2, list(range(600, 600 + n)))
        exported = c.kv.export(list(range(600, 600 + n)))
        _release(c, 2)
    assert (
        exported.header.num_chunks
        == len(exported.chunks)
        == len(plan_chunks(n, kvt.layout, kvt.limits.chunk_bytes))
    )
    for chunk in exported.chunks:
        assert len(chunk.data) <= kvt.limits.chunk_bytes
        assert checksum(chunk.data) == chunk.crc32
    assert exported.nbytes == n * kvt.layout.bytes_per_slot
    assert slot_runs(list(range(600, 620))).runs.shape == [1, 2]  # one run, not 20


def test_transfers_are_counted_per_direction(pair: tuple[RunningServer, RunningServer]) -> None:
    a, b = pair
    n = 5
    before_a, before_b = Scrape(a), Scrape(b)
    with _client(a) as ca, _client(b) as cb:
        _prefill(ca, [1, 2, 3, 4, 5], 2, list(range(100, 100 + n)))
        [ok] = ca.kv.push(
            [PushSpec(list(range(100, 100 + n)), f"127.0.0.1:{b.port}", 9, list(range(1, 1 + n)))]
        )
        [bad] = ca.kv.push([PushSpec([900], f"127.0.0.1:{b.port}", 10, [30])])
        _release(ca, 2)
        _release(cb, 9)
    assert ok.ok and not bad.ok
    after_a, after_b = Scrape(a), Scrape(b)
    nbytes = n * a.executor.kv_transfer.layout.bytes_per_slot

    def delta(after: Scrape, before: Scrape, name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    push = {"direction": "push"}
    assert delta(after_a, before_a, "model_executor_kv_transfers_total", outcome="ok", **push) == 1
    assert (
        delta(after_a, before_a, "model_executor_kv_transfers_total", outcome="failed", **push) == 1
    )
    assert delta(after_a, before_a, "model_executor_kv_transfer_bytes_total", **push) == nbytes
    assert delta(after_a, before_a, "model_executor_kv_transfer_seconds_count", **push) == 2
    imp = {"direction": "import"}
    assert delta(after_b, before_b, "model_executor_kv_transfers_total", outcome="ok", **imp) == 1
    assert delta(after_b, before_b, "model_executor_kv_transfer_bytes_total", **imp) == nbytes


# --- the reference scheduler: disaggregated prefill/decode, migration, the CLI ---------------


def test_disaggregated_generate_equals_one_executor(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    a, b = pair
    prompts = [*PROMPTS, [3, 1, 4, 1, 5, 9, 2, 6]]
    budgets = [NEW_TOKENS, 1, 5, 12]
    with _client(a) as ca, _client(b) as cb:
        want = [
            generate(ca.retrying(), ca.info().info.limits, [p], max_new_tokens=m, ignore_eos=True)[
                0
            ]
            for p, m in zip(prompts, budgets, strict=True)
        ]
        sched = DisaggregatedScheduler(ca, cb, f"127.0.0.1:{b.port}")
        reqs = [
            sched.add_request(p, max_new_tokens=m, ignore_eos=True)
            for p, m in zip(prompts, budgets, strict=True)
        ]
        sched.run()
    assert [r.output_ids for r in reqs] == want
    assert all(r.finish_reason == "length" for r in reqs)
    # every prompt but the one-token budget moved, each in one push of its prompt's slots
    assert len(sched.transfers) == 3 and all(t.ok for t in sched.transfers)
    for ex in (a.executor, b.executor):  # both schedulers released what they held
        assert ex.req_to_token_pool.rows_in_use() == 0


def test_migrating_a_running_request_equals_one_executor(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    a, b = pair
    prompts = PROMPTS[:2]
    with _client(a) as ca, _client(b) as cb:
        limits_a, limits_b = ca.info().info.limits, cb.info().info.limits
        want = generate(ca.retrying(), limits_a, prompts, max_new_tokens=10, ignore_eos=True)
        src = ReferenceScheduler(ca.retrying(), limits_a)
        dst = ReferenceScheduler(cb.retrying(), limits_b)
        reqs = [src.add_request(p, max_new_tokens=10, ignore_eos=True) for p in prompts]
        for _ in range(4):  # prefill and three decode steps on A
            src.step()
        moved = reqs[0]
        result = migrate(moved, src, ca.kv, dst, f"127.0.0.1:{b.port}")
        assert result.ok and moved in dst.running and moved not in src.running
        while src.has_work() or dst.has_work():
            if src.has_work():
                src.step()
            if dst.has_work():
                dst.step()
        src.flush_releases()
        dst.flush_releases()
    assert [r.output_ids for r in reqs] == want


def test_a_failed_migration_keeps_the_request_where_it_was(
    pair: tuple[RunningServer, RunningServer],
) -> None:
    a, _ = pair
    with _client(a) as ca:
        limits = ca.info().info.limits
        want = generate(ca.retrying(), limits, [PROMPTS[0]], max_new_tokens=6, ignore_eos=True)
        src = ReferenceScheduler(ca.retrying(), limits)
        dst = ReferenceScheduler(ca.retrying(), limits)  # its executor is never reached
        [req] = [src.add_request(PROMPTS[0], max_new_tokens=6, ignore_eos=True)]
        src.step()
        free_before = dst.allocator.free_slots
        with pytest.raises(TransferFailed, match="UNAVAILABLE"):
            migrate(req, src, ca.kv, dst, f"127.0.0.1:{DEAD}")
        assert req in src.running and dst.allocator.free_slots == free_before
        src.run()
    assert req.output_ids == want[0]


def test_cli_generate_with_a_prefill_target_prints_what_one_executor_prints(
    pair: tuple[RunningServer, RunningServer],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from executor.client.cli import main

    a, b = pair
    monkeypatch.setattr("executor.client.cli_session.configure_logging", lambda *a, **k: None)
    args = ["generate", "hi", "there", "--max-new-tokens", "6", "--ignore-eos"]
    args += ["--cache-dir", str(tmp_path)]

    def printed() -> str:  # what the CLI printed, without the in-process servers' log lines
        lines = capsys.readouterr().out.splitlines(keepends=True)
        return "".join(line for line in lines if not re.match(r"\d{4}-\d\d-\d\d ", line))

    assert main([*args, "--target", f"127.0.0.1:{a.port}"]) == 0
    alone = printed()
    split = ["--prefill-target", f"127.0.0.1:{a.port}", "--target", f"127.0.0.1:{b.port}"]
    assert main([*args, *split]) == 0
    assert printed() == alone
    assert "--- [1] length" in alone
    assert main([*args, "--prefill-target", f"127.0.0.1:{a.port}"]) == 2  # no decode target


@pytest.mark.slow
def test_cli_disaggregated_generate_with_tokens_and_mtls_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every credential on at once: mTLS, a call token and the KV plane's own token. The CLI
    sends each where it belongs, A's push presents A's certificate and the KV token, and the
    row B imports is the scheduler's (its decode steps are not another caller's)."""
    from executor.client.cli import main

    ca = TestCA(tmp_path, "fleet")
    cert_a, cert_b = ca.issue("a", peer=True), ca.issue("b", peer=True)
    sched = ca.issue("scheduler", client=True)
    (tmp_path / "call").write_text("call-token-of-the-fleet\n")
    (tmp_path / "kv").write_text("kv-token-of-the-fleet\n")
    guarded = {
        "tls_client_ca_file": str(ca.cert_file),
        "call_token_file": str(tmp_path / "call"),
        "kv_transfer": True,
        "kv_token_file": str(tmp_path / "kv"),
    }
    cache = tmp_path / "cache"

    def tls(cert: Issued) -> dict[str, str]:
        return {"tls_cert_file": str(cert.cert_file), "tls_key_file": str(cert.key_file)}

    monkeypatch.setattr("executor.client.cli_session.configure_logging", lambda *a, **k: None)
    with (
        running_server(tiny_config(cache), **guarded, **tls(cert_b)) as b,  # type: ignore[arg-type]
        running_server(
            tiny_config(cache),
            kv_peers=f"localhost:{b.port}",
            **guarded,
            **tls(cert_a),  # type: ignore[arg-type]
        ) as a,
    ):
        args = ["generate", "hi", "there", "--max-new-tokens", "6", "--ignore-eos"]
        args += ["--cache-dir", str(tmp_path), "--tls-ca-file", str(ca.cert_file)]
        args += ["--tls-cert-file", str(sched.cert_file), "--tls-key-file", str(sched.key_file)]
        args += ["--token-file", str(tmp_path / "call")]

        def printed() -> str:
            lines = capsys.readouterr().out.splitlines(keepends=True)
            return "".join(line for line in lines if not re.match(r"\d{4}-\d\d-\d\d ", line))

        assert main([*args, "--target", f"localhost:{a.port}"]) == 0
        alone = printed()
        split = ["--prefill-target", f"localhost:{a.port}", "--target", f"localhost:{b.port}"]
        assert main([*args, *split]) == 1  # without the KV token the push is refused
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert main([*args, *split, "--kv-token-file", str(tmp_path / "kv")]) == 0
        assert printed() == alone and "--- [1] length" in alone
        assert b.executor is not None and b.executor.req_to_token_pool.rows_in_use() == 0


@pytest.mark.slow
def test_a_push_between_mtls_executors_uses_the_servers_own_identity(tmp_path: Path) -> None:

    ca, other = TestCA(tmp_path, "fleet"), TestCA(tmp_path, "other")
    cert_a, cert_b = ca.issue("a", peer=True), ca.issue("b", peer=True)
    stranger = other.issue("c", peer=True)
    client = ca.issue("scheduler", client=True)

    def mtls(cert: Issued, ca_file: Path) -> dict[str, str]:
        return {
            "tls_cert_file": str(cert.cert_file),
            "tls_key_file": str(cert.key_file),
            "tls_client_ca_file": str(ca_file),
        }

    cache = tmp_path / "cache"
    with (
        running_server(tiny_config(cache), kv_transfer=True, **mtls(cert_b, ca.cert_file)) as b,
        running_server(
            tiny_config(cache), kv_transfer=True, **mtls(stranger, other.cert_file)
        ) as c,
        running_server(
            tiny_config(cache),
            kv_transfer=True,
            kv_peers=f"localhost:{b.port},localhost:{c.port}",
            **mtls(cert_a, ca.cert_file),
        ) as a,
    ):
        creds = channel_credentials(str(ca.cert_file), str(client.cert_file), str(client.key_file))
        with ExecutorClient(f"localhost:{a.port}", credentials=creds) as ca_client:
            _prefill(ca_client, PROMPTS[0], 2, list(range(1, 10)))
            before = cache_digest(c.executor)
            ok, refused = ca_client.kv.push(
                [
                    PushSpec(list(range(1, 10)), f"localhost:{b.port}", 3, list(range(1, 10))),
                    PushSpec(
                        list(range(1, 10)),
                        f"localhost:{c.port}",
                        3,
                        list(range(1, 10)),
                        timeout_s=5,
                    ),
                ]
            )
            _release(ca_client, 2)
        assert ok.ok, ok
        assert b.executor.req_to_token_pool.resident_lens[3] == 9
        # a peer whose CA this server does not trust (nor it this server's) is unreachable
        assert not refused.ok and refused.code == "UNAVAILABLE"
        assert cache_digest(c.executor) == before


# --- the engine in-process: staging checks, all-or-nothing writes -----------------------------


def _staged(
    ex: ModelExecutor, src_slots: list[int], row: int, dst_slots: list[int], tid: int = 7
) -> ImportStaging:
    """An import of `ex`'s own `src_slots` into `row`/`dst_slots`, staged from its chunks."""
    kvt = ex.kv_transfer
    src = np.asarray(src_slots, dtype=np.int64)
    header = ImportHeader(
        tid, row, coalesce(np.asarray(dst_slots)), kvt.read_tokens(src), kvt.layout
    )
    lim = ex.limits
    staging = ImportStaging(
        header,
        header.check(kvt.layout, kvt.limits, lim.max_reqs, lim.max_context_len),
        kvt.layout,
        kvt.limits,
    )
    for spec in plan_chunks(src.size, kvt.layout, kvt.limits.chunk_bytes):
        [data] = kvt.read_chunk(src, spec)
        staging.add(Chunk(spec.layer, spec.kind, spec.first, spec.count, data, checksum(data)))
    return staging


def test_a_write_that_fails_part_way_restores_everything(
    make_executor: Callable[..., ModelExecutor],
) -> None:
    ex = make_executor()
    ex.forward(
        make_extend_batch(
            input_ids=[PROMPTS[0]], req_pool_indices=[1], out_cache_loc=[list(range(1, 10))]
        )
    )
    staging = _staged(ex, list(range(1, 10)), 2, list(range(20, 29)))
    before = cache_digest(ex)
    real = ex.kv_transfer.slot_tokens.tokens

    class FailsOnce:  # the last device write of an import raises the first time
        failed = False

        def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
            return real[index]

        def __setitem__(self, index: torch.Tensor, value: torch.Tensor) -> None:
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise RuntimeError("device write failed")
            real[index] = value

    ex.kv_transfer.slot_tokens = SimpleNamespace(tokens=FailsOnce())  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="device write failed"):
        ex.kv_transfer.apply_import(staging)
    ex.kv_transfer.slot_tokens = ex.controls.slot_tokens
    assert cache_digest(ex) == before
    result = ex.kv_transfer.apply_import(staging)  # nothing was remembered: it applies now
    assert not result.replayed and ex.req_to_token_pool.resident_lens[2] == 9


def test_staging_refuses_chunks_that_do_not_fit(
    make_executor: Callable[..., ModelExecutor],
) -> None:
    ex = make_executor()
    kvt = ex.kv_transfer
    ex.forward(
        make_extend_batch(
            input_ids=[PROMPTS[1]], req_pool_indices=[1], out_cache_loc=[list(range(1, 7))]
        )
    )
    full = _staged(ex, list(range(1, 7)), 2, list(range(30, 36)))
    data = full.k[0, 0, :2].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    header = full.header
    lim = ex.limits
    slots = header.check(kvt.layout, kvt.limits, lim.max_reqs, lim.max_context_len)
    staging = ImportStaging(header, slots, kvt.layout, kvt.limits)
    staging.add(Chunk(0, 0, 0, 2, data, checksum(data)))
    cases = [
        (Chunk(0, 0, 1, 2, data, checksum(data)), BatchValidationError, "overlaps"),
        (Chunk(0, 0, 5, 2, data, checksum(data)), BatchValidationError, "outside"),
        (Chunk(0, 0, 2, 1, data, checksum(data)), KVChecksumError, "data bytes"),
        (Chunk(0, 0, 2, 2, data, checksum(data) ^ 1), KVChecksumError, "crc32"),
        (Chunk(99, 0, 2, 2, data, checksum(data)), BatchValidationError, "layer"),
        (Chunk(0, 0, 2, 2, data, checksum(data), rank=1), BatchValidationError, "rank"),
    ]
    for chunk, error, words in cases:
        with pytest.raises(error, match=words):
            staging.add(chunk)
    with pytest.raises(BatchValidationError, match="missing"):
        staging.check_complete()
    other = dataclasses.replace(kvt.layout, head_dim=kvt.layout.head_dim * 2)
    with pytest.raises(BatchValidationError, match="head_dim"):
        dataclasses.replace(header, source=other).check(
            kvt.layout, kvt.limits, lim.max_reqs, lim.max_context_len
        )
    with pytest.raises(BatchValidationError, match="max_reqs"):
        dataclasses.replace(header, row=lim.max_reqs + 1).check(
            kvt.layout, kvt.limits, lim.max_reqs, lim.max_context_len
        )


@pytest.mark.slow
@pytest.mark.long
def test_smollm2_prefilled_on_a_and_decoded_on_b_equals_one_executor(cache_dir: Path) -> None:
    """SmolLM2-135M, float32, held-out prompts: disaggregated and migrated generation give
    one executor's greedy tokens (the gate's: tiny-random's, test_disaggregated_generate_...
    and test_migrating_a_running_request_...)."""
    config = tiny_config(cache_dir, model="smollm2", graph_mode="none", kv_slots=2048, max_reqs=8)
    with (
        running_server(config, kv_transfer=True) as b,
        running_server(config, kv_transfer=True, kv_peers=f"127.0.0.1:{b.port}") as a,
    ):
        tok = a.executor.load_tokenizer()
        texts = ["The tallest mountain in Africa is", "def reverse(s):\n", "Water boils at"]
        prompts = [tok.encode(t) for t in texts]
        with _client(a) as ca, _client(b) as cb:
            limits = ca.info().info.limits
            want = generate(ca.retrying(), limits, prompts, max_new_tokens=12, ignore_eos=True)
            sched = DisaggregatedScheduler(ca, cb, f"127.0.0.1:{b.port}")
            reqs = [sched.add_request(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
            sched.run()
            assert [r.output_ids for r in reqs] == want
            src = ReferenceScheduler(ca.retrying(), limits)
            dst = ReferenceScheduler(cb.retrying(), cb.info().info.limits)
            moving = [src.add_request(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
            for _ in range(5):
                src.step()
            for req in moving:
                migrate(req, src, ca.kv, dst, f"127.0.0.1:{b.port}")
            dst.run()
            src.flush_releases()
        assert [r.output_ids for r in moving] == want


def test_a_push_whose_source_read_fails_mid_stream_writes_nothing_on_the_peer(
    pair: tuple[RunningServer, RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    kvt = a.executor.kv_transfer
    real, calls = kvt.read_chunk, [0]

    def flaky(slots: np.ndarray, spec: object) -> list[bytes]:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("the device read failed")
        return real(slots, spec)  # type: ignore[arg-type]

    with _client(a) as ca:
        _prefill(ca, PROMPTS[0], 2, list(range(100, 109)))
        before = cache_digest(b.executor)
        monkeypatch.setattr(kvt, "read_chunk", flaky)
        [result] = ca.kv.push(
            [PushSpec(list(range(100, 109)), f"127.0.0.1:{b.port}", 5, list(range(1, 10)))]
        )
        monkeypatch.undo()
        _release(ca, 2)
    assert not result.ok and result.code == "INTERNAL", result
    assert (
        "reading the source slots" in result.message and "the device read failed" in result.message
    )
    assert cache_digest(b.executor) == before


@pytest.mark.slow
def test_kv_calls_have_their_own_limit_apart_from_forward(tmp_path: Path) -> None:
    """KV calls take their own places (max_kv_calls): with every Forward place held by open
    streams a KV call still runs, and with every KV place held by stalled imports a KV call
    is refused at once while Forward and health answer."""
    with (
        running_server(
            tiny_config(tmp_path), rpc_threads=6, max_forward_calls=2, kv_transfer=True
        ) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as c,
    ):
        _prefill(c, [5, 6, 7], 3, [40, 41, 42])
        sessions = [c.open_stream() for _ in range(2)]
        for s in sessions:  # each stream has taken its place once it answered a step
            s.send(make_idle_batch())
            s.recv()
        assert c.kv.export([40, 41, 42], timeout=10).header.num_slots == 3
        for s in sessions:
            s.close()
        layout = c.stub.GetInfo(pb.GetInfoRequest(), timeout=10).kv_layout
        stalled = []
        for i in range(2):  # max_kv_calls: a header, then nothing
            outbox: queue.Queue[pb.KvImportRequest | None] = queue.Queue()
            outbox.put(
                pb.KvImportRequest(
                    header=pb.KvImportHeader(
                        transfer_id=777 + i, req_pool_index=10 + i, slots=slot_runs([200 + i]),
                        layout=layout,
                    )
                )
            )  # fmt: skip
            stalled.append((outbox, c.stub.ImportKV.future(iter(outbox.get, None), timeout=30)))
        _wait_for(lambda: srv.servicer.kv_calls._taken == 2)
        calls = {
            "ExportKV": lambda: c.kv.export([40], timeout=5),
            "PushKV": lambda: c.kv.push([PushSpec([40], "127.0.0.1:1", 1, [1])], timeout=5),
            "ImportKV": lambda: c.kv.import_(ExportedKV(pb.KvTransferHeader()), 1, [1], timeout=5),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, name
            assert "max_kv_calls" in (err.value.details() or ""), name
        assert c.forward(make_idle_batch(), timeout=10).next_token_ids.numel() == 0
        assert c.health(timeout=2) == "SERVING"
        for outbox, future in stalled:
            future.cancel()
            outbox.put(None)
        _release(c, 3)


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)
