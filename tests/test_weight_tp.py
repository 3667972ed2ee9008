"""Weight updates under tensor parallelism: a trainer's weights group (gloo) with a tp 2
executor, every rank receiving the whole tensors and taking its shard, gives tp 1's tokens
on the same new weights, before and after (eager and graph paths)."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.parallel.group import free_port
from tests.tp_util import generate_tp, run_generations
from tests.weights_util import PROMPTS, config


@pytest.mark.slow  # two spawned ranks
def test_group_update_at_tp2_equals_tp1(cache_dir: Path) -> None:
    cfg: ExecutorConfig = config(cache_dir, graph_mode="decode", graph_batch_sizes="1,2,4")
    greedy = {"max_new_tokens": 6, "ignore_eos": True}

    def runs() -> list[dict[str, object]]:
        update = {"model": "tiny-random", "seed": 1, "port": free_port(), "version": "g1"}
        return [greedy, {"group_update": update}, greedy]

    want = run_generations(ModelExecutor(cfg), PROMPTS, runs())
    got = generate_tp(cfg.replace(tp_size=2), PROMPTS, runs())
    assert got[1] == want[1] == "g1"
    assert [t for t, _ in (got[0], got[2])] == [t for t, _ in (want[0], want[2])]
    assert got[0][0] != got[2][0]  # the weights changed
    assert "full_graph" in got[2][1]  # the captured graphs ran the new weights
