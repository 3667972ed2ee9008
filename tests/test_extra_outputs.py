"""Outputs beyond the next token against transformers on a random tiny Qwen2: prompt logprobs
(one batch and chunked), scores of given tokens, hidden states of any layer, pooled
embeddings; byte caps refused before any device work; a request asking nothing pays nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.config import ExecutorConfig
from executor.core.errors import BatchTooLargeError
from executor.core.extras_types import HiddenAsk, Pooling, RowOutputs
from executor.core.forward_batch import ForwardBatch
from executor.extras.feature import Extras
from executor.model_executor import ModelExecutor
from tests.server_util import running_server
from tests.test_model_families import SMALL, _randomize

transformers = pytest.importorskip("transformers")
LAYERS = 3


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    config = transformers.Qwen2Config(**{**SMALL, "num_hidden_layers": LAYERS})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=1)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    return path, model.eval()


def _executor(path: Path, cache_dir: Path, **changes: object) -> ModelExecutor:
    values: dict[str, object] = {
        "model": str(path),
        "device": "cpu",
        "max_reqs": 8,
        "kv_slots": 1024,
        "max_context_len": 256,
        "cache_dir": str(cache_dir),
        "dtype": "float32",
        "graph_backend": "standin",
        "graph_batch_sizes": "2",
        "piecewise_token_sizes": "64",
    }
    values.update(changes)
    return ModelExecutor(ExecutorConfig(**values))  # type: ignore[arg-type]


PROMPT = [int(t) for t in torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(5))]


def _hf(model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float(), tuple(h[0] for h in out.hidden_states)


def _extend(
    ids: list[int], row: int, first_slot: int, prefix: int = 0, **kw: object
) -> ForwardBatch:
    fb = make_extend_batch(
        input_ids=[ids],
        req_pool_indices=[row],
        out_cache_loc=[list(range(first_slot, first_slot + len(ids)))],
        prefix_lens=[prefix],
    )
    return dataclasses.replace(fb, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("graph_mode", ["none", "extend"])
def test_prompt_logprobs_equal_transformers_in_one_batch_and_in_chunks(
    qwen2: tuple[Path, torch.nn.Module], cache_dir: Path, graph_mode: str
) -> None:
    path, hf = qwen2
    logits, _ = _hf(hf, PROMPT)
    ref = torch.log_softmax(logits, -1)
    want = ref[:-1].gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1)
    top_vals, top_ids = ref[:-1].topk(3, dim=-1)

    ex = _executor(path, cache_dir, graph_mode=graph_mode)
    ask = RowOutputs(row=1, prompt_logprobs=True)
    out = ex.forward(_extend(PROMPT, 1, 1, row_outputs=(ask,), prompt_top_logprobs_num=3))
    assert out.extras is not None and out.extras.prompt_logprobs is not None
    assert out.extras.prompt_logprobs.lengths.tolist() == [len(PROMPT) - 1]
    torch.testing.assert_close(out.extras.prompt_logprobs.values, want, rtol=0, atol=1e-4)
    assert (
        out.extras.prompt_top_logprobs is not None and out.extras.prompt_top_logprob_ids is not None
    )
    torch.testing.assert_close(out.extras.prompt_top_logprobs.values, top_vals, rtol=0, atol=1e-4)
    assert torch.equal(out.extras.prompt_top_logprob_ids.values, top_ids)

    # Two chunks: the first names the second's first token, so no position is lost or doubled.
    ex2 = _executor(path, cache_dir, graph_mode=graph_mode)
    cut = 17
    first = RowOutputs(row=2, prompt_logprobs=True, next_prompt_token=PROMPT[cut])
    a = ex2.forward(_extend(PROMPT[:cut], 2, 1, row_outputs=(first,)))
    b = ex2.forward(
        _extend(
            PROMPT[cut:],
            2,
            1 + cut,
            prefix=cut,
            row_outputs=(RowOutputs(row=2, prompt_logprobs=True),),
        )
    )
    assert a.extras is not None and b.extras is not None
    assert a.extras.prompt_logprobs is not None and b.extras.prompt_logprobs is not None
    both = torch.cat([a.extras.prompt_logprobs.values, b.extras.prompt_logprobs.values])
    torch.testing.assert_close(both, want, rtol=0, atol=1e-4)
    # logprob_start_len skips the positions before it.
    ex3 = _executor(path, cache_dir)
    late = RowOutputs(row=1, prompt_logprobs=True, logprob_start_len=30)
    c = ex3.forward(_extend(PROMPT, 1, 1, row_outputs=(late,)))
    assert c.extras is not None and c.extras.prompt_logprobs is not None
    torch.testing.assert_close(c.extras.prompt_logprobs.values, want[29:], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_scores_and_hidden_states_of_each_layer_equal_transformers(
    qwen2: tuple[Path, torch.nn.Module], cache_dir: Path
) -> None:
    path, hf = qwen2
    logits, hidden = _hf(hf, PROMPT)
    ex = _executor(path, cache_dir)
    ids = (7, 100, 3)
    asks = tuple(
        RowOutputs(row=r, score_token_ids=ids if r == 1 else (), hidden=HiddenAsk(layer=layer))
        for r, layer in ((1, None), (2, 0), (3, 1), (4, LAYERS))
    )
    prompts = [PROMPT] * 4
    fb = make_extend_batch(
        input_ids=prompts,
        req_pool_indices=[1, 2, 3, 4],
        out_cache_loc=[list(range(1 + 40 * i, 41 + 40 * i)) for i in range(4)],
    )
    out = ex.forward(dataclasses.replace(fb, row_outputs=asks))
    assert out.extras is not None and out.extras.token_scores is not None
    assert out.extras.token_scores.lengths.tolist() == [3, 0, 0, 0]
    want_scores = torch.log_softmax(logits[-1], -1)[list(ids)]
    torch.testing.assert_close(out.extras.token_scores.values, want_scores, rtol=0, atol=1e-4)
    h = out.extras.hidden_states
    assert h is not None and h.lengths.tolist() == [1, 1, 1, 1]
    for got, layer in zip(h.values, (LAYERS, 0, 1, LAYERS), strict=True):
        torch.testing.assert_close(got, hidden[layer][-1], rtol=1e-4, atol=1e-4)
    assert out.stats.path == "eager"


@pytest.mark.slow
def test_mean_pooled_embeddings_over_chunks_and_on_the_decode_graph(
    qwen2: tuple[Path, torch.nn.Module], cache_dir: Path
) -> None:
    path, hf = qwen2
    _, hidden = _hf(hf, PROMPT + [9])
    ex = _executor(path, cache_dir, graph_mode="decode")
    mean = RowOutputs(row=1, hidden=HiddenAsk(pooling=Pooling.MEAN))
    ex.forward(_extend(PROMPT[:25], 1, 1, row_outputs=(mean,)))
    b = ex.forward(_extend(PROMPT[25:], 1, 26, prefix=25, row_outputs=(mean,)))
    assert b.extras is not None and b.extras.hidden_states is not None
    torch.testing.assert_close(
        b.extras.hidden_states.values[0], hidden[LAYERS][:40].mean(0), rtol=1e-4, atol=1e-4
    )
    # One more token by DECODE on the full graph: the mean now covers 41 tokens; the LAST
    # state of the same step is the graph's own hidden state.
    step = make_decode_batch(input_ids=[9], req_pool_indices=[1], seq_lens=[41], out_cache_loc=[41])
    c = ex.forward(dataclasses.replace(step, row_outputs=(mean,)))
    assert c.stats.path == "full_graph"
    assert c.extras is not None and c.extras.hidden_states is not None
    torch.testing.assert_close(
        c.extras.hidden_states.values[0], hidden[LAYERS].mean(0), rtol=1e-4, atol=1e-4
    )
    # MEAN must pool every token: a row whose earlier batches did not ask is refused.
    ex.forward(_extend(PROMPT[:5], 2, 200))
    with pytest.raises(Exception, match="MEAN pools every token"):
        ex.forward(
            _extend(
                PROMPT[5:9],
                2,
                205,
                prefix=5,
                row_outputs=(RowOutputs(row=2, hidden=HiddenAsk(pooling=Pooling.MEAN)),),
            )
        )


@pytest.mark.slow
def test_oversized_asks_are_refused_and_asking_nothing_costs_nothing(
    qwen2: tuple[Path, torch.nn.Module], cache_dir: Path, tmp_path: Path
) -> None:
    path, _ = qwen2
    ex = _executor(path, cache_dir)
    plain = ex.forward(_extend(PROMPT, 1, 1))
    assert plain.extras is None and plain.stats.d2h_syncs == 1 and plain.stats.h2d_copies == 1
    asked = ex.forward(
        _extend(
            PROMPT[:5],
            2,
            100,
            row_outputs=(RowOutputs(row=2, prompt_logprobs=True, hidden=HiddenAsk()),),
        )
    )
    assert asked.stats.d2h_syncs == 1 and asked.stats.h2d_copies == 1  # one transfer each way
    small = dataclasses.replace(ex.limits, max_hidden_bytes=100)
    extras = next(f for f in ex.features if isinstance(f, Extras))
    extras.limits = small
    lens = ex.req_to_token_pool.resident_lens.copy()
    with pytest.raises(BatchTooLargeError, match="max_hidden_bytes"):
        ex.forward(
            _extend(PROMPT[:3], 3, 300, row_outputs=(RowOutputs(row=3, hidden=HiddenAsk()),))
        )
    assert (ex.req_to_token_pool.resident_lens == lens).all()

    config = ExecutorConfig(
        model=str(path),
        device="cpu",
        max_reqs=8,
        kv_slots=1024,
        max_context_len=256,
        cache_dir=str(cache_dir),
        dtype="float32",
    )
    with running_server(config) as srv, ExecutorClient(f"127.0.0.1:{srv.port}") as client:
        info = client.info().info.limits
        assert info.max_hidden_bytes == 16 << 20 and info.max_score_token_ids == 1024
        too_many = RowOutputs(row=1, score_token_ids=tuple(range(2)) * 600)
        with pytest.raises(grpc.RpcError) as err:
            client.forward(_extend(PROMPT[:3], 1, 1, row_outputs=(too_many,)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_score_token_ids (1024)" in err.value.details()
        out = client.forward(
            _extend(
                PROMPT,
                1,
                1,
                row_outputs=(
                    RowOutputs(
                        row=1,
                        prompt_logprobs=True,
                        score_token_ids=(4, 5),
                        hidden=HiddenAsk(bfloat16=True),
                    ),
                ),
            )
        )
        assert out.extras is not None and out.extras.hidden_states is not None
        assert out.extras.hidden_states.values.dtype == torch.bfloat16
        assert (
            out.extras.prompt_logprobs is not None and len(out.extras.prompt_logprobs.values) == 39
        )
        assert out.extras.token_scores is not None and out.extras.token_scores.lengths.tolist() == [
            2
        ]


def test_the_retry_memory_is_bounded_in_bytes() -> None:
    from executor.core.outputs import ForwardOutput
    from executor.service.applied_batches import AppliedBatches, output_bytes

    memory = AppliedBatches(10, max_bytes=1000)
    big = ForwardOutput(next_token_ids=torch.zeros(100, dtype=torch.int64))  # 800 bytes
    assert output_bytes(big) == 800
    memory.store(1, b"a", big)
    memory.store(2, b"b", big)  # 1600 > 1000: the oldest goes
    assert memory.lookup(1, b"a") is None and memory.lookup(2, b"b") is big
    assert len(memory) == 1 and memory.bytes == 800


@pytest.mark.slow
def test_perplexity_through_grpc_equals_transformers_and_the_cli_scores_files(
    qwen2: tuple[Path, torch.nn.Module],
    cache_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json
    import math

    from executor.client.cli import main

    path, hf = qwen2
    tokens = [
        int(t) for t in torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(9))
    ]
    logits, hidden = _hf(hf, tokens)
    ref = torch.log_softmax(logits[:-1].double(), -1).gather(
        1, torch.tensor(tokens[1:]).unsqueeze(1)
    )
    want = math.exp(-float(ref.mean()))
    config = ExecutorConfig(
        model=str(path), device="cpu", max_reqs=4, kv_slots=512, max_context_len=256,
        max_tokens_per_batch=32, cache_dir=str(cache_dir), dtype="float32",
    )  # fmt: skip
    with running_server(config) as srv, ExecutorClient(f"127.0.0.1:{srv.port}") as client:
        got = client.score(tokens)  # three chunks of at most 32 tokens
        assert got.scored == 89 and abs(got.perplexity / want - 1) < 1e-3
        vector = client.embed(tokens)
        torch.testing.assert_close(
            torch.tensor(vector), hidden[LAYERS].mean(0), rtol=1e-4, atol=1e-4
        )

    monkeypatch.setattr("executor.client.cli_session.configure_logging", lambda *a, **k: None)
    text = tmp_path / "a.txt"
    text.write_text("hello there, a short text to score")
    args = [
        "score",
        str(text),
        "--model",
        "tiny-random",
        "--cache-dir",
        str(tmp_path),
        "--per-token",
    ]
    assert main(args) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1]
    result = json.loads(line)
    assert result["file"] == str(text) and len(result["token_logprobs"]) == result["tokens"] - 1
    assert math.isclose(result["perplexity"], math.exp(result["mean_nll"]))
