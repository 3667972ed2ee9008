"""Weight updates under tensor parallelism: each transport's staging at tp 2 (every rank
takes its shard) gives tp 1's tokens on the same new weights (eager and graph paths)."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.config import ExecutorConfig
from executor.model_executor import ModelExecutor
from executor.parallel.group import free_port
from tests.tp_util import generate_tp, run_generations
from tests.weights_util import PROMPTS, config


@pytest.mark.slow  # two spawned ranks
def test_updates_at_tp2_equal_tp1(cache_dir: Path, tmp_path: Path) -> None:
    """A weights group (every rank receives the whole tensors), a stream's tensors (rank 0
    forwards them) and a file (every rank reads its shard), one after the other."""
    cfg: ExecutorConfig = config(cache_dir, graph_mode="decode", graph_batch_sizes="1,2,4")
    greedy = {"max_new_tokens": 6, "ignore_eos": True}

    def runs(tag: str) -> list[dict[str, object]]:
        base = {"model": "tiny-random"}
        return [
            greedy,
            {
                "weights": {
                    **base,
                    "transport": "group",
                    "seed": 1,
                    "version": "g",
                    "where": str(free_port()),
                }
            },
            greedy,
            {"weights": {**base, "transport": "tensors", "seed": 2, "version": "t"}},
            greedy,
            {
                "weights": {
                    **base,
                    "transport": "files",
                    "seed": 3,
                    "version": "f",
                    "where": str(tmp_path / f"{tag}.safetensors"),
                }
            },
            greedy,
        ]

    want = run_generations(ModelExecutor(cfg), PROMPTS, runs("tp1"))
    got = generate_tp(cfg.replace(tp_size=2), PROMPTS, runs("tp2"))
    assert [got[i] for i in (1, 3, 5)] == [want[i] for i in (1, 3, 5)] == ["g", "t", "f"]
    tokens = [got[i][0] for i in (0, 2, 4, 6)]
    assert tokens == [want[i][0] for i in (0, 2, 4, 6)]
    assert len({str(t) for t in tokens}) == 4  # each update changed the weights
    assert "full_graph" in got[6][1]  # the captured graphs ran the new weights
