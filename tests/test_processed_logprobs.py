"""PROCESSED logprobs (SamplingParams.logprobs_mode) against an independent computation from
transformers' logits and logits processors: 4 seeded prompts x 32 sampled tokens with
temperature, top-k, top-p, min-p and penalties, on the eager and both graph paths and in
VERIFY; RAW rows in the same batch stay the model's log-softmax."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.core.controls_types import RowControl, SamplingControls
from executor.core.forward_batch import (
    ForwardMode,
    LogprobsMode,
    SamplingBatch,
    SamplingParams,
)
from executor.core.outputs import ForwardOutput
from executor.model_executor import ModelExecutor
from executor.models.hf_loader import save_hf_directory
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights

transformers = pytest.importorskip("transformers")
lp = pytest.importorskip("transformers.generation.logits_process")

MakeExecutor = Callable[..., ModelExecutor]
PROCESSED = LogprobsMode.PROCESSED
NEW_TOKENS = 32
TOP = 3
TOL = 1e-4  # float32, per the issue

# (params, controls) per row: the four PROCESSED rows cover temperature, top-k, top-p, min-p,
# every penalty and a greedy row; the last, RAW and sampled, must stay the model's own.
ROWS: list[tuple[SamplingParams, SamplingControls | None]] = [
    (SamplingParams(temperature=0.8, top_k=12, seed=11, logprobs_mode=PROCESSED), None),
    (
        SamplingParams(temperature=1.3, top_p=0.8, seed=12, logprobs_mode=PROCESSED),
        SamplingControls(frequency_penalty=0.7, presence_penalty=0.4),
    ),
    (
        SamplingParams(
            temperature=0.6, top_k=40, top_p=0.9, min_p=0.05, seed=13, logprobs_mode=PROCESSED
        ),
        SamplingControls(repetition_penalty=1.3, logit_bias=((7, 2.0),)),
    ),
    (SamplingParams(temperature=0.0, top_k=5, min_p=0.1, logprobs_mode=PROCESSED), None),
    (SamplingParams(temperature=0.9, seed=14), None),  # RAW
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = TINY_CONFIGS["tiny-random"]
    path = tmp_path_factory.mktemp("hf") / "tiny-random"
    save_hf_directory(path, config, tiny_random_weights(config))
    return path


@pytest.fixture(scope="module")
def hf(hf_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def reference_logprobs(
    hf: torch.nn.Module,
    prompt: list[int],
    tokens: list[int],
    p: SamplingParams,
    c: SamplingControls | None,
) -> torch.Tensor:
    """[len(tokens), V]: at each sampled position, the log-probabilities of the distribution
    the issue defines, from transformers' logits and its logits processors."""
    seq = torch.tensor([prompt + tokens[:-1]])
    with torch.inference_mode():
        logits = hf(seq).logits[0, len(prompt) - 1 :].float()
    warpers: list[object] = []
    if p.temperature >= 1e-5:
        warpers.append(lp.TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        warpers.append(lp.TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(lp.TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        warpers.append(lp.MinPLogitsWarper(p.min_p))
    out = []
    for i, row in enumerate(logits):
        history = torch.tensor([prompt + tokens[:i]])
        scores = row.unsqueeze(0).clone()
        if c is not None:
            if c.repetition_penalty != 1.0:
                scores = lp.RepetitionPenaltyLogitsProcessor(c.repetition_penalty)(history, scores)
            counts = torch.bincount(
                torch.tensor(tokens[:i], dtype=torch.long), minlength=scores.shape[-1]
            ).float()
            scores = scores - c.frequency_penalty * counts - c.presence_penalty * (counts > 0)
            for token, bias in c.logit_bias:
                scores[0, token] += bias
        for w in warpers:
            scores = w(history, scores)  # type: ignore[operator]
        out.append(torch.log_softmax(scores[0], dim=-1))
    return torch.stack(out)


def greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(hf(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def run_rows(ex: ModelExecutor, ps: list[list[int]]) -> list[list[ForwardOutput]]:
    """Every row of ROWS in one batch: a prefill, then decode steps to NEW_TOKENS tokens."""
    params = [p for p, _ in ROWS]
    rows = list(range(1, len(ps) + 1))
    slot = 1
    locs = []
    for prompt in ps:
        locs.append(list(range(slot, slot + len(prompt))))
        slot += len(prompt) + NEW_TOKENS
    fb = make_extend_batch(
        input_ids=ps,
        req_pool_indices=rows,
        out_cache_loc=locs,
        sampling=params,
        return_logprob=True,
        top_logprobs_num=TOP,
    )
    controls = tuple(
        RowControl(r, c) for r, (_, c) in zip(rows, ROWS, strict=True) if c is not None
    )
    outs = [ex.forward(dataclasses.replace(fb, row_controls=controls))]
    for step in range(1, NEW_TOKENS):
        fb = make_decode_batch(
            input_ids=outs[-1].next_token_ids.tolist(),
            req_pool_indices=rows,
            seq_lens=[len(p) + step for p in ps],
            out_cache_loc=[loc[0] + len(p) + step - 1 for loc, p in zip(locs, ps, strict=True)],
            sampling=params,
            return_logprob=True,
            top_logprobs_num=TOP,
        )
        outs.append(ex.forward(fb))
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("graph_mode", ["none", "decode", "extend"])
def test_processed_logprobs_equal_transformers(
    make_executor: MakeExecutor, hf_dir: Path, hf: torch.nn.Module, graph_mode: str
) -> None:
    ex = make_executor(model=str(hf_dir), graph_mode=graph_mode)
    ps = prompts(len(ROWS), ex.info.vocab_size)
    outs = run_rows(ex, ps)
    paths = {o.stats.path for o in outs}
    assert graph_mode == "none" or paths & {"full_graph", "piecewise"}, paths
    for r, (p, c) in enumerate(ROWS):
        tokens = [int(o.next_token_ids[r]) for o in outs]
        got = torch.tensor([float(o.next_token_logprobs[r]) for o in outs])  # type: ignore[index]
        top = torch.stack([o.top_logprobs[r] for o in outs])  # type: ignore[index]
        top_ids = torch.stack([o.top_logprob_ids[r] for o in outs])  # type: ignore[index]
        if p.logprobs_mode is PROCESSED:
            ref = reference_logprobs(hf, ps[r], tokens, p, c)
        else:  # RAW: the model's log-softmax, whatever the sampling and controls
            ref = reference_logprobs(hf, ps[r], tokens, SamplingParams(temperature=0.0), None)
        want = ref.gather(1, torch.tensor(tokens).unsqueeze(1))[:, 0]
        assert torch.isfinite(want).all(), f"row {r} drew a token outside its distribution"
        torch.testing.assert_close(got, want, rtol=0, atol=TOL, msg=f"row {r}")
        ref_top = ref.topk(TOP, dim=-1).values
        finite = torch.isfinite(ref_top)
        assert torch.equal(finite, torch.isfinite(top)), f"row {r}"
        torch.testing.assert_close(top[finite], ref_top[finite], rtol=0, atol=TOL)
        torch.testing.assert_close(ref.gather(1, top_ids)[finite], top[finite], rtol=0, atol=TOL)
        if p.temperature == 0.0:  # greedy: the processed distribution's argmax
            assert tokens == ref.argmax(dim=-1).tolist()
        elif p.top_k or p.top_p < 1 or p.min_p:  # truncation matters: some token is -inf
            assert torch.isinf(ref).any(dim=-1).all()


def test_processed_logprobs_in_verify_are_the_target_distributions(
    make_executor: MakeExecutor, hf_dir: Path, hf: torch.nn.Module
) -> None:
    """VERIFY: each accepted token's (drafts and bonus) logprob under the target distribution
    at its position, on a sampled and a greedy PROCESSED row beside a RAW one."""
    ex = make_executor(model=str(hf_dir))
    params = [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, logprobs_mode=PROCESSED),
        SamplingParams(temperature=0.0, top_k=4, logprobs_mode=PROCESSED),
        SamplingParams(temperature=1.1, seed=6),
    ]
    ps = prompts(3, ex.info.vocab_size)
    rows, slot, locs = [1, 2, 3], 1, []
    for prompt in ps:
        locs.append(list(range(slot, slot + len(prompt) + 8)))
        slot += len(prompt) + 8
    first = ex.forward(
        make_extend_batch(
            input_ids=ps,
            req_pool_indices=rows,
            out_cache_loc=[loc[: len(p)] for loc, p in zip(locs, ps, strict=True)],
            sampling=params,
        )
    ).next_token_ids.tolist()
    # Drafts: the model's greedy continuation (so some are accepted), none, junk.
    drafts = [greedy(hf, ps[0] + first[:1], 3), greedy(hf, ps[1] + first[1:2], 2), [3, 4]]
    inputs = [[t, *d] for t, d in zip(first, drafts, strict=True)]
    fb = make_extend_batch(
        input_ids=inputs,
        req_pool_indices=rows,
        out_cache_loc=[
            loc[len(p) : len(p) + len(i)] for loc, p, i in zip(locs, ps, inputs, strict=True)
        ],
        prefix_lens=[len(p) for p in ps],
        sampling=params,
        return_logprob=True,
    )
    out = ex.forward(dataclasses.replace(fb, forward_mode=ForwardMode.VERIFY))
    assert out.accepted_tokens is not None and out.accepted_lengths is not None
    assert out.accepted_logprobs is not None
    tokens = torch.split(out.accepted_tokens, out.accepted_lengths.tolist())
    logprobs = torch.split(out.accepted_logprobs, out.accepted_lengths.tolist())
    assert out.accepted_lengths.tolist()[:2] != [1, 1]  # some draft was accepted
    for r, p in enumerate(params):
        got_tokens = [first[r], *tokens[r].tolist()]
        q = p if p.logprobs_mode is PROCESSED else SamplingParams(temperature=0.0)
        ref = reference_logprobs(hf, ps[r], got_tokens, q, None)[1:]  # after the input token
        want = ref.gather(1, tokens[r].unsqueeze(1))[:, 0]
        torch.testing.assert_close(logprobs[r], want, rtol=0, atol=TOL, msg=f"row {r}")


def test_a_batch_without_processed_rows_does_no_truncation_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RAW (the default) asks for nothing new: a greedy batch with logprobs never truncates,
    and a PROCESSED row's plan is decided from the host values (no device read)."""
    import executor.sampling as sampling_mod
    from executor.sampling import Sampler

    calls = []
    real = sampling_mod.truncate
    monkeypatch.setattr(sampling_mod, "truncate", lambda *a: calls.append(1) or real(*a))
    logits = torch.randn(3, 50)
    sampler = Sampler(torch.device("cpu"), 0)
    raw = SamplingBatch.from_params([SamplingParams(top_k=3)] * 3, 3)
    draw = sampler.draw(
        logits,
        Sampler.plan(raw),
        raw,
        torch.ones(3, dtype=torch.int64),
        return_logprob=True,
        top_logprobs_num=2,
    )
    assert calls == []
    torch.testing.assert_close(
        draw.device[0][:, 1].float(),
        torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True))[:, 0],
    )
    mixed = dataclasses.replace(raw, processed=torch.tensor([False, True, False]))
    plan = Sampler.plan(mixed)
    assert plan.all_greedy and plan.any_processed and plan.all_top_k and plan.max_top_k == 3
    draw = sampler.draw(
        logits,
        plan,
        mixed,
        torch.ones(3, dtype=torch.int64),
        return_logprob=True,
        top_logprobs_num=4,
    )
    assert calls == [1]
    packed = draw.device[0].float()
    assert torch.isinf(packed[1, 2 + 3]) and not torch.isinf(packed[[0, 2], 2 + 3]).any()


def test_cli_generate_json_logprobs_on_plain_overlap_and_speculative_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`generate --json --logprobs`: one object per request per line; the same tokens and
    logprobs whether steps overlap or verify prompt-lookup drafts (greedy, PROCESSED)."""
    import json

    from executor.client.cli import main

    monkeypatch.setattr("executor.client.cli_session.configure_logging", lambda *a, **k: None)
    args = ["generate", "hi", "hello there", "--model", "tiny-random", "--max-new-tokens", "8"]
    args += ["--cache-dir", str(tmp_path), "--max-reqs", "4", "--dtype", "float32"]
    args += ["--ignore-eos", "--json", "--logprobs", "--logprobs-mode", "processed"]
    args += ["--top-k", "5", "--graph-mode", "none"]

    def run(*extra: str) -> list[dict[str, object]]:
        assert main([*args, *extra]) == 0
        out = capsys.readouterr().out
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    plain = run()
    assert [len(r["token_ids"]) for r in plain] == [8, 8]  # type: ignore[arg-type]
    for r in plain:
        assert set(r) == {"prompt_token_ids", "token_ids", "text", "finish_reason", "logprobs"}
        logprobs = r["logprobs"]
        assert isinstance(logprobs, list) and len(logprobs) == 8
        assert all(-1e9 < x <= 0 for x in logprobs)
    for other in (run("--overlap"), run("--speculate", "2", "--ngram", "1")):
        for a, b in zip(plain, other, strict=True):
            assert a["token_ids"] == b["token_ids"]
            torch.testing.assert_close(
                torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), rtol=0, atol=TOL
            )
    assert main([*args[:-8], "--logprobs"]) == 2  # logprobs go in the JSON
    assert "--logprobs needs --json" in capsys.readouterr().err
