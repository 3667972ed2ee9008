"""Tensor parallelism (issue 17) on CPU with gloo: the sharding plan, shard-only loading, and
greedy / seeded tokens at tp 2 (tiny-random, eager and both graph paths) and tp 3 (SmolLM2)
equal to tp 1. Multi-rank runs spawn real processes (`tests/tp_util.py`), torn down on failure.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from executor.batch_prep import make_extend_batch
from executor.config import ExecutorConfig
from executor.core.controls_types import SamplingControls
from executor.core.forward_batch import SamplingParams
from executor.model_executor import ModelExecutor
from executor.models.config import ModelConfig
from executor.models.hf_loader import lazy_safetensors
from executor.models.loader import read_model_config
from executor.models.registry import shard_plan
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights
from executor.parallel.broadcast import STEP, Command, receive, send
from executor.parallel.comm import TpComm
from tests.tp_util import (
    PickleUsedError,
    generate_tp,
    leave_group_tp,
    pickle_forbidden,
    run_generations,
)

TINY = TINY_CONFIGS["tiny-random"]
PROMPTS = [[5, 17, 33, 2, 400, 12], [9], list(range(100, 140)), [7, 7, 7]]
SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)
RUNS = [
    {"max_new_tokens": 10, "ignore_eos": True},
    {"max_new_tokens": 10, "ignore_eos": True, "sampling": SEEDED},
]


def _config(tiny: ModelConfig, **changes: object) -> ModelConfig:
    values = {**tiny.as_dict(), **changes}
    values["eos_token_ids"] = tuple(values["eos_token_ids"])
    values.pop("extra", None)
    return ModelConfig(**values)  # type: ignore[arg-type]


def test_plan_splits_heads_mlp_and_vocab() -> None:
    plans = [shard_plan(TINY, 2, r) for r in range(2)]
    assert [(p.num_heads, p.head_start) for p in plans] == [(2, 0), (2, 2)]
    assert [(p.num_kv_heads, p.kv_head_start) for p in plans] == [(1, 0), (1, 1)]
    assert [p.intermediate_size for p in plans] == [64, 64]
    assert plans[1].split_of("model.layers.0.self_attn.o_proj.weight") == (1, 32, 64)
    assert plans[1].split_of("model.layers.0.mlp.down_proj.weight") == (1, 64, 128)
    assert plans[0].split_of("model.norm.weight") is None


def test_plan_replicates_kv_heads_when_ranks_outnumber_them() -> None:
    # 4 query heads, 2 KV heads, 4 ranks: ranks 0,1 share KV head 0; ranks 2,3 KV head 1.
    plans = [shard_plan(TINY, 4, r) for r in range(4)]
    assert [(p.num_kv_heads, p.kv_head_start) for p in plans] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert [p.head_start for p in plans] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("changes", "size", "message"),
    [
        ({}, 3, "does not divide the model's 4 attention heads"),
        ({"num_heads": 6, "num_kv_heads": 3, "head_dim": 16}, 2, "3 KV heads do not divide"),
        ({"intermediate_size": 130}, 4, "intermediate_size 130"),
    ],
)
def test_plan_refuses_counts_that_do_not_divide(changes: dict, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shard_plan(_config(TINY, **changes), size, 0)


def test_vocab_shards_pad_the_last_rank_with_zeros() -> None:
    cfg = _config(TINY, vocab_size=511)
    weight = torch.arange(511 * 2, dtype=torch.float32).view(511, 2)
    first, last = (shard_plan(cfg, 2, r).take("lm_head.weight", weight) for r in (0, 1))
    assert first.shape == last.shape == (256, 2)
    torch.testing.assert_close(torch.cat([first, last])[:511], weight)
    assert torch.count_nonzero(last[-1]) == 0


def test_lazy_safetensors_shard_equals_the_slice_of_the_full_tensor(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = tiny_random_weights(TINY)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    lazy = lazy_safetensors([tmp_path / "model.safetensors"])
    plan = shard_plan(TINY, 2, 1)
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        torch.testing.assert_close(plan.take(name, lazy[name]), plan.take(name, tensors[name]))
    _, start, stop = plan.split_of("model.layers.0.mlp.down_proj.weight") or (0, 0, 0)
    assert plan.take(
        "model.layers.0.mlp.down_proj.weight", lazy["model.layers.0.mlp.down_proj.weight"]
    ).shape == (64, stop - start)


def test_the_batch_header_and_tensors_round_trip() -> None:
    """`send`/`receive` at size 1 are the identity on the wire format (no group needed):
    every field, the sampling batch and the host lists come back equal."""
    from executor.batch_prep import complete_batch, make_extend_batch

    fb = complete_batch(
        make_extend_batch(
            input_ids=[[5, 6, 7], [9]],
            req_pool_indices=[1, 2],
            out_cache_loc=[[1, 2, 3], [4]],
            sampling=[SEEDED, SamplingParams()],
        ),
        needs_cpu_seq_lens=True,
        max_context_len=64,
    )
    wire: list[object] = []  # what rank 0 put on the group, in order

    class Record(TpComm):
        def broadcast_bytes(self, data: bytes | None) -> bytes:
            assert data is not None
            wire.append(data)
            return data

        def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
            wire.append(tensor.clone())
            return tensor

    class Replay(TpComm):
        def broadcast_bytes(self, data: bytes | None) -> bytes:
            return wire.pop(0)  # type: ignore[return-value]

        def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
            return tensor.copy_(wire.pop(0))  # type: ignore[arg-type]

    send(Record(rank=0, size=2), Command(STEP, fb, keep_rows=False))
    assert isinstance(wire[0], bytes) and len(wire) <= 4  # a header, one buffer per dtype
    got = receive(Replay(rank=1, size=2))
    assert got.kind == STEP and got.keep_rows is False and got.batch is not None
    for name in (
        "input_ids",
        "req_pool_indices",
        "seq_lens",
        "out_cache_loc",
        "positions",
        "extend_start_loc",
        "seq_lens_cpu",
    ):
        torch.testing.assert_close(getattr(got.batch, name), getattr(fb, name))
    assert got.batch.extend_seq_lens_cpu == fb.extend_seq_lens_cpu
    assert got.batch.sampling is not None and fb.sampling is not None
    torch.testing.assert_close(got.batch.sampling.has_seed, fb.sampling.has_seed)
    torch.testing.assert_close(got.batch.sampling.seeds, fb.sampling.seeds)


def _tiny(**changes: object) -> ExecutorConfig:
    values: dict[str, object] = {
        "model": "tiny-random",
        "device": "cpu",
        "max_reqs": 8,
        "kv_slots": 1024,
        "max_context_len": 256,
        "graph_backend": "standin",
        "graph_batch_sizes": "1,2,4",
        "piecewise_token_sizes": "16,64",
        "dtype": "float32",
    }
    values.update(changes)
    return ExecutorConfig(**values)  # type: ignore[arg-type]


@pytest.mark.slow
def test_tiny_random_tp2_matches_tp1() -> None:
    """Greedy and seeded sampling at tp 2 give tp 1's tokens, eagerly; a refused batch changes
    nothing on any rank; and, after a runtime toggle (broadcast to the worker, which captures
    too), on the full-graph and piecewise paths (collectives inside the captured callables,
    outside the compiled halves)."""
    config = _tiny(graph_mode="none")
    # Refused on rank 0 before any broadcast: the workers' state and the group stay in step.
    bad = make_extend_batch(input_ids=[[5, 6]], req_pool_indices=[99], out_cache_loc=[[1, 2]])
    # Overlap: rank 0 resolves the future references of the batches the workers get.
    overlap = {**RUNS[1], "overlap": True}
    runs = [*RUNS, {"refuse": bad}, {"toggles": {"graph_mode": "both"}}, *RUNS, overlap]
    want = run_generations(ModelExecutor(config), PROMPTS, runs)
    got = generate_tp(config.replace(tp_size=2), PROMPTS, runs)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    assert got[-1][0] == got[-2][0]  # overlap gives the plain run's tokens
    # Every rank took tp 1's paths (the same captured buckets), the graph ones included.
    assert [paths for _, paths in got] == [paths for _, paths in want]
    assert [paths for _, paths in got][:3] == [["eager"], ["eager"], []]
    for _, paths in got[3:]:
        assert {"full_graph", "piecewise"} <= set(paths), paths


@pytest.mark.slow
def test_every_rank_leaves_with_its_group_and_its_threads_gone() -> None:
    """torch._dynamo imported after the group exists (the model's load imports it) bound the
    group as a default argument (`torch.distributed.nn.functional`), so leaving freed
    nothing: gloo's and the TCPStore's threads met the interpreter's teardown and a rank
    exited -6 now and then. Leaving now frees the group and joins its threads on every rank."""
    assert leave_group_tp() == [(0, True, []), (1, True, [])]


@pytest.mark.slow
@pytest.mark.long
def test_smollm2_tp3_matches_tp1(cache_dir: Path) -> None:
    """SmolLM2-135M: 9 heads and 3 KV heads split over 3 ranks; greedy tokens equal tp 1's
    on a chat prompt (the reference run also fills the dequantized cache the ranks read their
    shards from). Eager only: the graph paths at tp 3 cost minutes more on a 2-core machine,
    so `benchmarks/tp.py --graph-mode both` checks them (tiny-random covers them here, and
    tp 2 in the gate: test_tiny_random_tp2_matches_tp1)."""
    config = ExecutorConfig(
        model="smollm2",
        device="cpu",
        max_reqs=4,
        kv_slots=1024,
        max_context_len=256,
        cache_dir=str(cache_dir),
        graph_mode="none",
        dtype="float32",
        quantization="none",  # tp shards float weights; auto keeps tp 1 on the GGUF's blocks
    )
    ex = ModelExecutor(config)
    tok = ex.load_tokenizer()
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
        for q in ("What is the capital of France?",)
    ]
    greedy = {"max_new_tokens": 8, "eos_token_ids": ex.info.eos_token_ids}
    [(want, _)] = run_generations(ex, prompts, [greedy])
    del ex
    [(got, paths)] = generate_tp(config.replace(tp_size=3), prompts, [greedy], timeout_s=300)
    assert got == want and paths == ["eager"]


@pytest.mark.gpu
def test_tiny_random_tp2_on_cuda_with_nccl_matches_tp1() -> None:
    """NCCL on two GPUs: eager and CUDA-graph paths (the all-reduces captured inside the full
    decode graph and the pieces) give tp 1's greedy tokens."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, {torch.cuda.device_count()} present")
    config = _tiny(device="cuda", graph_backend="cuda", graph_mode="none", dtype="float32")
    runs = [RUNS[0], {"toggles": {"graph_mode": "both"}}, RUNS[0]]
    want = run_generations(ModelExecutor(config), PROMPTS, runs)
    got = generate_tp(config.replace(tp_size=2), PROMPTS, runs)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    assert {"full_graph", "piecewise"} <= set(got[1][1])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tp_size": 3}, "tp_size 3 does not divide the model's 4 attention heads"),
        (
            {"tp_size": 2, "quantization": "int8"},
            "quantization=int8 is not supported with tp_size > 1",
        ),
    ],
)
def test_start_up_refuses_a_tp_size_the_model_cannot_take(changes: dict, message: str) -> None:
    """Checked from metadata before any port opens or worker starts (`read_model_config`)."""
    with pytest.raises(ValueError, match=message):
        read_model_config(_tiny(**changes))


