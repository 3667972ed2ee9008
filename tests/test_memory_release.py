"""Memory released and resumed by tag (`executor.weights.memory`): a release answers once the
memory left the resident set; while released, steps, KV calls and updates are refused and
nothing else changes; a resume brings the memory back, reloads the weights (or waits for an
update) and hands back an empty KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor.batch_prep import make_extend_batch
from executor.core.errors import ModelStateError, ToggleRefusedError
from executor.model_executor import ModelExecutor
from executor.models.hf_loader import save_hf_directory
from executor.models.tiny_random import tiny_random_weights
from executor.weights.memory import KV_CACHE, TAGS, WEIGHTS, device_free_bytes
from executor.weights.writer import digest
from ops.device_scope import current_scope, resolve_index
from tests.weights_util import MEDIUM, config, fresh, greedy, new_weights, update

# Every test here loads an executor or starts a server: over half a second each.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_release_gives_memory_back_before_answering_and_resume_restores_it(
    tmp_path: Path, cache_dir: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory figure: the resident set on the CPU, `mem_get_info`'s free bytes on CUDA
    (where the DECODE graphs, which captured the memory's addresses, are dropped at the
    release and captured again at the resume)."""
    path = tmp_path / "medium"
    save_hf_directory(path, MEDIUM, tiny_random_weights(MEDIUM))
    on_device = (
        {"linear_kernel": "onednn"}
        if device == "cpu"
        else {"graph_mode": "decode", "graph_backend": "cuda", "graph_batch_sizes": "1,4"}
    )
    ex = ModelExecutor(config(cache_dir, str(path), kv_slots=8192, device=device, **on_device))
    before = greedy(ex)
    ex.forward(
        make_extend_batch(input_ids=[[5, 6, 7]], req_pool_indices=[2], out_cache_loc=[[9, 10, 11]])
    )
    rows, weights = ex.req_to_token_pool.rows_in_use(), digest(ex.model)
    kv_address = ex.kv_pool.k.data_ptr()
    if ex.kv_pool.pages is not None:  # the CPU's KV pages, committed in idle time: resident
        ex.kv_pool.pages.wait()
    tagged = {tag: ex.weights.memory.nbytes(tag) for tag in TAGS}
    assert tagged[WEIGHTS] > 80e6 and tagged[KV_CACHE] > 64e6
    for tag in TAGS:
        free = device_free_bytes(ex.device)
        report = ex.weights.release((tag,))
        freed = device_free_bytes(ex.device) - free  # measured once the call answered
        assert report.nbytes == tagged[tag]
        assert freed >= 0.9 * tagged[tag], (tag, freed, tagged[tag])
    assert ex.info.memory is not None and ex.info.memory.released == TAGS
    batch = make_extend_batch(input_ids=[[1, 2]], req_pool_indices=[3], out_cache_loc=[[20, 21]])
    with pytest.raises(ModelStateError, match="released"):
        ex.forward(batch)
    with pytest.raises(ModelStateError, match="released"):
        update(ex, {"model.norm.weight": torch.ones(512)})
    with pytest.raises(ToggleRefusedError, match="released"):
        ex.control.apply_toggles(graph_mode="both")
    assert ex.req_to_token_pool.rows_in_use() == rows  # refused: nothing else changed
    scopes: list[torch.device | None] = []  # a resume captures graphs: kernels need the scope
    resume_tag = ex.weights.memory.resume
    monkeypatch.setattr(
        ex.weights.memory, "resume", lambda tag: scopes.append(current_scope()) or resume_tag(tag)
    )
    free = device_free_bytes(ex.device)
    report = ex.weights.resume(TAGS, from_update=False)
    assert scopes == [resolve_index(ex.device)] * len(TAGS)
    assert free - device_free_bytes(ex.device) >= 0.9 * sum(tagged.values())
    assert report.released == () and report.kv_epoch == 1
    assert ex.req_to_token_pool.rows_in_use() == 0  # every row released
    assert not ex.kv_pool.k.any() and not ex.kv_pool.v.any()
    if device == "cpu":  # the KV mapping given back and taken again in place
        assert ex.kv_pool.k.data_ptr() == kv_address
    assert digest(ex.model) == weights  # reloaded from the model file
    if device == "cuda":
        decode = ex.runner.decode_graphs
        assert decode is not None and set(decode.captured) == {1, 4}  # captured again
    assert greedy(ex) == before


def test_a_kv_release_reports_the_pages_that_were_resident(cache_dir: Path) -> None:
    """The CPU's KV mapping is backed in the server's idle time and where steps write: a
    release before that commit is done gives back, and says, only what was resident (a
    resume takes the whole mapping)."""
    ex = ModelExecutor(config(cache_dir, kv_slots=8192))
    pages = ex.kv_pool.pages
    assert pages is not None
    pages.release()  # as if the commit had not run yet: no page backed
    assert pages.resident_bytes() == 0 == ex.weights.memory.nbytes(KV_CACHE)
    ex.forward(
        make_extend_batch(input_ids=[[5, 6, 7]], req_pool_indices=[2], out_cache_loc=[[9, 10, 11]])
    )
    written = ex.weights.memory.nbytes(KV_CACHE)  # the pages the step's KV writes backed
    assert 0 < written < pages.nbytes // 8
    report = ex.weights.release((KV_CACHE,))
    assert report.nbytes == written and pages.resident_bytes() == 0
    assert ex.weights.memory.nbytes(KV_CACHE) == written  # released: what it gave back
    assert ex.weights.resume((KV_CACHE,), from_update=False).nbytes == pages.nbytes


def test_a_release_that_cannot_free_a_tag_frees_no_tag(cache_dir: Path) -> None:
    """Every tag is checked before any is freed: a weight whose memory cannot be released
    (borrowed, not resizable) refuses the call, and the KV cache asked first stays held."""
    ex = ModelExecutor(config(cache_dir, kv_slots=8192))
    name, param = next(iter(ex.model.named_parameters()))
    borrowed = torch.frombuffer(bytearray(param.numel() * param.element_size()), dtype=param.dtype)
    param.data = borrowed.view(param.shape).copy_(param.data)
    weights, resident = digest(ex.model), ex.weights.memory.nbytes(KV_CACHE)
    with pytest.raises(ModelStateError, match=f"{name}'s memory cannot be released"):
        ex.weights.release((KV_CACHE, WEIGHTS))
    assert ex.weights.memory.released == ()
    assert ex.weights.memory.nbytes(KV_CACHE) == resident and digest(ex.model) == weights


def test_weights_resumed_from_an_update_wait_for_every_tensor(
    tmp_path: Path, cache_dir: Path
) -> None:
    ex = ModelExecutor(config(cache_dir, linear_kernel="onednn"))
    ex.weights.release((WEIGHTS,))
    report = ex.weights.resume((WEIGHTS,), from_update=True)
    assert report.awaiting_update and ex.info.memory is not None
    batch = make_extend_batch(input_ids=[[1, 2]], req_pool_indices=[1], out_cache_loc=[[1, 2]])
    with pytest.raises(ModelStateError, match="without content"):
        ex.forward(batch)
    tensors = new_weights()
    with pytest.raises(ModelStateError, match="must name every tensor"):
        update(ex, {"model.norm.weight": tensors["model.norm.weight"]})
    update(ex, tensors, "trained")
    assert not ex.weights.awaiting_update
    assert greedy(ex) == greedy(fresh(tmp_path, cache_dir, "tiny-random", tensors))
