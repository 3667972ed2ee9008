"""Routed experts (`RowOutputs.routed_experts`): the top-k expert ids of every token a batch
computes for a row, in every sparse MoE layer, equal transformers' router choices
(`output_router_logits=True`, the top k of the router logits) token by token, on the eager
path and with both graph modes on (an asking batch runs eagerly, the others on graphs); the
byte cap and a dense model refuse the ask, and a batch that asks nothing gets nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.core.errors import BatchTooLargeError, BatchValidationError
from executor.core.extras_types import RowOutputs
from executor.core.forward_batch import ForwardBatch
from executor.core.outputs import ForwardOutput
from executor.extras.feature import Extras
from executor.model_executor import ModelExecutor
from executor.service.codec import (
    batch_from_proto,
    batch_to_proto,
    check_size_claims,
    response_from_proto,
    response_to_proto,
)
from executor.service.info_codec import info_from_proto, info_to_proto
from tests.test_extra_outputs import _executor as executor
from tests.test_model_families import HF_CONFIGS, _randomize

PROMPTS = [[5, 17, 42, 7, 99, 3, 64, 12, 8, 31, 77, 2], [9, 4, 120, 33, 1, 6, 250]]
DECODED = [[11, 300, 45], [23, 7, 401]]  # fed as the next tokens, one per DECODE step
ASK = (RowOutputs(1, routed_experts=True), RowOutputs(2, routed_experts=True))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    model = transformers.AutoModelForCausalLM.from_config(
        HF_CONFIGS["qwen3_moe"](), dtype=torch.float32
    )
    _randomize(model, seed=3)
    path = tmp_path_factory.mktemp("qwen3-moe")
    model.save_pretrained(path)
    return path, model.eval()


def one_ask() -> ForwardBatch:
    """Row 1 prefills PROMPTS[0] (12 tokens) asking for its routed experts."""
    fb = make_extend_batch(
        input_ids=[PROMPTS[0]], req_pool_indices=[1], out_cache_loc=[list(range(1, 13))]
    )
    return dataclasses.replace(fb, row_outputs=(RowOutputs(1, routed_experts=True),))


def run_steps(ex: ModelExecutor, ask: bool = True) -> tuple[list[ForwardOutput], set[str]]:
    """One EXTEND of both prompts, then DECODE steps of the fixed tokens."""
    paths: set[str] = set()
    outs: list[ForwardOutput] = []

    def forward(fb: ForwardBatch) -> None:
        out = ex.forward(dataclasses.replace(fb, row_outputs=ASK if ask else ()))
        paths.add(out.stats.path)
        outs.append(out)

    lens = [len(p) for p in PROMPTS]
    base = [1, 100]
    forward(
        make_extend_batch(
            input_ids=PROMPTS,
            req_pool_indices=[1, 2],
            out_cache_loc=[list(range(b, b + n)) for b, n in zip(base, lens, strict=True)],
        )
    )
    for step in range(len(DECODED[0])):
        forward(
            make_decode_batch(
                input_ids=[DECODED[0][step], DECODED[1][step]],
                req_pool_indices=[1, 2],
                out_cache_loc=[b + n + step for b, n in zip(base, lens, strict=True)],
                seq_lens=[n + step + 1 for n in lens],
            )
        )
    return outs, paths


def routed_per_row(outs: list[ForwardOutput]) -> list[torch.Tensor]:
    """Each row's ids over the steps: [tokens, moe layers, k]."""
    rows: list[list[torch.Tensor]] = [[], []]
    for out in outs:
        assert out.extras is not None and out.extras.routed_experts is not None
        for r, ids in enumerate(out.extras.routed_experts.rows()):
            rows[r].append(ids)
    return [torch.cat(r) for r in rows]


