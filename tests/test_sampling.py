"""Sampling: seeded draws, truncations that never emit an excluded token, logprobs."""

from __future__ import annotations

import torch

from executor.core.forward_batch import SamplingBatch, SamplingParams
from executor.core.outputs import ForwardOutput, StepStats
from executor.sampling import SampledDraw, Sampler
from ops.host_transfer import to_host_async
from ops.sampling import SamplingPlan, sample_tokens, seeded_uniform

MASK64 = (1 << 64) - 1


def splitmix_reference(seed: int, position: int) -> float:
    """Pure-Python splitmix64 with unsigned arithmetic: what seeded_uniform must compute."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z = z ^ (z >> 31)
    return (z >> 40) / float(1 << 24)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def test_seeded_uniform_matches_unsigned_reference() -> None:
    seeds = [0, 1, 42, 2**63 - 1, 2**63, 2**64 - 1, 123456789123456789]
    positions = [0, 1, 5, 1000, 8191, 3, 77]
    got = seeded_uniform(torch.tensor([_signed(s) for s in seeds]), torch.tensor(positions))
    expected = torch.tensor(
        [splitmix_reference(s, p) for s, p in zip(seeds, positions, strict=True)]
    )
    assert torch.equal(got, expected)
    assert bool(((got >= 0) & (got < 1)).all())


def _run(
    sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], seq_lens: list[int]
) -> list[int]:
    batch = SamplingBatch.from_params(params, len(params))
    draw = sampler.draw(
        logits,
        Sampler.plan(batch),
        batch,
        torch.tensor(seq_lens),
        return_logprob=False,
        top_logprobs_num=0,
    )
    return _output(draw).next_token_ids.tolist()


def _output(draw: SampledDraw) -> ForwardOutput:
    """The answer a step builds from the draw's host copy."""
    return draw.output(to_host_async(draw.device, "sampled_tokens").wait(), StepStats())


def test_seeded_draws_are_reproducible_and_independent_of_batch_composition() -> None:
    g = torch.Generator().manual_seed(1)
    vocab = 1000
    target = torch.randn(vocab, generator=g)
    others = torch.randn(6, vocab, generator=g)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = [_run(Sampler(torch.device("cpu"), seed=s), target[None], [p], [17])[0] for s in (0, 1)]
    assert alone[0] == alone[1]  # the executor's own seed plays no part
    for pos in (0, 3, 5):
        logits = torch.cat([others[:pos], target[None], others[pos:]])
        params = (
            [SamplingParams(temperature=0.7, seed=None)] * pos
            + [p]
            + [SamplingParams(temperature=1.3)] * (6 - pos)
        )
        seq = [5] * pos + [17] + [9] * (6 - pos)
        assert _run(Sampler(torch.device("cpu"), seed=99), logits, params, seq)[pos] == alone[0]


def test_seeded_draws_depend_on_seed_and_position() -> None:
    logits = torch.zeros(1, 5000)  # uniform: every draw is one of 5000 tokens
    sampler = Sampler(torch.device("cpu"), seed=0)
    by_seed = {
        _run(sampler, logits, [SamplingParams(temperature=1.0, seed=s)], [10])[0] for s in range(20)
    }
    by_pos = {
        _run(sampler, logits, [SamplingParams(temperature=1.0, seed=7)], [n])[0]
        for n in range(1, 21)
    }
    assert len(by_seed) > 15 and len(by_pos) > 15


def test_seeded_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().expand(3000, 3).contiguous()
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3000)]
    tokens = torch.tensor(_run(Sampler(torch.device("cpu"), 0), logits, params, [1] * 3000))
    freq = torch.bincount(tokens, minlength=3).float() / 3000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_greedy_is_argmax_and_mixes_with_sampled_rows() -> None:
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(),
        SamplingParams(top_k=1, temperature=2.0),
    ]
    got = _run(Sampler(torch.device("cpu"), 0), logits, params, [1, 2, 3, 4])
    argmax = logits.argmax(-1).tolist()
    assert got[0] == argmax[0] and got[2] == argmax[2] and got[3] == argmax[3]


