"""Counted device-to-host transfers, and the guard that fails on any uncounted host read."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import executor.step.step as step_module
from attention import TorchNativeBackend
from executor.batch_prep import make_decode_batch, make_extend_batch
from executor.core.forward_batch import ForwardBatch, SamplingParams
from executor.graphs.capture_rules import ForbiddenValue, HostReadError, HostReadGuard
from executor.model_executor import ModelExecutor
from ops.host_reads import host_mirror_read
from ops.host_transfer import host_transfers, to_host

MakeExecutor = Callable[..., ModelExecutor]

# --- the guard on its own --------------------------------------------------------------------

READS: dict[str, Callable[[torch.Tensor], object]] = {
    "Tensor.item()": lambda t: t[0].item(),
    "Tensor.tolist()": lambda t: t.tolist(),
    "Tensor.numpy()": lambda t: t.numpy(),
    "Tensor.cpu()": lambda t: t.cpu(),
    "bool(tensor)": lambda t: bool(t[0]),
    "int(tensor)": lambda t: int(t[0]),
    "float(tensor)": lambda t: float(t[0]),
    "operator.index(tensor)": lambda t: [0, 1, 2, 3][t[0]],
    "format(tensor)": lambda t: f"{t[0]}",
    "numpy.asarray(tensor)": lambda t: np.asarray(t),
    "`x in tensor`": lambda t: 3 in t,
    "if tensor": lambda t: "yes" if (t > 2).any() else "no",
    "aten.nonzero": lambda t: torch.nonzero(t),
    "aten.index with a boolean mask": lambda t: t[t > 1],
    "aten.repeat_interleave without output_size": lambda t: torch.repeat_interleave(t, t),
    "aten.unique": lambda t: torch.unique(t),
}


@pytest.mark.parametrize("name", list(READS))
def test_guard_catches_every_kind_of_host_read(name: str) -> None:
    t = torch.tensor([1, 2, 3])
    READS[name](t)  # fine outside the guard
    with HostReadGuard() as guard, pytest.raises(HostReadError, match="uncounted host read"):
        READS[name](t)
    assert len(guard.violations) == 1


def test_guard_names_the_op_in_its_message() -> None:
    with HostReadGuard(), pytest.raises(HostReadError) as err:
        torch.tensor([5]).item()
    assert "Tensor.item() on a cpu tensor of shape [1]" in str(err.value)
    assert "ops.host_transfer.to_host(tensor, reason)" in str(err.value)


def test_guard_allows_to_host_and_what_is_computed_from_its_result() -> None:
    device_values = torch.tensor([4, 5, 6])
    with HostReadGuard():
        host = to_host(device_values, "test")
        assert host.tolist() == [4, 5, 6]
        assert int(host[1]) == 5 and bool((host > 5).any())
        assert host[host > 4].tolist() == [5, 6]
        # The result is a copy: the device tensor itself is still off limits.
        assert host.data_ptr() != device_values.data_ptr()
        with pytest.raises(HostReadError):
            device_values.tolist()
        # Mixing host data with device data gives device data.
        with pytest.raises(HostReadError):
            (host + device_values).tolist()


def test_guard_allows_declared_host_mirror_reads_of_host_tensors_only() -> None:
    mirror = torch.tensor([7, 8])
    with HostReadGuard():
        with host_mirror_read("seq_lens_cpu"):
            assert mirror.tolist() == [7, 8]
        with pytest.raises(HostReadError):
            mirror.tolist()  # the declaration does not outlive its block


@pytest.mark.gpu
def test_a_host_mirror_declaration_never_covers_a_device_tensor() -> None:
    on_device = torch.tensor([1, 2], device="cuda")
    with HostReadGuard(), host_mirror_read("seq_lens_cpu"), pytest.raises(HostReadError):
        on_device.tolist()
    with HostReadGuard(), pytest.raises(HostReadError, match=r"to\(cpu\)|aten"):
        on_device.to("cpu")


def test_forbidden_value_fails_on_any_use_but_keeps_identity() -> None:
    value = ForbiddenValue("seq_lens_cpu")
    assert value is not None and "seq_lens_cpu" in repr(value)
    for use in (
        lambda: bool(value),
        lambda: value.tolist(),  # type: ignore[attr-defined]
        lambda: int(value),  # type: ignore[call-overload]
        lambda: value[0],  # type: ignore[index]
        lambda: value + 1,  # type: ignore[operator]
        lambda: torch.as_tensor(value),
        lambda: list(value),  # type: ignore[call-overload]
    ):
        with pytest.raises(HostReadError, match="seq_lens_cpu was read"):
            use()


# --- a whole executor step under the guard ---------------------------------------------------


@pytest.fixture
def counts() -> Iterator[Callable[[], dict[str, int]]]:
    """Transfers counted since the test started, by reason (the counters are process-wide)."""
    before = dict(host_transfers.syncs)

    def delta() -> dict[str, int]:
        now = dict(host_transfers.syncs)
        return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}

    yield delta


@pytest.fixture
def poison_host_mirrors(monkeypatch: pytest.MonkeyPatch) -> list[ForwardBatch]:
    """Batches carry ForbiddenValue in seq_lens_cpu / seq_lens_sum: any read fails the step.

    It first checks that complete_batch left them None, as it must when the mirror is off.
    """
    completed: list[ForwardBatch] = []
    real = step_module.complete_batch

    def complete(fb: ForwardBatch, **kwargs: object) -> ForwardBatch:
        out = real(fb, **kwargs)  # type: ignore[arg-type]
        assert out.seq_lens_cpu is None and out.seq_lens_sum is None
        out.seq_lens_cpu = ForbiddenValue("seq_lens_cpu")  # type: ignore[assignment]
        out.seq_lens_sum = ForbiddenValue("seq_lens_sum")  # type: ignore[assignment]
        completed.append(out)
        return out

    monkeypatch.setattr(step_module, "complete_batch", complete)
    return completed


def _prefill(**kwargs: object) -> ForwardBatch:
    return make_extend_batch(
        input_ids=[[1, 2, 3], [4, 5]],
        req_pool_indices=[1, 2],
        out_cache_loc=[[1, 2, 3], [4, 5]],
        **kwargs,  # type: ignore[arg-type]
    )


def _decode(**kwargs: object) -> ForwardBatch:
    return make_decode_batch(
        input_ids=[6, 7],
        req_pool_indices=[1, 2],
        seq_lens=[4, 3],
        out_cache_loc=[6, 7],
        **kwargs,  # type: ignore[arg-type]
    )


SAMPLED = [
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3),
    SamplingParams(temperature=1.0),
]


def test_a_step_without_the_mirror_makes_only_the_counted_transfers(
    make_executor: MakeExecutor,
    counts: Callable[[], dict[str, int]],
    poison_host_mirrors: list[ForwardBatch],
) -> None:
    ex = make_executor(attention_backend="torch_paged")
    assert ex.toggles.needs_cpu_seq_lens is False
    ex.hooks.device_step_guard = HostReadGuard
    ex.forward(_prefill())
    assert counts() == {"sampled_tokens": 1}
    ex.forward(_decode(sampling=SAMPLED))
    assert counts() == {"sampled_tokens": 2}
    ex.forward(_decode(sampling=SAMPLED, return_logprob=True, top_logprobs_num=3))
    assert counts() == {"sampled_tokens": 3}  # logprobs ride in the tokens' one transfer
    assert len(poison_host_mirrors) == 3  # every step really carried the poisoned fields


def test_torch_native_adds_exactly_what_it_declares(
    make_executor: MakeExecutor, counts: Callable[[], dict[str, int]]
) -> None:
    ex = make_executor(attention_backend="torch_native")
    assert ex.toggles.needs_cpu_seq_lens is True
    ex.hooks.device_step_guard = HostReadGuard
    ex.forward(_prefill(sampling=SAMPLED, return_logprob=True))
    expected = {"sampled_tokens": 1}  # logprobs included: one packed transfer
    for reason in TorchNativeBackend.host_transfer_reasons:
        expected[reason] = expected.get(reason, 0) + 1
    assert counts() == expected


def test_the_guard_catches_a_stray_item_inside_the_model(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = make_executor()
    ex.hooks.device_step_guard = HostReadGuard
    ex.forward(_prefill())  # a clean step passes
    table_before = ex.req_to_token_pool.req_to_token.clone()
    real = ex.model.compute_logits

    def with_a_sync(hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if hidden.abs().max().item() > 1e9:  # the kind of check that slips in
            raise AssertionError("unreachable")
        return real(hidden, fb)

    monkeypatch.setattr(ex.model, "compute_logits", with_a_sync)
    with pytest.raises(HostReadError, match=r"uncounted host read: Tensor\.item\(\) on a cpu"):
        ex.forward(_decode())
    # The failed step was undone like any other failure.
    assert torch.equal(ex.req_to_token_pool.req_to_token, table_before)


def test_return_logits_is_a_counted_transfer(
    make_executor: MakeExecutor, counts: Callable[[], dict[str, int]]
) -> None:
    ex = make_executor()
    ex.hooks.device_step_guard = HostReadGuard
    out = ex.forward(_prefill(), return_logits=True)
    assert out.logits is not None and out.logits.shape[0] == 2
    assert counts() == {"sampled_tokens": 1, "logits": 1}
