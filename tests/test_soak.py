"""A short soak (tests/soak.py): concurrent stream and unary schedulers on one server, no
error, every scheduler's tokens equal a serial in-process replay, rows and slots gauges back
to zero. `benchmarks/soak.py` is the long run (64 streams, 10 minutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server_util import tiny_config
from tests.soak import soak


@pytest.mark.slow
def test_a_short_soak_is_error_free_replays_equal_and_releases_everything(tmp_path: Path) -> None:
    result = soak(tiny_config(tmp_path), streams=6, unary=2, seconds=4.0, rss_every_s=1.0)
    assert result.errors == []
    assert all(run.cycles >= 1 for run in result.schedulers), [r.cycles for r in result.schedulers]
    assert result.replay_mismatches == []
    assert result.gauges_after == {"req_rows_used": 0.0, "kv_slots_used": 0.0, "queue_depth": 0.0}
    assert len(result.rss_mib) >= 2