def hf_routes(
    hf: transformers.PreTrainedModel, tokens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' top-k expert ids [tokens, moe layers, k] (sorted per token) and the gap
    between the k-th and the next router logit (a near-tie may flip)."""
    with torch.inference_mode():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    logits = torch.stack([r.reshape(len(tokens), -1) for r in out.router_logits], dim=1)
    k = hf.config.num_experts_per_tok
    top = logits.topk(k + 1, dim=-1)
    return top.indices[..., :k].sort(-1).values, top.values[..., k - 1] - top.values[..., k]


@pytest.mark.slow
@pytest.mark.parametrize("graph_mode", ["none", "both"])
def test_routed_experts_equal_transformers_router_choices(
    moe_dir: tuple[Path, transformers.PreTrainedModel], cache_dir: Path, graph_mode: str
) -> None:
    path, hf = moe_dir
    ex = executor(path, cache_dir, graph_mode=graph_mode)
    assert ex.limits.routed_expert_layers == (0, 2)  # layer 1 is dense (mlp_only_layers)
    assert ex.limits.routed_experts_top_k == 2
    outs, paths = run_steps(ex)
    assert paths == {"eager"}  # an asking batch is recorded on the eager path
    if graph_mode == "both":
        assert {str(o.stats.graph_fallback) for o in outs} == {
            "piecewise:routed_experts",
            "decode:routed_experts",
        }
    for row, ids in enumerate(routed_per_row(outs)):
        tokens = PROMPTS[row] + DECODED[row]
        assert ids.dtype == torch.int32 and ids.shape == (len(tokens), 2, 2)
        ref, gap = hf_routes(hf, tokens)
        same = (ids.long().sort(-1).values == ref).all(-1)
        assert bool((same | (gap < 1e-4)).all()), (ids, ref)
        assert float(same.float().mean()) > 0.95
    # The same steps on the graphs, asking nothing: no ids, no eager fallback.
    quiet, quiet_paths = run_steps(executor(path, cache_dir, graph_mode=graph_mode), ask=False)
    assert all(o.extras is None for o in quiet)
    if graph_mode == "both":
        assert "eager" not in quiet_paths
    for a, b in zip(outs, quiet, strict=True):
        assert torch.equal(a.next_token_ids, b.next_token_ids)


def test_the_cap_and_a_dense_model_refuse_the_ask_and_the_ids_cross_the_wire(
    moe_dir: tuple[Path, transformers.PreTrainedModel],
    cache_dir: Path,
    make_executor: Callable[..., ModelExecutor],
) -> None:
    path, _ = moe_dir
    ex = executor(path, cache_dir, graph_mode="none")
    fb = one_ask()
    extras = next(f for f in ex.features if isinstance(f, Extras))
    # 12 tokens x 2 MoE layers x top 2 x 4 bytes = 192
    extras.limits = dataclasses.replace(ex.limits, max_routed_expert_bytes=191)
    lens = ex.req_to_token_pool.resident_lens.copy()
    with pytest.raises(BatchTooLargeError, match="max_routed_expert_bytes"):
        ex.forward(fb)
    assert (ex.req_to_token_pool.resident_lens == lens).all()  # nothing was applied
    extras.limits = dataclasses.replace(ex.limits, max_routed_expert_bytes=192)
    out = ex.forward(fb)
    assert out.extras is not None and out.extras.routed_experts is not None
    assert out.stats.d2h_syncs == 1  # the ids ride the step's one transfer
    dense = make_executor()
    assert dense.limits.routed_expert_layers == ()
    with pytest.raises(BatchValidationError, match=r"routed_experts.*no mixture-of-experts"):
        dense.forward(fb)
    # On the wire: the ask, the caps from the header, the ids and GetInfo's fields.
    msg = batch_to_proto(fb)
    assert batch_from_proto(msg, ex.limits).row_outputs == fb.row_outputs
    small = dataclasses.replace(ex.limits, max_routed_expert_bytes=191)
    with pytest.raises(BatchTooLargeError, match="max_routed_expert_bytes"):
        check_size_claims(msg, small)  # from the header: 12 tokens x 16 bytes
    with pytest.raises(BatchValidationError, match="no mixture-of-experts"):
        check_size_claims(msg, dense.limits)
    back = response_from_proto(response_to_proto(out, 7))
    assert out.extras is not None and out.extras.routed_experts is not None
    assert back.extras is not None and back.extras.routed_experts is not None
    assert torch.equal(back.extras.routed_experts.values, out.extras.routed_experts.values)
    assert back.extras.routed_experts.lengths.tolist() == [12]
    info, _ = info_from_proto(info_to_proto(ex.info, str(path)))
    assert info.limits.routed_expert_layers == (0, 2) and info.limits.routed_experts_top_k == 2
    assert info.limits.max_routed_expert_bytes == 16 << 20


def test_cli_generate_json_routed_experts(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    make_executor: Callable[..., ModelExecutor],
) -> None:
    """`generate --json --routed-experts`: each request's object carries, per token the model
    computed (the prompt, then each generated token but the last), per MoE layer, its top-k
    expert ids: the prompt's equal a direct step's."""
    import json

    from executor.client.cli import main

    monkeypatch.setattr("executor.client.cli_session.configure_logging", lambda *a, **k: None)
    args = ["generate", "hi", "hello there", "--model", "tiny-random-qwen3-moe"]
    args += ["--cache-dir", str(tmp_path), "--max-reqs", "4", "--dtype", "float32"]
    args += ["--max-new-tokens", "4", "--ignore-eos", "--graph-mode", "none"]
    assert main([*args, "--json", "--routed-experts"]) == 0
    out = capsys.readouterr().out
    objs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(objs) == 2
    ex = make_executor(model="tiny-random-qwen3-moe")
    for row, obj in enumerate(objs, start=1):
        prompt, routed = obj["prompt_token_ids"], obj["routed_experts"]
        assert len(routed) == len(prompt) + len(obj["token_ids"]) - 1
        assert all(len(t) == 2 and all(len(k) == 2 for k in t) for t in routed)
        fb = make_extend_batch(
            input_ids=[prompt],
            req_pool_indices=[row],
            out_cache_loc=[list(range(row * 100, row * 100 + len(prompt)))],
        )
        step = ex.forward(
            dataclasses.replace(fb, row_outputs=(RowOutputs(row, routed_experts=True),))
        )
        assert step.extras is not None and step.extras.routed_experts is not None
        assert step.extras.routed_experts.values.tolist() == routed[: len(prompt)]
    assert main([*args, "--routed-experts"]) == 2
    assert "--routed-experts needs --json" in capsys.readouterr().err


@pytest.mark.slow
def test_routed_experts_at_tp2_match_tp1() -> None:
    """Every rank sees the ask (the broadcast carries it) and runs the step eagerly; the
    router is replicated, so rank 0's ids are tp 1's, on a prefill and a DECODE step."""
    from tests.test_tensor_parallel import _tiny
    from tests.tp_util import generate_tp, run_generations

    config = _tiny(model="tiny-random-qwen3-moe", graph_mode="both")
    lens = [len(p) for p in PROMPTS]
    prefill = make_extend_batch(
        input_ids=PROMPTS,
        req_pool_indices=[1, 2],
        out_cache_loc=[list(range(1, 1 + lens[0])), list(range(100, 100 + lens[1]))],
    )
    decode = make_decode_batch(
        input_ids=[DECODED[0][0], DECODED[1][0]],
        req_pool_indices=[1, 2],
        out_cache_loc=[1 + lens[0], 100 + lens[1]],
        seq_lens=[n + 1 for n in lens],
    )
    runs = [{"batches": [dataclasses.replace(b, row_outputs=ASK) for b in (prefill, decode)]}]
    want = run_generations(ModelExecutor(config), PROMPTS, runs)
    got = generate_tp(config.replace(tp_size=2), PROMPTS, runs)
    assert got == want
    for extras, tokens in zip(got[0][1], (19, 2), strict=True):
        assert extras is not None and len(extras["routed_experts"]) == tokens


def test_the_tp_broadcast_carries_the_ask() -> None:
    """The workers run an asking batch eagerly too (the graphs' collectives would differ)."""
    from executor.parallel.broadcast import _ask_from_json, _ask_to_json

    assert _ask_from_json(_ask_to_json(ASK[0])) == ASK[0]
