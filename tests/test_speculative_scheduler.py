"""The reference scheduler with speculation: same greedy tokens, the switch-off policy, stops
and budgets inside an accepted run, every row and slot released, the CLI flags."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from executor.client.cli import build_parser
from executor.client.scheduler import ReferenceScheduler, generate
from executor.client.speculation import (
    DraftState,
    NgramIndex,
    SpeculationPolicy,
    fit_draft_lens,
)
from executor.core.forward_batch import ForwardBatch, ForwardMode, SamplingParams
from executor.core.outputs import ForwardOutput
from executor.model_executor import ModelExecutor

MakeExecutor = Callable[..., ModelExecutor]
# tiny-random's greedy continuations of these fall into repeats within 30 tokens (a run of
# one token from the 14th, a short-lived four-token cycle), where prompt lookup drafts
# right; PLAIN's does not repeat early on.
LOOPING = [[7, 8, 9], [52, 420, 159] * 3]
PLAIN = [5, 17, 33, 2, 400, 12, 5, 17, 33, 2]
ALWAYS = SpeculationPolicy(min_accepted=0.0)  # never switches off (drafts on lookup matches)
EVERY_STEP = SpeculationPolicy(min_accepted=0.0, only_on_match=False)


def has_match(tokens: list[int], n: int) -> bool:
    """Prompt lookup's rule: the last n tokens occur earlier (with a token after them)."""
    return any(tokens[s : s + n] == tokens[-n:] for s in range(len(tokens) - n))


SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=11)
_PLAIN_RUNS: dict[str, list[int]] = {}


def plain_run(make_executor: MakeExecutor, which: str) -> list[int]:
    """The plain scheduler's tokens (no speculation), computed once for the module: LOOPING's
    (30 new tokens), PLAIN's (16) and PLAIN's seeded sampled ones (30); all in one batch
    (greedy and seeded draws are batch-independent)."""
    if not _PLAIN_RUNS:
        ex = make_executor()
        sched = ReferenceScheduler(ex.forward, ex.limits)
        reqs = {
            "looping0": sched.add_request(LOOPING[0], max_new_tokens=30, ignore_eos=True),
            "looping1": sched.add_request(LOOPING[1], max_new_tokens=30, ignore_eos=True),
            "plain": sched.add_request(PLAIN, max_new_tokens=16, ignore_eos=True),
            "seeded": sched.add_request(PLAIN, max_new_tokens=30, sampling=SEEDED, ignore_eos=True),
        }
        sched.run()
        _PLAIN_RUNS.update({k: r.output_ids for k, r in reqs.items()})
    return _PLAIN_RUNS[which]


class Counting:
    """An executor's forward that counts the batches' modes."""

    def __init__(self, ex: ModelExecutor) -> None:
        self.ex, self.modes = ex, Counter[ForwardMode]()

    def __call__(self, batch: ForwardBatch) -> ForwardOutput:
        self.modes[batch.forward_mode] += 1
        return self.ex.forward(batch)


@pytest.mark.slow
@pytest.mark.parametrize("graph_mode", ["none", "extend"])
def test_greedy_speculation_equals_plain_greedy_and_releases_everything(
    make_executor: MakeExecutor, graph_mode: str
) -> None:
    """Two drafting requests and one that does not (a seeded sampled one) share the VERIFY
    steps; every token equals the plain scheduler's, drafts were accepted, and the rows and
    slots are all free at the end."""
    want = [plain_run(make_executor, "looping0"), plain_run(make_executor, "looping1")]
    ex = make_executor(graph_mode=graph_mode, max_tokens_per_batch=64)
    forward = Counting(ex)
    sched = ReferenceScheduler(forward, ex.limits, speculation=ALWAYS)
    reqs = [sched.add_request(p, max_new_tokens=30, ignore_eos=True, speculate=4) for p in LOOPING]
    mine = sched.add_request(PLAIN, max_new_tokens=30, sampling=SEEDED, ignore_eos=True)
    sched.run()
    assert [r.output_ids for r in reqs] == want
    assert mine.output_ids == plain_run(
        make_executor, "seeded"
    )  # k = 0 rows of VERIFY steps: the same draws
    first = reqs[0].draft
    assert first is not None and first.accepted >= 6 and first.no_match_steps > 0
    assert forward.modes[ForwardMode.VERIFY] >= first.verify_steps
    assert ex.req_to_token_pool.rows_in_use() == 0 and ex.req_to_token_pool.slots_in_use() == 0
    assert sched.allocator.free_rows == ex.limits.max_reqs
    assert sched.allocator.free_slots == ex.limits.kv_slots
    assert sched.released_rows == []