def test_an_executor_of_tp_size_2_needs_its_process_group() -> None:
    with pytest.raises(ValueError, match="tp_size=2 needs a process group of that size"):
        ModelExecutor(_tiny(tp_size=2))


@pytest.mark.slow
def test_sampling_controls_at_tp2_match_tp1() -> None:
    """Rank 0 keeps the controls and samples; the workers run the same steps without them."""
    from tests.test_sampling_controls import overlap_batches

    controls = {
        1: SamplingControls(repetition_penalty=1.5, frequency_penalty=1.0),
        2: SamplingControls(allowed_token_ids=(3, 40, 41), logit_bias=((40, -3.0),)),
    }
    runs = [{"batches": overlap_batches(controls, 4)}]
    config = _tiny(graph_mode="none")
    want = run_generations(ModelExecutor(config), PROMPTS, runs)
    got = generate_tp(config.replace(tp_size=2), PROMPTS, runs)
    assert got == want
    assert all(t[1] in (3, 40, 41) for t in want[0][0])


@pytest.mark.slow
def test_pipelined_steps_at_tp2_match_serial_tp1() -> None:
    """Rank 0 admits and stages each step while the one before runs, broadcasts it at its
    launch; the workers follow. Future references, controls and releases: the tokens of
    tp 1 one step at a time."""
    from tests.test_sampling_controls import overlap_batches

    controls = {1: SamplingControls(repetition_penalty=1.5, logit_bias=((40, 2.0),))}
    batches = overlap_batches(controls, 4)
    config = _tiny(graph_mode="none", pipeline_steps="on")
    want = run_generations(ModelExecutor(_tiny(graph_mode="none")), PROMPTS, [{"batches": batches}])
    got = generate_tp(config.replace(tp_size=2), PROMPTS, [{"pipelined": batches}])
    assert got == want


