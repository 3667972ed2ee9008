"""Sampling controls: penalties, logit bias, min tokens, banned/allowed ids and vocab masks,
kept per row, against direct formulas (and transformers' repetition penalty), on every path."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.controls.types import RowControl, SamplingControls, VocabMask
from executor.errors import BatchValidationError
from executor.forward_batch import ForwardBatch, SamplingParams
from executor.model_executor import ModelExecutor
from ops.logit_controls import pack_bitmask, unpack_bitmask

MakeExecutor = Callable[..., ModelExecutor]
PROMPT = [5, 17, 33, 2, 400, 12, 17, 17, 33]


# --- reference formulas (NumPy), the proto's order -------------------------------------------


def reference(
    logits: np.ndarray,
    history: list[int],
    prompt_len: int,
    c: SamplingControls,
    seq_len: int,
    eos: tuple[int, ...],
) -> np.ndarray:
    out = logits.astype(np.float32).copy()
    if c.repetition_penalty != 1.0:
        seen = np.unique(history)
        v = out[seen]
        out[seen] = np.where(
            v > 0, v / np.float32(c.repetition_penalty), v * np.float32(c.repetition_penalty)
        )
    counts = np.bincount(
        np.asarray(history[prompt_len:], dtype=np.int64), minlength=len(out)
    ).astype(np.float32)
    out = (
        out
        - np.float32(c.frequency_penalty) * counts
        - np.float32(c.presence_penalty) * (counts > 0).astype(np.float32)
    )
    for token, bias in c.logit_bias:
        out[token] += np.float32(bias)
    if c.min_tokens and seq_len - prompt_len < c.min_tokens:
        out[list(eos) + list(c.stop_token_ids)] = -np.inf
    out[list(c.banned_token_ids)] = -np.inf
    if c.allowed_token_ids:
        keep = np.full(len(out), -np.inf, dtype=np.float32)
        keep[list(c.allowed_token_ids)] = 0
        out = out + keep
    return out


class Driver:
    """One request per row, driven step by step (greedy), recording its tokens."""

    def __init__(self, ex: ModelExecutor) -> None:
        self.ex = ex
        self.next_slot = 1
        self.history: dict[int, list[int]] = {}
        self.slots: dict[int, list[int]] = {}

    def _slots(self, n: int) -> list[int]:
        out = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return out

    def prefill(
        self, prompts: dict[int, list[int]], controls: dict[int, SamplingControls], **kw: object
    ) -> tuple[ForwardBatch, torch.Tensor, list[int]]:
        rows = list(prompts)
        locs = [self._slots(len(p)) for p in prompts.values()]
        fb = make_extend_batch(
            input_ids=list(prompts.values()), req_pool_indices=rows, out_cache_loc=locs
        )
        fb = dataclasses.replace(
            fb, row_controls=tuple(RowControl(r, c) for r, c in controls.items()), **kw
        )
        for r, p, loc in zip(rows, prompts.values(), locs, strict=True):
            self.history[r], self.slots[r] = list(p), loc
        return self._run(fb, rows)

    def decode(
        self, rows: list[int], tokens: list[int], **kw: object
    ) -> tuple[ForwardBatch, torch.Tensor, list[int]]:
        locs = self._slots(len(rows))
        for r, t, s in zip(rows, tokens, locs, strict=True):
            self.history[r].append(t)
            self.slots[r].append(s)
        fb = make_decode_batch(
            input_ids=tokens,
            req_pool_indices=rows,
            seq_lens=[len(self.history[r]) for r in rows],
            out_cache_loc=locs,
        )
        return self._run(dataclasses.replace(fb, **kw), rows)

    def _run(
        self, fb: ForwardBatch, rows: list[int]
    ) -> tuple[ForwardBatch, torch.Tensor, list[int]]:
        out = self.ex.forward(fb, return_logits=True)
        assert out.logits is not None
        self.last = out
        return fb, out.logits, out.next_token_ids.tolist()


CONTROLS = {
    "repetition": SamplingControls(repetition_penalty=1.7),
    "freq_pres": SamplingControls(frequency_penalty=0.9, presence_penalty=-0.4),
    "all_penalties": SamplingControls(
        repetition_penalty=0.8, frequency_penalty=1.5, presence_penalty=0.6
    ),
    "bias": SamplingControls(logit_bias=((3, 5.0), (17, -30.0), (250, 2.5))),
    "banned": SamplingControls(banned_token_ids=(1, 2, 3)),
    "allowed": SamplingControls(allowed_token_ids=(40, 41, 99, 17)),
    "min_tokens": SamplingControls(min_tokens=3, stop_token_ids=(7, 8)),
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_each_control_matches_the_reference_in_a_mixed_batch(
    make_executor: MakeExecutor, name: str
) -> None:
    """Row 1 runs without controls, row 2 with the same prompt and the control: row 2's
    logits are the reference applied to row 1's, over prefill and three decode steps (so
    output tokens count), and row 1 is what it is alone."""
    c = CONTROLS[name]
    ex, alone = make_executor(), Driver(make_executor())
    d = Driver(ex)
    eos = ex.info.eos_token_ids
    _, logits, tokens = d.prefill({1: PROMPT, 2: PROMPT}, {2: c})
    assert sum(d.last.stats.control_rows.values()) == 1  # row 2 only
    # No sync and no upload of its own: the tokens' (and the logits' asked for) transfers,
    # and the step's one staged upload.
    assert (d.last.stats.d2h_syncs, d.last.stats.h2d_copies, d.last.stats.h2d_syncs) == (2, 1, 0)
    _, alone_logits, _ = alone.prefill({1: PROMPT}, {})
    for step in range(4):
        torch.testing.assert_close(logits[0], alone_logits[0], rtol=1e-5, atol=1e-5)
        ref = reference(logits[0].numpy(), d.history[2], len(PROMPT), c, len(d.history[2]), eos)
        np.testing.assert_allclose(logits[1].numpy(), ref, rtol=1e-6, atol=1e-5)
        assert tokens[1] == int(np.argmax(ref))
        if step == 3:
            break
        # Both rows continue with row 2's token, so their histories (and logits) stay equal.
        t = tokens[1]
        _, logits, tokens = d.decode([1, 2], [t, t])
        _, alone_logits, _ = alone.decode([1], [t])


def test_repetition_penalty_equals_transformers_processor(make_executor: MakeExecutor) -> None:
    c = SamplingControls(repetition_penalty=1.3)
    d, plain = Driver(make_executor()), Driver(make_executor())
    _, logits, _ = d.prefill({3: PROMPT}, {3: c})
    _, raw, _ = plain.prefill({3: PROMPT}, {})
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([PROMPT]), raw.clone())
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_penalties_count_a_cached_prefix(make_executor: MakeExecutor) -> None:
    """A request whose prompt starts with another request's cached slots counts them."""
    ex = make_executor()
    d = Driver(ex)
    d.prefill({1: PROMPT}, {})
    c = SamplingControls(repetition_penalty=2.0, frequency_penalty=1.0)
    tail = [44, 45]
    fb = make_extend_batch(
        input_ids=[tail],
        req_pool_indices=[2],
        out_cache_loc=[[500, 501]],
        prefix_lens=[len(PROMPT)],
        prefix_cache_loc=[d.slots[1]],
    )
    fb = dataclasses.replace(fb, row_controls=(RowControl(2, c),))
    out = ex.forward(fb, return_logits=True)
    plain = Driver(make_executor())
    _, raw, _ = plain.prefill({1: PROMPT + tail}, {})
    ref = reference(raw[0].numpy(), PROMPT + tail, len(PROMPT + tail), c, len(PROMPT) + 2, ())
    assert out.logits is not None
    np.testing.assert_allclose(out.logits[0].numpy(), ref, rtol=1e-6, atol=1e-5)