def test_drafting_stops_for_a_request_whose_drafts_are_never_accepted(
    make_executor: MakeExecutor,
) -> None:
    """PLAIN's drafts are never accepted: after `min_steps` VERIFY steps the request decodes
    with DECODE steps to the end (no retry), and its tokens are still plain greedy."""
    want = plain_run(make_executor, "plain")
    ex = make_executor()
    forward = Counting(ex)
    policy = SpeculationPolicy(
        min_steps=3, window=4, min_accepted=0.5, retry_after=0, only_on_match=False
    )
    sched = ReferenceScheduler(forward, ex.limits, speculation=policy)
    req = sched.add_request(PLAIN, max_new_tokens=16, ignore_eos=True, speculate=4)
    sched.run()
    assert req.output_ids == want
    assert req.draft is not None
    assert (req.draft.verify_steps, req.draft.drafted, req.draft.accepted) == (3, 12, 0)
    assert req.draft.switch_offs == 1 and not req.draft.drafting
    assert forward.modes[ForwardMode.VERIFY] == 3
    assert forward.modes[ForwardMode.DECODE] == 16 - 1 - 3  # the first token is the prefill's


def test_the_policy_switches_off_on_the_moving_average_and_backs_off() -> None:
    policy = SpeculationPolicy(min_steps=2, window=3, min_accepted=1.0, retry_after=4)
    d = DraftState(k=4, ngram=3, policy=policy)
    d.record(4, 3)
    assert d.drafting  # one step: not judged yet
    d.record(4, 0)
    d.record(4, 0)  # mean of (3, 0, 0) = 1.0: still on
    assert d.drafting and d.draft_len(remaining=10) == 4
    d.record(4, 0)  # the window slid: (0, 0, 0)
    assert not d.drafting and d.draft_len(10) == 0 and d.switch_offs == 1
    for _ in range(4):
        d.record(0, 0)  # plain steps count down
    assert d.drafting and d.plain_steps == 4
    assert d.draft_len(remaining=3) == 2  # never past the budget: k + 1 <= remaining
    d.record(2, 0)
    d.record(2, 0)
    assert not d.drafting and d.wait == 8  # the wait doubles
    d.record(0, 0)
    assert d.wait == 7 and d.plain_steps == 5
    assert (d.verify_steps, d.drafted, d.accepted) == (6, 20, 3)
    fresh = DraftState(k=4, ngram=3, policy=policy)
    fresh.record(0, 0)  # a k = 0 step at the budget's end while drafting: nothing counts
    assert fresh == DraftState(k=4, ngram=3, policy=policy)


def test_the_host_index_finds_a_match_exactly_when_prompt_lookup_does() -> None:
    gen = random.Random(0)
    for _ in range(200):
        n = gen.randint(1, 4)
        prompt = [gen.randint(0, 3) for _ in range(gen.randint(1, 8))]
        index, output = NgramIndex(n, prompt), list[int]()
        for _ in range(12):
            tokens = prompt + output
            assert index.has_match(output) == has_match(tokens, n), (prompt, output, n)
            output += [gen.randint(0, 3) for _ in range(gen.randint(1, 3))]


def test_a_request_drafts_only_where_the_lookup_matches(make_executor: MakeExecutor) -> None:
    """A VERIFY step exactly where PLAIN's tokens end in a 3-gram seen before, DECODE steps
    elsewhere; the tokens are plain greedy."""
    want = plain_run(make_executor, "plain")[:12]
    forward = Counting(make_executor())
    sched = ReferenceScheduler(forward, forward.ex.limits, speculation=ALWAYS)
    req = sched.add_request(PLAIN, max_new_tokens=12, ignore_eos=True, speculate=4)
    sched.run()
    assert req.output_ids == want and req.draft is not None
    tokens = PLAIN + want
    # Decode steps after 1..10 new tokens may draft (the last one's budget leaves no room).
    matches = sum(has_match(tokens[:i], 3) for i in range(len(PLAIN) + 1, len(tokens) - 1))
    assert req.draft.verify_steps == forward.modes[ForwardMode.VERIFY] == matches
    assert req.draft.no_match_steps == 10 - matches
    assert forward.modes[ForwardMode.DECODE] == 11 - matches


def test_draft_lengths_are_cut_to_the_token_budget() -> None:
    assert fit_draft_lens([4, 4, 4], 15) == [4, 4, 4]
    assert fit_draft_lens([4, 4, 4], 10) == [4, 3, 0]
    assert fit_draft_lens([0, 4], 2) == [0, 0]