@pytest.mark.slow
def test_hidden_states_and_scores_at_tp2_match_tp1() -> None:
    """Named layers run eagerly on every rank (the workers see the asks too); rank 0 reads
    the replicated hidden states and the gathered logits."""
    import dataclasses

    from executor.core.extras_types import HiddenAsk, Pooling, RowOutputs

    fb = make_extend_batch(
        input_ids=[[5, 6, 7, 8], [9, 10]],
        req_pool_indices=[1, 2],
        out_cache_loc=[[1, 2, 3, 4], [5, 6]],
    )
    asks = (
        RowOutputs(row=1, hidden=HiddenAsk(layer=1), score_token_ids=(3, 4)),
        RowOutputs(row=2, hidden=HiddenAsk(pooling=Pooling.MEAN)),
    )
    runs = [{"batches": [dataclasses.replace(fb, row_outputs=asks)]}]
    config = _tiny(graph_mode="extend")
    want = run_generations(ModelExecutor(config), PROMPTS, runs)
    got = generate_tp(config.replace(tp_size=2), PROMPTS, runs)
    assert got[0][0] == want[0][0]
    for key in ("hidden_states", "token_scores"):
        torch.testing.assert_close(
            torch.tensor(got[0][1][0][key]), torch.tensor(want[0][1][0][key]), rtol=1e-4, atol=1e-4
        )