def _draws(logits: torch.Tensor, p: SamplingParams, n: int = 400) -> set[int]:
    params = [SamplingParams(p.temperature, p.top_p, p.top_k, p.min_p, seed=s) for s in range(n)]
    return set(
        _run(Sampler(torch.device("cpu"), 0), logits.expand(n, -1).contiguous(), params, [1] * n)
    )


def test_top_k_never_emits_a_token_outside_the_k_most_likely() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 2.7, 2.6, 0.0, -1.0, 2.5]])
    drawn = _draws(logits, SamplingParams(temperature=5.0, top_k=3))
    assert drawn == {0, 1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])
    drawn = _draws(probs.log(), SamplingParams(temperature=1.0, top_p=0.7))
    assert drawn == {0, 1}  # 0.4 + 0.3 reaches 0.7; 0.15 lies beyond it
    drawn = _draws(probs.log(), SamplingParams(temperature=1.0, top_p=0.71))
    assert drawn == {0, 1, 2}


def test_min_p_excludes_tokens_below_the_fraction_of_the_top() -> None:
    probs = torch.tensor([[0.5, 0.26, 0.24]])
    drawn = _draws(probs.log(), SamplingParams(temperature=1.0, min_p=0.5))
    assert drawn == {0, 1}  # 0.24 < 0.5 * 0.5


def test_tiny_top_p_still_emits_the_most_likely_token() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert _draws(logits, SamplingParams(temperature=1.0, top_p=1e-6), n=50) == {1}


def test_top_k_combined_with_top_p_and_min_p_on_mixed_rows() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 200, generator=g) * 3
    ks = torch.randint(1, 20, (64,), generator=g)
    params = [
        SamplingParams(temperature=1.5, top_k=int(k), top_p=0.8, min_p=0.05, seed=i)
        for i, k in enumerate(ks)
    ]
    tokens = torch.tensor(_run(Sampler(torch.device("cpu"), 0), logits, params, [1] * 64))
    probs = torch.softmax(logits / 1.5, -1)
    for i in range(64):
        rank = int((probs[i] > probs[i, tokens[i]]).sum())
        assert rank < int(ks[i])
        assert probs[i, tokens[i]] >= 0.05 * probs[i].max()


def test_plan_is_decided_from_host_values() -> None:
    plan = SamplingPlan.from_host(
        torch.tensor([0.0, 1.0]),
        torch.tensor([5, 0]),
        torch.tensor([0.5, 1.0]),
        torch.tensor([0.0, 0.0]),
    )
    # The greedy row's top_k / top_p do not count: only sampled rows matter.
    assert not plan.all_greedy and not plan.any_top_k and not plan.any_top_p and not plan.any_min_p
    tokens = sample_tokens(
        torch.randn(2, 10),
        torch.tensor([0.0, 1.0]),
        torch.tensor([5, 0]),
        torch.tensor([0.5, 1.0]),
        torch.tensor([0.0, 0.0]),
        torch.tensor([0.3, 0.3]),
        plan,
    )
    assert tokens.shape == (2,)


def test_logprobs_are_the_model_log_softmax() -> None:
    logits = torch.randn(3, 20)
    batch = SamplingBatch.greedy(3)
    draw = Sampler(torch.device("cpu"), 0).draw(
        logits,
        Sampler.plan(batch),
        batch,
        torch.tensor([1, 1, 1]),
        return_logprob=True,
        top_logprobs_num=4,
    )
    out = _output(draw)
    ref = torch.log_softmax(logits, -1)
    assert out.next_token_ids.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(out.next_token_logprobs, ref.max(-1).values)
    top_vals, top_ids = ref.topk(4, -1)
    assert torch.equal(out.top_logprob_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_vals)