class Scripted:
    """A stand-in executor whose every row continues one fixed token sequence and accepts all
    drafts: the run a VERIFY step returns is the next k + 1 tokens of the script."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.verify_runs = script, list[list[int]]()

    def __call__(self, batch: ForwardBatch) -> ForwardOutput:
        bs = batch.batch_size
        if batch.forward_mode is ForwardMode.VERIFY:
            assert batch.extend_prefix_lens is not None and batch.extend_seq_lens is not None
            runs = []
            prefix, lens = batch.extend_prefix_lens.tolist(), batch.extend_seq_lens.tolist()
            for pre, n in zip(prefix, lens, strict=True):
                # The prompt is 2 tokens: the input token is output `pre - 2`, then the run.
                runs.append(self.script[pre - 1 : pre - 1 + n])
            self.verify_runs += runs
            return ForwardOutput(
                next_token_ids=torch.tensor([r[-1] for r in runs]),
                accepted_tokens=torch.tensor([t for r in runs for t in r]),
                accepted_lengths=torch.tensor([len(r) for r in runs], dtype=torch.int32),
            )
        if batch.forward_mode is ForwardMode.DECODE:
            assert batch.seq_lens is not None
            return ForwardOutput(
                next_token_ids=torch.tensor([self.script[n - 2] for n in batch.seq_lens.tolist()])
            )
        if batch.forward_mode is ForwardMode.IDLE:  # the last releases
            return ForwardOutput(next_token_ids=torch.zeros(0, dtype=torch.int64))
        return ForwardOutput(next_token_ids=torch.tensor([self.script[0]] * bs))


def test_a_stop_token_or_the_budget_inside_an_accepted_run_ends_the_request(
    make_executor: MakeExecutor,
) -> None:
    limits = make_executor().limits
    script = [50, 51, 52, 53, 99, 54, 55, 56, 57, 58, 59, 60]
    forward = Scripted(script)
    sched = ReferenceScheduler(forward, limits, speculation=EVERY_STEP)
    stopped = sched.add_request([1, 2], max_new_tokens=10, stop_token_ids=[99], speculate=4)
    sched.run()
    # 50 from the prefill, then one run of 51..55 with the stop inside: 54, 55 are dropped.
    assert forward.verify_runs == [[51, 52, 53, 99, 54]]
    assert stopped.output_ids == [50, 51, 52, 53] and stopped.finish_reason == "stop"

    forward = Scripted(script)
    sched = ReferenceScheduler(forward, limits, speculation=EVERY_STEP)
    capped = sched.add_request([1, 2], max_new_tokens=8, speculate=4)
    sched.run()
    # The drafts shrink at the budget's end (the step's k + 1 never passes it).
    assert [len(r) for r in forward.verify_runs] == [5, 2]
    assert capped.output_ids == script[:8] and capped.finish_reason == "length"
    assert sched.allocator.free_slots == limits.kv_slots


def test_a_budget_inside_a_real_accepted_run(make_executor: MakeExecutor) -> None:
    """LOOPING[0]'s run of one repeated token is drafted right; the budget ends inside it."""
    want = plain_run(make_executor, "looping0")[:20]
    ex = make_executor()
    sched = ReferenceScheduler(ex.forward, ex.limits, speculation=ALWAYS)
    req = sched.add_request(LOOPING[0], max_new_tokens=20, ignore_eos=True, speculate=5)
    sched.run()
    assert req.output_ids == want and req.finish_reason == "length"
    assert ex.req_to_token_pool.slots_in_use() == 0


def test_speculation_is_refused_with_overlap_and_past_the_limits(
    make_executor: MakeExecutor,
) -> None:
    ex = make_executor()
    with pytest.raises(ValueError, match="overlap"):
        generate(ex.forward, ex.limits, [PLAIN], overlap=True, speculate=4)
    sched = ReferenceScheduler(ex.forward, ex.limits)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        sched.add_request(PLAIN, speculate=ex.limits.max_draft_tokens + 1)
    with pytest.raises(ValueError, match="max_ngram"):
        sched.add_request(PLAIN, speculate=2, ngram=ex.limits.max_ngram + 1)


def test_the_cli_takes_speculate_and_ngram() -> None:
    args = build_parser().parse_args(["generate", "hi", "--speculate", "4", "--ngram", "2"])
    assert (args.speculate, args.ngram) == (4, 2)
    args = build_parser().parse_args(["generate", "hi"])
    assert (args.speculate, args.ngram) == (0, 3)