@pytest.mark.slow
def test_tp_steps_run_with_pickle_forbidden_on_every_rank() -> None:
    """Every way into pickle raises on both ranks while steps, refusals and a toggle are
    broadcast: the generation still matches tp 1, so nothing on the path pickles."""
    config = _tiny(graph_mode="none")
    bad = make_extend_batch(input_ids=[[5, 6]], req_pool_indices=[99], out_cache_loc=[[1, 2]])
    runs = [RUNS[0], {"refuse": bad}, {"toggles": {"eager_input_no_copy": True}}, RUNS[1]]
    want = run_generations(ModelExecutor(config), PROMPTS, runs)
    got = generate_tp(config.replace(tp_size=2), PROMPTS, runs, forbid_pickle=True)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]


def test_pickle_forbidden_catches_torch_object_collectives() -> None:
    """The guard the test above relies on does bite: pickle and torch's object picklers."""
    import pickle

    import torch.distributed.distributed_c10d as c10d

    with pickle_forbidden():
        with pytest.raises(PickleUsedError):
            pickle.dumps({"a": 1})
        with pytest.raises(PickleUsedError):
            c10d._pickler(io.BytesIO())  # what broadcast_object_list pickles with
    assert pickle.loads(pickle.dumps({"a": 1})) == {"a": 1}  # restored after


