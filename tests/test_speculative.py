"""Speculative decoding: VERIFY batches (drafts from the scheduler or the executor's prompt
lookup), acceptance against plain decoding, truncation, the rejection rule's distribution."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.client.grpc_client import ExecutorClient
from executor.core.controls_types import RowControl, SamplingControls
from executor.core.errors import BatchValidationError
from executor.core.forward_batch import ForwardBatch, ForwardMode, SamplingBatch, SamplingParams
from executor.model_executor import ModelExecutor
from executor.speculative.ngram import ngram_lookup, ngram_lookup_reference
from executor.speculative.verify import verify_drafts
from ops.sampling import SamplingPlan
from tests.server_util import Scrape, running_server, tiny_config

MakeExecutor = Callable[..., ModelExecutor]
PROMPT = [5, 17, 33, 2, 400, 12, 5, 17, 33, 2]


def verify_batch(
    rows: list[int],
    inputs: list[list[int]],
    prefix: list[int],
    slots: list[list[int]],
    ngram: list[int] | None = None,
    sampling: SamplingBatch | None = None,
) -> ForwardBatch:
    fb = make_extend_batch(
        input_ids=inputs, req_pool_indices=rows, out_cache_loc=slots, prefix_lens=prefix
    )
    return dataclasses.replace(
        fb,
        forward_mode=ForwardMode.VERIFY,
        ngram_draft=None if ngram is None else torch.tensor(ngram, dtype=torch.int32),
        sampling=sampling,
    )


class Spec:
    """One request on `row`: prefill, then VERIFY steps; tracks its tokens and free slots."""

    def __init__(self, ex: ModelExecutor, row: int, prompt: list[int], first_slot: int) -> None:
        self.ex, self.row = ex, row
        self.tokens = list(prompt)  # every token the row holds, plus the pending last one
        self.free = list(range(first_slot + len(prompt), first_slot + 4000))
        fb = make_extend_batch(
            input_ids=[prompt],
            req_pool_indices=[row],
            out_cache_loc=[list(range(first_slot, first_slot + len(prompt)))],
        )
        self.tokens.append(int(ex.forward(fb).next_token_ids[0]))
        self.held = len(prompt)

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def step(self, drafts: list[int], ngram: int = 0) -> list[int]:
        slots = self.take(len(drafts) + 1)
        fb = verify_batch(
            [self.row],
            [[self.tokens[-1], *drafts]],
            [self.held],
            [slots],
            ngram=[ngram] if ngram else None,
        )
        out = self.ex.forward(fb)
        self.last_slots = slots
        assert out.accepted_tokens is not None and out.accepted_lengths is not None
        got = out.accepted_tokens.tolist()
        n = int(out.accepted_lengths[0])
        assert len(got) == n and out.next_token_ids.tolist() == [got[-1]]
        self.held += n  # the input token and the accepted drafts
        self.free = slots[n:] + self.free  # the rejected drafts' slots come back
        self.tokens.extend(got)
        self.last = out
        return got


def plain_greedy(ex: ModelExecutor, prompt: list[int], n: int) -> list[int]:
    fb = make_extend_batch(
        input_ids=[prompt], req_pool_indices=[1], out_cache_loc=[list(range(1, 1 + len(prompt)))]
    )
    out = [int(ex.forward(fb).next_token_ids[0])]
    for i in range(n - 1):
        step = make_decode_batch(
            input_ids=[out[-1]],
            req_pool_indices=[1],
            seq_lens=[len(prompt) + i + 1],
            out_cache_loc=[len(prompt) + i + 1],
        )
        out.append(int(ex.forward(step).next_token_ids[0]))
    return out


def test_ngram_lookup_matches_the_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        bs, length = 4, int(torch.randint(2, 30, (1,), generator=gen))
        history = torch.randint(0, 4, (bs, length), generator=gen)
        lengths = torch.randint(1, length + 1, (bs,), generator=gen)
        for n in (1, 2, 3):
            got = ngram_lookup(history, lengths, n, 5)
            for i in range(bs):
                ref = ngram_lookup_reference(history[i, : lengths[i]].tolist(), n, 5)
                assert got[i].tolist() == ref


@pytest.mark.slow
@pytest.mark.parametrize("graph_mode", ["none", "extend"])
def test_greedy_speculation_equals_plain_greedy(
    make_executor: MakeExecutor, graph_mode: str
) -> None:
    """Drafts that are right, wrong and partly right: the accepted tokens are always the
    plain greedy continuation, on the eager and piecewise paths."""
    want = plain_greedy(make_executor(), PROMPT, 24)
    ex = make_executor(graph_mode=graph_mode)
    spec = Spec(ex, row=1, prompt=PROMPT, first_slot=1)
    paths = set()
    k_plan = [4, 0, 3, 2, 5, 1, 4, 4, 4]
    for i, k in enumerate(k_plan):
        done = len(spec.tokens) - len(PROMPT)
        truth = want[done : done + k]
        drafts = truth if i % 3 == 0 else truth[: k // 2] + [7] * (k - k // 2)
        got = spec.step(drafts[:k] + [9] * (k - len(drafts)))
        if i % 3 == 0 and len(truth) == k:
            assert len(got) == k + 1  # every right draft accepted
        paths.add(spec.last.stats.path)
        if len(spec.tokens) - len(PROMPT) >= len(want):
            break
    n = min(len(want), len(spec.tokens) - len(PROMPT))
    assert spec.tokens[len(PROMPT) : len(PROMPT) + n] == want[:n]
    assert ("piecewise" in paths) == (graph_mode == "extend")


def test_executor_drafts_by_prompt_lookup_and_truncates(make_executor: MakeExecutor) -> None:
    """ngram_draft: the executor drafts; output equals plain greedy; rejected slots are free
    again (a later batch may write them) and the row holds exactly what was accepted."""
    prompt = [11, 12, 13, 14, 15, 16] * 3
    want = plain_greedy(make_executor(), prompt, 20)
    ex = make_executor()
    spec = Spec(ex, row=2, prompt=prompt, first_slot=1)
    drafted = accepted = 0
    slot_tokens = ex.controls.slot_tokens.tokens
    while len(spec.tokens) - len(prompt) < 20:
        expected = ngram_lookup_reference(spec.tokens, 3, 4)
        spec.step([0, 0, 0, 0], ngram=3)  # the executor replaces these
        # What the model scored (recorded at the step's slots) is the lookup's drafts.
        assert slot_tokens[spec.last_slots[1:]].tolist() == expected
        drafted += spec.last.stats.draft_tokens
        accepted += spec.last.stats.accepted_drafts
        assert ex.req_to_token_pool.resident_lens[2] == spec.held
    n = 20
    assert spec.tokens[len(prompt) : len(prompt) + n] == want[:n]
    assert drafted > 0 and accepted >= 0
    # The freed slots (now at the head of the free list) can be written by another request.
    other = make_extend_batch(
        input_ids=[[1, 2]], req_pool_indices=[3], out_cache_loc=[spec.take(2)]
    )
    ex.forward(other)


def test_rows_with_different_k_and_a_seeded_row_stay_batch_independent(
    make_executor: MakeExecutor,
) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    ex_alone, ex_batch = make_executor(), make_executor()
    results = []
    for ex, rows in ((ex_alone, [1]), (ex_batch, [1, 2, 3])):
        for r in rows:
            p = PROMPT[: 4 + r]
            fb = make_extend_batch(
                input_ids=[p],
                req_pool_indices=[r],
                out_cache_loc=[list(range(100 * r, 100 * r + len(p)))],
            )
            ex.forward(fb)
        inputs = [[7, 8, 9, 10], [3], [4, 4]][: len(rows)]
        prefix = [len(PROMPT[: 4 + r]) for r in rows]
        slots = [
            list(range(100 * r + 50, 100 * r + 50 + len(i)))
            for r, i in zip(rows, inputs, strict=True)
        ]
        params = [seeded, SamplingParams(temperature=0.5), SamplingParams()][: len(rows)]
        out = ex.forward(
            verify_batch(
                rows, inputs, prefix, slots, sampling=SamplingBatch.from_params(params, len(rows))
            )
        )
        assert out.accepted_lengths is not None and out.accepted_tokens is not None
        n0 = int(out.accepted_lengths[0])
        results.append(out.accepted_tokens[:n0].tolist())
        assert out.accepted_lengths.tolist()[: len(rows)] == [
            len(t) for t in torch.split(out.accepted_tokens, out.accepted_lengths.tolist())
        ]
    assert results[0] == results[1]


def test_the_rejection_rule_draws_from_the_target_distribution() -> None:
    """Many seeded rows of one synthetic position with a draft: the first output token's
    frequencies match p (chi-square), whichever draft is proposed."""
    vocab, rows = 6, 6000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    p = torch.softmax(logits, 0).numpy()
    for draft in (0, 3):
        # Each row: its input token then the draft; logits at both positions.
        all_logits = logits.repeat(2 * rows, 1)
        ids = torch.tensor([9, draft] * rows) % vocab
        sampling = SamplingBatch.from_params(
            [SamplingParams(temperature=1.0, seed=s) for s in range(rows)], rows
        )
        v = verify_drafts(
            all_logits,
            ids,
            start=torch.arange(rows) * 2,
            k=torch.ones(rows, dtype=torch.int64),
            kmax=1,
            positions=torch.tensor([20, 21] * rows),
            sampling=sampling,
            plan=SamplingPlan.from_host(
                sampling.temperatures,
                sampling.top_ks,
                sampling.top_ps,
                sampling.min_ps,
                sampling.has_seed,
            ),
            generator=torch.Generator().manual_seed(0),
            return_logprob=False,
        )
        first = v.tokens[:, 0].numpy()
        counts = np.bincount(first, minlength=vocab)
        expected = p * rows
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (draft, counts, expected)  # df 5: p ~ 0.001
        accept_rate = float((v.accepted == 1).float().mean())
        assert abs(accept_rate - p[draft]) < 0.03


def test_verify_refusals_change_nothing(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    spec = Spec(ex, row=1, prompt=PROMPT, first_slot=1)
    lens = ex.req_to_token_pool.resident_lens.copy()
    k = ex.limits.max_draft_tokens + 1
    cases = {
        "extend_seq_lens[0]": verify_batch(
            [1], [[spec.tokens[-1]] + [1] * k], [spec.held], [spec.take(k + 1)]
        ),
        "ngram_draft[0]": verify_batch([1], [[1, 2]], [spec.held], [spec.take(2)], ngram=[99]),
        "top_logprobs_num": dataclasses.replace(
            verify_batch([1], [[1, 2]], [spec.held], [spec.take(2)]), top_logprobs_num=2
        ),
        "forward_mode": dataclasses.replace(
            verify_batch([1], [[1, 2]], [spec.held], [spec.take(2)]),
            row_controls=(RowControl(1, SamplingControls(presence_penalty=1.0)),),
        ),
    }
    for field, fb in cases.items():
        with pytest.raises(
            BatchValidationError, match=field.replace("[", r"\[").replace("]", r"\]")
        ):
            ex.forward(fb)
    assert (ex.req_to_token_pool.resident_lens == lens).all()
    plain = make_decode_batch(
        input_ids=[1], req_pool_indices=[1], seq_lens=[spec.held + 1], out_cache_loc=[2000]
    )
    with pytest.raises(BatchValidationError, match="ngram_draft"):
        ex.forward(dataclasses.replace(plain, ngram_draft=torch.tensor([2], dtype=torch.int32)))


@pytest.mark.slow
def test_verify_over_grpc_returns_ragged_tokens_and_counts_metrics(tmp_path: Path) -> None:
    with (
        running_server(tiny_config(tmp_path)) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as client,
    ):
        info = client.info()
        assert info.info.limits.max_draft_tokens == 16 and info.info.limits.max_ngram == 8
        prompt = [11, 12, 13, 14] * 4
        fb = make_extend_batch(
            input_ids=[prompt, PROMPT],
            req_pool_indices=[1, 2],
            out_cache_loc=[list(range(1, 17)), list(range(20, 30))],
        )
        first = client.forward(fb).next_token_ids.tolist()
        out = client.forward(
            verify_batch(
                [1, 2],
                [[first[0], 0, 0, 0], [first[1]]],
                [16, 10],
                [[40, 41, 42, 43], [50]],
                ngram=[2, 0],
            )
        )
        assert out.accepted_lengths is not None and out.accepted_tokens is not None
        assert out.accepted_lengths.tolist()[1] == 1
        assert int(out.accepted_lengths.sum()) == len(out.accepted_tokens)
        assert out.stats.mode == "verify" and out.stats.draft_tokens == 3
        scrape = Scrape(srv)
        assert scrape.get("model_executor_draft_tokens_total") == 3
        assert scrape.get("model_executor_accepted_drafts_total") == out.stats.accepted_drafts
        assert scrape.get("model_executor_accepted_length_count") == 2


@pytest.mark.slow
def test_pipelined_verify_steps_continue_from_what_the_row_holds(tmp_path: Path) -> None:
    """Step N+1 is sent before step N's answer: its input is step N's bonus by future-token
    reference and its prefix -1 ("what the row holds now"); over a ForwardStream the tokens
    equal plain greedy decoding, and no slot a row holds is written twice."""
    prompt = [11, 12, 13, 14, 15, 16] * 3
    config = tiny_config(tmp_path, max_reqs=4, kv_slots=2048, future_slots=64)
    want = plain_greedy(ModelExecutor(config), prompt, 24)
    k, steps = 3, 8
    with running_server(config) as srv, ExecutorClient(f"127.0.0.1:{srv.port}") as client:
        session = client.open_stream()
        first = make_extend_batch(
            input_ids=[prompt], req_pool_indices=[1], out_cache_loc=[list(range(1, 19))]
        )
        session.send(dataclasses.replace(first, future_token_slots=torch.tensor([1])))
        slot = 19
        for i in range(steps):  # all sent ahead; slots over-allocated, k + 1 per step
            fb = verify_batch(
                [1], [[-(i + 1)] + [0] * k], [-1], [list(range(slot, slot + k + 1))], ngram=[3]
            )
            fb = dataclasses.replace(
                fb,
                seq_lens=torch.tensor([0]),
                future_token_slots=torch.tensor([i + 2]),
                released_future_slots=torch.tensor([i]) if i else None,
            )
            session.send(fb)
            slot += k + 1
        tokens = session.recv().next_token_ids.tolist()
        for _ in range(steps):
            out = session.recv()
            assert out.accepted_tokens is not None
            tokens += out.accepted_tokens.tolist()
        session.close()
    assert tokens[: len(want)] == want[: len(tokens)]