def test_neutral_controls_are_bit_identical(make_executor: MakeExecutor) -> None:
    neutral = SamplingControls(repetition_penalty=1.0, logit_bias=((5, 0.0),))
    a, b = Driver(make_executor()), Driver(make_executor())
    _, la, ta = a.prefill({1: PROMPT, 2: PROMPT[:4]}, {1: neutral})
    _, lb, tb = b.prefill({1: PROMPT, 2: PROMPT[:4]}, {})
    assert torch.equal(la, lb) and ta == tb
    for _ in range(2):
        _, la, ta = a.decode([1, 2], ta)
        _, lb, tb = b.decode([1, 2], tb)
        assert torch.equal(la, lb) and ta == tb


def test_min_tokens_suppresses_eos_until_reached(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    eos = ex.info.eos_token_ids[0]
    c = SamplingControls(min_tokens=3, logit_bias=((eos, 100.0),))
    d = Driver(ex)
    _, _, tokens = d.prefill({1: PROMPT}, {1: c})
    produced = [tokens[0]]
    for _ in range(3):
        _, _, tokens = d.decode([1], [produced[-1]])
        produced.append(tokens[0])
    assert eos not in produced[:3] and produced[3] == eos


def test_controls_last_until_released_and_a_reused_row_starts_neutral(
    make_executor: MakeExecutor,
) -> None:
    ex = make_executor()
    d = Driver(ex)
    allowed = SamplingControls(allowed_token_ids=(42,))
    _, _, t = d.prefill({1: PROMPT}, {1: allowed})
    assert t == [42]
    _, _, t = d.decode([1], t)
    assert t == [42]  # kept without being re-sent
    released = torch.tensor([1])
    _, logits, t = d.prefill({1: PROMPT}, {}, released_req_pool_indices=released)
    _, raw, _ = Driver(make_executor()).prefill({1: PROMPT}, {})
    assert torch.equal(logits, raw)


def test_a_refused_or_failed_batch_leaves_the_row_state(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = make_executor()
    d = Driver(ex)
    d.prefill({1: PROMPT}, {1: CONTROLS["bias"]})
    state = ex.step.controls.state

    def snapshot() -> list[np.ndarray]:
        return (
            [t.clone().numpy() for t in state.device.values()]
            + [a.copy() for a in state.host.values()]
            + [state.active.copy()]
        )

    before = snapshot()
    new = (RowControl(1, SamplingControls(repetition_penalty=3.0)),)
    bad = make_decode_batch(
        input_ids=[5],
        req_pool_indices=[1],
        seq_lens=[len(PROMPT) + 1],
        out_cache_loc=[d.slots[1][0]],
    )  # a slot the row holds: refused
    with pytest.raises(BatchValidationError):
        ex.forward(dataclasses.replace(bad, row_controls=new))
    bad_value = dataclasses.replace(
        bad,
        out_cache_loc=torch.tensor([900]),
        row_controls=(RowControl(1, SamplingControls(presence_penalty=3.0)),),
    )
    with pytest.raises(BatchValidationError, match="presence_penalty"):
        ex.forward(bad_value)

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device fell over")

    monkeypatch.setattr(ex.step.sampler, "sample", boom)
    ok = dataclasses.replace(
        bad, out_cache_loc=torch.tensor([900]), row_controls=new, released_req_pool_indices=None
    )
    with pytest.raises(RuntimeError):
        ex.forward(ok)
    for a, b in zip(before, snapshot(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_vocab_mask_rows_and_empty_mask_refusal(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    vocab = ex.limits.vocab_size
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, [11, 12]] = True
    words = pack_bitmask(allowed)
    assert torch.equal(unpack_bitmask(words, vocab), allowed)
    d = Driver(ex)
    mask = VocabMask(words=words, rows=torch.tensor([1]))
    _, logits, tokens = d.prefill({1: PROMPT, 2: PROMPT}, {}, vocab_mask=mask)
    assert tokens[1] in (11, 12) and torch.isinf(logits[1]).sum() == vocab - 2
    assert not torch.isinf(logits[0]).any()
    assert d.last.stats.control_rows == {"vocab_mask": 1}
    empty = VocabMask(words=torch.zeros_like(words), rows=torch.tensor([0]))
    with pytest.raises(BatchValidationError, match="allows no token"):
        d.decode([1, 2], tokens, vocab_mask=empty)
    # The banned ids and the mask together leave nothing: refused too.
    d2 = Driver(make_executor())
    with pytest.raises(BatchValidationError, match="allows no token"):
        d2.prefill(
            {1: PROMPT},
            {1: SamplingControls(banned_token_ids=(11, 12))},
            vocab_mask=VocabMask(words=words),
        )


@pytest.mark.parametrize("graph_mode", ["decode", "extend"])
def test_controls_apply_on_the_graph_paths(make_executor: MakeExecutor, graph_mode: str) -> None:
    c = CONTROLS["all_penalties"]
    eager, graphs = Driver(make_executor()), Driver(make_executor(graph_mode=graph_mode))
    _, le, te = eager.prefill({1: PROMPT, 2: PROMPT[:5]}, {1: c, 2: CONTROLS["bias"]})
    _, lg, tg = graphs.prefill({1: PROMPT, 2: PROMPT[:5]}, {1: c, 2: CONTROLS["bias"]})
    paths = [graphs.last.stats.path]
    for _ in range(3):
        torch.testing.assert_close(lg, le, rtol=1e-5, atol=1e-5)
        assert tg == te
        _, le, te = eager.decode([1, 2], te)
        _, lg, tg = graphs.decode([1, 2], tg)
        paths.append(graphs.last.stats.path)
    assert ("full_graph" if graph_mode == "decode" else "piecewise") in paths


def test_seeded_draws_with_controls_stay_batch_independent(make_executor: MakeExecutor) -> None:
    c = CONTROLS["freq_pres"]
    p = SamplingParams(temperature=1.0, seed=99)
    from executor.forward_batch import SamplingBatch

    alone = Driver(make_executor())
    _, _, t_alone = alone.prefill({4: PROMPT}, {4: c}, sampling=SamplingBatch.from_params([p], 1))
    together = Driver(make_executor())
    _, _, t = together.prefill(
        {1: [9, 9], 4: PROMPT, 6: [1, 2, 3]},
        {4: c},
        sampling=SamplingBatch.from_params(
            [SamplingParams(temperature=0.7), p, SamplingParams()], 3
        ),
    )
    assert t[1] == t_alone[0]