def test_nothing_on_the_tp_broadcast_path_unpickles() -> None:
    """The header is JSON and the tensors raw bytes: no object broadcast, no pickle."""
    import inspect

    from executor.parallel import broadcast, comm

    for module in (broadcast, comm):
        source = inspect.getsource(module)
        assert "pickle" not in source and "broadcast_object" not in source
    assert not hasattr(TpComm, "broadcast_object")


@pytest.mark.slow
def test_ranks_serve_only_the_graph_buckets_every_rank_captured() -> None:
    """Rank 1 loses decode bucket 2 and piecewise bucket 16 (an injected out-of-memory
    capture); after start-up both ranks keep the intersection (rank 0 drops them too), so
    every batch takes the same path with collectives of the same size on both ranks, and the
    tokens equal tp 1's."""
    config = _tiny(graph_mode="both")
    prompts = PROMPTS[:2]  # DECODE at batch size 2: the dropped bucket, padded to 4
    runs: list[dict] = [{"captured": True}, RUNS[0]]
    want = run_generations(ModelExecutor(config), prompts, runs)
    assert want[0] == ([1, 2, 4], [16, 64])
    got = generate_tp(
        config.replace(tp_size=2), prompts, runs, faults={1: {"decode": 2, "piecewise": 16}}
    )
    assert got[0] == ([1, 4], [64])
    tokens, paths = got[1]
    assert tokens == want[1][0]
    assert {"full_graph", "piecewise"} <= set(paths), paths


@pytest.mark.slow
def test_capture_takes_the_groups_outcome_of_each_bucket() -> None:
    """The capture loop follows the group: a bucket another rank failed is dropped here
    (`drop`) and reported, and a poisoned capture elsewhere poisons this factory and ends
    the pass (no later bucket is tried, as on the poisoned rank)."""
    from executor.graphs.capture import capture_buckets
    from executor.graphs.factory import GraphFactory
    from executor.parallel.agreement import CaptureOutcome, GroupOutcome

    group = {
        8: GroupOutcome(CaptureOutcome.CAPTURED, []),
        4: GroupOutcome(CaptureOutcome.FAILED, [1]),
    }
    group[2] = GroupOutcome(CaptureOutcome.POISONED, [1])
    tried: list[int] = []
    dropped: list[int] = []
    factory = GraphFactory(torch.device("cpu"))
    report = capture_buckets(
        "decode",
        [1, 2, 4, 8],
        tried.append,
        factory,
        progress=False,
        agree=lambda mine: group[tried[-1]],
        drop=dropped.append,
    )
    assert tried == [8, 4, 2] and dropped == [4, 2]
    assert report.captured == [8]
    assert report.failed[4] == "decode bucket 4: capture failed on tp rank(s) [1]"
    assert (
        factory.poisoned == report.poisoned == "decode bucket 2: capture poisoned on tp rank(s) [1]"
    )


@pytest.mark.gpu
def test_ranks_on_cuda_serve_only_the_graph_buckets_every_rank_captured() -> None:
    """The agreement over NCCL with real CUDA graphs: rank 1 loses decode bucket 2 (an
    injected out-of-memory capture, before the capture runs any collective); both ranks
    serve buckets 1 and 4 and give tp 1's tokens."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, {torch.cuda.device_count()} present")
    config = _tiny(device="cuda", graph_backend="cuda", graph_mode="both")
    prompts = PROMPTS[:2]
    runs: list[dict] = [{"captured": True}, RUNS[0]]
    want = run_generations(ModelExecutor(config), prompts, runs)
    got = generate_tp(config.replace(tp_size=2), prompts, runs, faults={1: {"decode": 2}})
    assert got[0] == ([1, 4], [16, 64])
    assert got[1][0] == want[1][0]
