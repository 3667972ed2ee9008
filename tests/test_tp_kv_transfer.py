"""The KV data plane between two `serve --tp-size 2` executors (tiny-random, gloo): each rank
exports and imports its own heads; a request prefilled on A and decoded on B after a push,
and one migrated between decode steps, sample what one tp 1 executor samples."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from executor.client.disaggregated import DisaggregatedScheduler, migrate
from executor.client.scheduler import ReferenceScheduler, generate
from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from tests.test_tp_server import _served

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41], [100, 3, 77, 250, 12, 9, 31]]


@pytest.mark.slow
def test_push_and_migration_between_tp2_executors_equal_tp1(tmp_path: Path) -> None:
    ref = ModelExecutor(
        ExecutorConfig(
            model="tiny-random",
            device="cpu",
            max_reqs=8,
            kv_slots=1024,
            max_context_len=256,
            dtype="float32",
            cache_dir=str(tmp_path / "cache"),
        )
    )
    want = generate(ref.forward, ref.limits, PROMPTS, max_new_tokens=8, ignore_eos=True)
    with ExitStack() as stack:
        served_b, cb, _ = stack.enter_context(_served(tmp_path / "b", "--kv-transfer"))
        peers = ["--kv-transfer", "--kv-peers", f"127.0.0.1:{served_b.port}"]
        _, ca, _ = stack.enter_context(_served(tmp_path / "a", *peers))
        layout = ca.info().info.kv_layout
        assert layout is not None and layout.tp_size == 2
        assert (
            layout.kv_heads * 2 == layout.kv_heads_total or layout.kv_heads == layout.kv_heads_total
        )

        sched = DisaggregatedScheduler(ca, cb, f"127.0.0.1:{served_b.port}")
        reqs = [sched.add_request(p, max_new_tokens=8, ignore_eos=True) for p in PROMPTS]
        sched.run()
        assert [r.output_ids for r in reqs] == want
        assert all(t.ok for t in sched.transfers)

        limits_a, limits_b = ca.info().info.limits, cb.info().info.limits
        src = ReferenceScheduler(ca.retrying(), limits_a)
        dst = ReferenceScheduler(cb.retrying(), limits_b)
        moving = [src.add_request(p, max_new_tokens=8, ignore_eos=True) for p in PROMPTS]
        for _ in range(3):  # prefill and two decode steps on A
            src.step()
        exported = ca.kv.export(moving[0].slots[: moving[0].num_computed])
        assert sorted({c.rank for c in exported.chunks}) == [0, 1]
        assert exported.header.num_chunks == len(exported.chunks)
        for req in moving[:2]:
            assert migrate(req, src, ca.kv, dst, f"127.0.0.1:{served_b.port}").ok
        while src.has_work() or dst.has_work():
            if src.has_work():
                src.step()
            if dst.has_work():
                dst.step()
        src.flush_releases()
        dst.flush_releases()
        assert [r.output_ids for r in moving] == want
