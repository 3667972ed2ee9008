"""Sampling controls: penalties, logit bias, min tokens, banned/allowed ids and vocab masks,
kept per row, against direct formulas (and transformers' repetition penalty), on every path."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from executor.batch_prep import make_decode_batch, make_extend_batch, make_idle_batch
from executor.client.grpc_client import ExecutorClient
from executor.core.controls_types import (
    DeferredMask,
    DeferredMaskTimeout,
    RowControl,
    SamplingControls,
    VocabMask,
)
from executor.core.errors import BatchValidationError
from executor.core.forward_batch import ForwardBatch, SamplingParams
from executor.model_executor import ModelExecutor
from model_executor.v1 import executor_pb2 as pb
from ops.logit_controls import pack_bitmask, unpack_bitmask
from tests.server_util import Scrape, running_server, tiny_config

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
    state = ex.controls.state

    def snapshot() -> list[np.ndarray]:
        return (
            [t.clone().numpy() for t in state.device.values()]
            + [a.copy() for a in state.host.values()]
            + [state.active.copy(), np.array(state.any_active)]
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

    monkeypatch.setattr(ex.step.sampler, "draw", boom)
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


@pytest.mark.slow
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
    from executor.core.forward_batch import SamplingBatch

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


def overlap_batches(controls: dict[int, SamplingControls], steps: int) -> list[ForwardBatch]:
    """Rows 1 and 2 prefill with `controls`, then decode `steps` times feeding each step's
    tokens back by future-token reference (no host round trip of the ids)."""
    prompts = {1: PROMPT, 2: PROMPT[:4]}
    slot = 1
    locs = []
    for p in prompts.values():
        locs.append(list(range(slot, slot + len(p))))
        slot += len(p)
    fb = make_extend_batch(
        input_ids=list(prompts.values()), req_pool_indices=[1, 2], out_cache_loc=locs
    )
    batches = [
        dataclasses.replace(
            fb,
            row_controls=tuple(RowControl(r, c) for r, c in controls.items()),
            future_token_slots=torch.tensor([1, 2]),
        )
    ]
    lens = [len(p) for p in prompts.values()]
    for k in range(steps):
        lens = [n + 1 for n in lens]
        reads = [2 * k + 1, 2 * k + 2]
        fb = make_decode_batch(
            input_ids=[-r for r in reads],
            req_pool_indices=[1, 2],
            seq_lens=lens,
            out_cache_loc=[slot, slot + 1],
        )
        slot += 2
        released = torch.tensor([2 * k - 1, 2 * k]) if k else None
        batches.append(
            dataclasses.replace(
                fb,
                future_token_slots=torch.tensor([2 * k + 3, 2 * k + 4]),
                released_future_slots=released,
            )
        )
    return batches


def test_history_includes_tokens_fed_back_by_future_reference(
    make_executor: MakeExecutor,
) -> None:
    """The penalties see the resolved id of a `-k` input: the overlap run's tokens equal
    those of a run that sends every id."""
    c = {1: SamplingControls(frequency_penalty=2.0, repetition_penalty=1.5)}
    ex = make_executor()
    overlap = [ex.forward(b).next_token_ids.tolist() for b in overlap_batches(c, 5)]
    d = Driver(make_executor())
    _, _, t = d.prefill({1: PROMPT, 2: PROMPT[:4]}, c)
    plain = [t]
    for _ in range(5):
        _, _, t = d.decode([1, 2], t)
        plain.append(t)
    assert overlap == plain
    assert len(set(d.history[1][len(PROMPT) :])) > 1  # the penalty changed the greedy path


def test_a_deferred_mask_is_awaited_at_sampling_and_a_late_one_undoes_the_step(
    make_executor: MakeExecutor,
) -> None:
    ex = make_executor(deferred_mask_timeout_s=0.3)
    vocab = ex.limits.vocab_size
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, 77] = allowed[1, [5, 6]] = True
    mask = VocabMask(words=pack_bitmask(allowed))
    inline = Driver(make_executor())
    _, inline_logits, inline_tokens = inline.prefill({1: PROMPT, 2: PROMPT}, {}, vocab_mask=mask)

    d = Driver(ex)
    late = DeferredMask(batch_id=7)
    timer = threading.Timer(0.05, late.fulfill, args=(mask,))
    timer.start()
    _, logits, tokens = d.prefill({1: PROMPT, 2: PROMPT}, {}, deferred_mask=late)
    timer.join()
    assert tokens == inline_tokens and torch.equal(logits, inline_logits)
    assert d.last.stats.control_rows == {"vocab_mask": 2}

    # Never sent: the step fails after the forward and leaves the row table as it was.
    rows_before = ex.req_to_token_pool.resident_lens.copy()
    with pytest.raises(DeferredMaskTimeout, match="batch_id 8"):
        d.decode([1, 2], tokens, deferred_mask=DeferredMask(batch_id=8))
    assert (ex.req_to_token_pool.resident_lens == rows_before).all()


# --- over gRPC -------------------------------------------------------------------------------


@pytest.mark.slow
def test_controls_over_grpc_getinfo_caps_retries_and_metrics(tmp_path: Path) -> None:
    with (
        running_server(tiny_config(tmp_path)) as srv,
        ExecutorClient(f"127.0.0.1:{srv.port}") as client,
    ):
        info = client.stub.GetInfo(pb.GetInfoRequest())
        assert set(info.sampling_controls) >= {"repetition_penalty", "logit_bias", "vocab_mask"}
        assert info.vocab_mask_words == (info.vocab_size + 31) // 32
        assert (info.max_logit_bias, info.max_control_token_ids) == (300, 4096)
        assert info.deferred_mask_timeout_ms == 5000

        state = srv.worker.executor.controls.state
        fb = make_extend_batch(
            input_ids=[PROMPT],
            req_pool_indices=[3],
            out_cache_loc=[list(range(1, 1 + len(PROMPT)))],
        )
        fb = dataclasses.replace(
            fb,
            row_controls=(
                RowControl(3, SamplingControls(allowed_token_ids=(42,), frequency_penalty=0.5)),
            ),
        )
        first = client.forward(fb, batch_id=11)
        assert first.next_token_ids.tolist() == [42]
        assert first.stats.control_rows == {"penalties": 1, "token_ids": 1}
        after = [a.copy() for a in state.host.values()]
        again = client.forward(fb, batch_id=11)  # answered from the retry memory
        assert again.next_token_ids.tolist() == [42]
        for a, b in zip(after, state.host.values(), strict=True):
            np.testing.assert_array_equal(a, b)
        # The controls stay with the row: the next DECODE is still restricted.
        step = make_decode_batch(
            input_ids=[42], req_pool_indices=[3], seq_lens=[len(PROMPT) + 1], out_cache_loc=[100]
        )
        assert client.forward(step).next_token_ids.tolist() == [42]
        scrape = Scrape(srv)
        assert scrape.get("model_executor_sampling_control_rows_total", control="token_ids") == 2
        assert scrape.get("model_executor_batches_replayed_total") == 1

        # Oversized lists are refused from the header, naming the field and the cap.
        big = dataclasses.replace(
            step,
            row_controls=(
                RowControl(3, SamplingControls(logit_bias=tuple((i, 1.0) for i in range(301)))),
            ),
        )
        with pytest.raises(grpc.RpcError) as err:
            client.forward(big)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "logit_bias" in err.value.details() and "max_logit_bias (300)" in err.value.details()
        bad = dataclasses.replace(step, row_controls=(RowControl(5, SamplingControls()),))
        with pytest.raises(grpc.RpcError) as err:
            client.forward(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "row_controls[0].req_pool_index" in err.value.details()


def test_an_idle_release_clears_a_rows_controls(make_executor: MakeExecutor) -> None:
    ex = make_executor()
    d = Driver(ex)
    d.prefill({4: PROMPT}, {4: CONTROLS["all_penalties"]})
    state = ex.controls.state
    assert state.active[4] and state.any_active
    ex.forward(dataclasses.replace(make_idle_batch(), released_req_pool_indices=torch.tensor([4])))
    assert not state.active[4]
    assert not state.any_active  # no row left with a control: admission's one look says so
    assert float(state.device["repetition"][4]) == 1.0
