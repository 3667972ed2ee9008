"""The in-process executor driven step by step the way a scheduler drives it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.client.scheduler import ReferenceScheduler, generate
from executor.core.errors import BatchValidationError
from executor.core.forward_batch import SamplingParams
from executor.model_executor import ModelExecutor
from ops.host_transfer import host_transfers

MakeExecutor = Callable[..., ModelExecutor]
PROMPTS = [
    [5, 17, 33, 2, 400, 12],
    [9],
    [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 3],
    [7, 7, 7],
]


def _alone(make_executor: MakeExecutor, prompt: list[int], **kwargs: object) -> list[int]:
    ex = make_executor(**{k: v for k, v in kwargs.items() if k == "model"})
    gen_kwargs = {k: v for k, v in kwargs.items() if k != "model"}
    return generate(ex.forward, ex.limits, [prompt], ignore_eos=True, **gen_kwargs)[0]  # type: ignore[arg-type]


def _prefill_logits(ex: ModelExecutor, ids: list[int], row: int, first_slot: int) -> torch.Tensor:
    fb = make_extend_batch(
        input_ids=[ids],
        req_pool_indices=[row],
        out_cache_loc=[list(range(first_slot, first_slot + len(ids)))],
    )
    out = ex.forward(fb, return_logits=True)
    assert out.logits is not None
    return out.logits[0]


@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-qwen2"])
def test_batched_decode_of_mixed_lengths_equals_each_alone(
    make_executor: MakeExecutor, model: str
) -> None:
    alone = [_alone(make_executor, p, model=model, max_new_tokens=12) for p in PROMPTS]
    ex = make_executor(model=model)
    together = generate(ex.forward, ex.limits, PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert together == alone


def test_batched_decode_logits_match_single_request_logits(make_executor: MakeExecutor) -> None:
    ex_batch, ex_single = make_executor(), make_executor()
    rows, slot = [1, 2, 3], 1
    ids = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]
    locs = []
    for p in ids:
        locs.append(list(range(slot, slot + len(p))))
        slot += len(p)
    ex_batch.forward(make_extend_batch(input_ids=ids, req_pool_indices=rows, out_cache_loc=locs))
    for i in range(3):
        ex_single.forward(
            make_extend_batch(
                input_ids=[ids[i]], req_pool_indices=[rows[i]], out_cache_loc=[locs[i]]
            )
        )
    seq = [len(p) + 1 for p in ids]
    decode = dict(
        input_ids=[1, 2, 3], req_pool_indices=rows, seq_lens=seq, out_cache_loc=[500, 501, 502]
    )
    batched = ex_batch.forward(make_decode_batch(**decode), return_logits=True).logits
    for i in range(3):
        single = ex_single.forward(
            make_decode_batch(
                input_ids=[i + 1],
                req_pool_indices=[rows[i]],
                seq_lens=[seq[i]],
                out_cache_loc=[500 + i],
            ),
            return_logits=True,
        ).logits
        torch.testing.assert_close(batched[i], single[0], atol=1e-5, rtol=0)


def test_chunked_prefill_equals_one_shot_prefill(make_executor: MakeExecutor) -> None:
    prompt = list(range(10, 60))
    one_shot = _prefill_logits(make_executor(), prompt, row=1, first_slot=1)
    ex = make_executor()
    pos = 0
    for chunk in (7, 1, 20, 22):
        fb = make_extend_batch(
            input_ids=[prompt[pos : pos + chunk]],
            req_pool_indices=[1],
            out_cache_loc=[list(range(1 + pos, 1 + pos + chunk))],
            prefix_lens=[pos],
        )
        out = ex.forward(fb, return_logits=True)
        pos += chunk
    assert pos == len(prompt)
    torch.testing.assert_close(out.logits[0], one_shot, atol=1e-5, rtol=0)
    assert out.logits[0].argmax() == one_shot.argmax()


def test_prefix_from_another_requests_slots_equals_fresh_prefill(
    make_executor: MakeExecutor,
) -> None:
    shared, tail = [40, 41, 42, 43, 44, 45, 46, 47], [90, 91, 92]
    fresh = _prefill_logits(make_executor(), shared + tail, row=1, first_slot=1)
    ex = make_executor()
    _prefill_logits(
        ex, shared + [7, 8], row=1, first_slot=1
    )  # another request holding the prefix in slots 1..8
    fb = make_extend_batch(
        input_ids=[tail],
        req_pool_indices=[2],
        out_cache_loc=[[100, 101, 102]],
        prefix_lens=[len(shared)],
        prefix_cache_loc=[list(range(1, 1 + len(shared)))],
    )
    out = ex.forward(fb, return_logits=True)
    torch.testing.assert_close(out.logits[0], fresh, atol=1e-5, rtol=0)
    # Row 2 now holds prefix + tail and can decode on.
    assert ex.req_to_token_pool.resident_lens[2] == len(shared) + len(tail)
    assert ex.req_to_token_pool.req_to_token[2, :11].tolist() == list(range(1, 9)) + [100, 101, 102]


def test_mixed_prefix_and_fresh_requests_in_one_extend(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    a = [3, 4, 5, 6]
    _prefill_logits(ex, a, row=1, first_slot=1)
    fb = make_extend_batch(
        input_ids=[[7, 8], [20, 21, 22]],
        req_pool_indices=[1, 2],
        out_cache_loc=[[5, 6], [50, 51, 52]],
        prefix_lens=[4, 0],
    )
    out = ex.forward(fb, return_logits=True)
    ref = make_executor()
    r0 = _prefill_logits(ref, a + [7, 8], row=1, first_slot=1)
    r1 = _prefill_logits(ref, [20, 21, 22], row=2, first_slot=50)
    torch.testing.assert_close(out.logits, torch.stack([r0, r1]), atol=1e-5, rtol=0)


def test_idle_batch_returns_nothing_and_changes_nothing(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    before = ex.req_to_token_pool.req_to_token.clone()
    out = ex.forward(make_idle_batch())
    assert out.next_token_ids.shape == (0,)
    assert out.stats.path == "eager" and out.stats.batch_size == 0
    assert torch.equal(before, ex.req_to_token_pool.req_to_token)


def test_logprobs_and_stats_come_back(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    fb = make_extend_batch(
        input_ids=[[1, 2, 3], [4, 5]],
        req_pool_indices=[1, 2],
        out_cache_loc=[[1, 2, 3], [4, 5]],
        return_logprob=True,
        top_logprobs_num=3,
    )
    out = ex.forward(fb, return_logits=True)
    ref = torch.log_softmax(out.logits, -1)
    assert out.top_logprob_ids is not None and out.top_logprob_ids.shape == (2, 3)
    torch.testing.assert_close(
        out.next_token_logprobs, ref.gather(1, out.next_token_ids[:, None])[:, 0]
    )
    assert out.stats.num_tokens == 5 and out.stats.padded_num_tokens == 5
    assert set(out.stats.timings_ns) == {"validate", "stage", "forward", "sample", "read", "total"}


def test_reference_scheduler_chunks_long_prompts_and_frees_capacity(
    make_executor: MakeExecutor,
) -> None:
    ex = make_executor(max_tokens_per_batch=16)
    prompts = [list(range(1, 40)), list(range(50, 60))]
    expected = [_alone(make_executor, p, max_new_tokens=5) for p in prompts]
    sched = ReferenceScheduler(ex.forward, ex.limits)
    reqs = [sched.add_request(p, max_new_tokens=5, ignore_eos=True) for p in prompts]
    sched.run()
    assert [r.output_ids for r in reqs] == expected
    assert all(r.finish_reason == "length" for r in reqs)
    assert sched.allocator.free_rows == ex.limits.max_reqs
    assert sched.allocator.free_slots == ex.limits.kv_slots


def test_scheduler_stops_on_a_stop_token(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    full = generate(ex.forward, ex.limits, [[5, 6, 7]], max_new_tokens=8, ignore_eos=True)[0]
    stop = full[3]
    ex2 = make_executor()
    sched = ReferenceScheduler(ex2.forward, ex2.limits)
    req = sched.add_request([5, 6, 7], max_new_tokens=8, stop_token_ids=[stop], ignore_eos=True)
    sched.run()
    assert req.finish_reason == "stop"
    assert req.output_ids == full[: full.index(stop)]


def test_seeded_generation_is_reproducible_across_batches(make_executor: MakeExecutor) -> None:
    p = SamplingParams(temperature=1.0, top_k=50, seed=7)
    alone = _alone(make_executor, [11, 12, 13], max_new_tokens=10, sampling=p)
    ex2 = make_executor(seed=123)
    sched = ReferenceScheduler(ex2.forward, ex2.limits)
    other = sched.add_request(
        [1, 2, 3, 4, 5],
        max_new_tokens=10,
        sampling=SamplingParams(temperature=1.0),
        ignore_eos=True,
    )
    mine = sched.add_request([11, 12, 13], max_new_tokens=10, sampling=p, ignore_eos=True)
    sched.run()
    assert mine.output_ids == alone
    assert len(other.output_ids) == 10


def test_released_rows_hold_nothing_and_a_stale_prefix_is_refused(
    make_executor: MakeExecutor,
) -> None:
    ex = make_executor()
    _prefill_logits(ex, [3, 4, 5, 6, 7], row=1, first_slot=1)
    _prefill_logits(ex, [8, 9], row=2, first_slot=10)
    pool = ex.req_to_token_pool
    assert (pool.rows_in_use(), pool.slots_in_use()) == (2, 7)
    idle = dataclasses.replace(make_idle_batch(), released_req_pool_indices=torch.tensor([1]))
    ex.forward(idle)
    assert (pool.rows_in_use(), pool.slots_in_use()) == (1, 2)
    stale = make_extend_batch(
        input_ids=[[1]], req_pool_indices=[1], out_cache_loc=[[20]], prefix_lens=[5]
    )
    with pytest.raises(BatchValidationError, match="row 1 holds 0 tokens"):
        ex.forward(stale)


def test_a_row_released_and_reused_in_one_batch_starts_fresh(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    _prefill_logits(ex, [3, 4, 5, 6, 7], row=1, first_slot=1)
    fresh = make_extend_batch(
        input_ids=[[40, 41, 42]], req_pool_indices=[1], out_cache_loc=[[30, 31, 32]]
    )
    reused = ex.forward(
        dataclasses.replace(fresh, released_req_pool_indices=torch.tensor([1])), return_logits=True
    )
    assert ex.req_to_token_pool.resident_lens[1] == 3
    alone = _prefill_logits(make_executor(), [40, 41, 42], row=1, first_slot=30)
    torch.testing.assert_close(reused.logits[0], alone, atol=1e-5, rtol=0)
    # A prefix the released row no longer holds is refused even though it held 5 before.
    both = make_extend_batch(
        input_ids=[[1]], req_pool_indices=[1], out_cache_loc=[[33]], prefix_lens=[4]
    )
    with pytest.raises(BatchValidationError, match="extend_prefix_lens"):
        ex.forward(dataclasses.replace(both, released_req_pool_indices=torch.tensor([1])))
    assert ex.req_to_token_pool.resident_lens[1] == 3  # the refused release changed nothing


def test_a_failed_step_undoes_its_releases(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = make_executor()
    _prefill_logits(ex, [3, 4, 5], row=1, first_slot=1)
    _prefill_logits(ex, [6, 7], row=2, first_slot=10)
    before = ex.req_to_token_pool.resident_lens.copy()

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device fell over")

    monkeypatch.setattr(ex.step.sampler, "draw", boom)
    step = make_decode_batch(input_ids=[9], req_pool_indices=[2], seq_lens=[3], out_cache_loc=[12])
    with pytest.raises(RuntimeError, match="device fell over"):
        ex.forward(dataclasses.replace(step, released_req_pool_indices=torch.tensor([1])))
    assert (ex.req_to_token_pool.resident_lens == before).all()


def test_the_reference_scheduler_releases_every_row_it_used(make_executor: MakeExecutor) -> None:
    ex = make_executor(max_tokens_per_batch=16)
    sched = ReferenceScheduler(ex.forward, ex.limits)
    for p in [*PROMPTS, list(range(1, 40))]:
        sched.add_request(p, max_new_tokens=6, ignore_eos=True)
    sched.run()
    assert ex.req_to_token_pool.rows_in_use() == 0 and ex.req_to_token_pool.slots_in_use() == 0
    assert sched.released_rows == []


def test_a_slot_owner_refusal_comes_before_anything_is_uploaded(
    make_executor: MakeExecutor,
) -> None:
    ex = make_executor(detailed_refusals=True)
    ex.forward(
        make_extend_batch(input_ids=[[1, 2, 3]], req_pool_indices=[1], out_cache_loc=[[1, 2, 3]])
    )
    copies, transfers = ex.step.staging.copies, host_transfers.totals()
    lens = ex.req_to_token_pool.resident_lens.copy()
    stolen = make_extend_batch(input_ids=[[4]], req_pool_indices=[2], out_cache_loc=[[2]])
    with pytest.raises(BatchValidationError, match="slot 2 holds the KV of row 1"):
        ex.forward(stolen)  # row 1 still reads slot 2
    assert ex.step.staging.copies == copies and host_transfers.totals() == transfers
    assert (ex.req_to_token_pool.resident_lens == lens).all()
