"""LoRA adapters against transformers + peft on a random tiny llama built locally.

Two peft adapters (ranks 8 and 16, different targets and alphas, non-zero random A and B) in
one batch with base rows: each row's greedy tokens equal peft's for its adapter, on the eager,
full-graph DECODE and piecewise EXTEND paths (the path that ran is asserted), and at tp 2.
Loading, unloading and refusals leave every other row and adapter as they were.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from executor.batch_prep import make_extend_batch
from executor.client import cli
from executor.client.cli_lora import prompt_loras
from executor.client.grpc_client import ExecutorClient
from executor.client.scheduler import generate
from executor.config import ExecutorConfig
from executor.core.errors import (
    BatchValidationError,
    LoraAdapterError,
    LoraSlotsFullError,
    LoraStateError,
)
from executor.core.forward_batch import ForwardBatch
from executor.core.lora_types import RowAdapter
from executor.core.outputs import ForwardOutput
from executor.model_executor import ModelExecutor
from tests.lora_util import MLP_R16, SPECS, make_adapter, reference_tokens
from tests.server_util import running_server
from tests.test_model_families import SMALL, _randomize

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = pytest.mark.slow

NEW_TOKENS = 6
PROMPTS = ([5, 9, 44, 100, 7], [300, 12], [8, 8, 9, 10, 11, 12, 13], [77])
ROW_LORAS = ("attn8", "", "mlp16", "attn8")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A random tiny llama directory, the two adapters, and peft's tokens per row."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    _randomize(model, seed=0)
    root = tmp_path_factory.mktemp("lora")
    model.save_pretrained(root / "base")
    adapters = {s.name: make_adapter(root / "base", root / s.name, s.config, s.seed) for s in SPECS}
    ref = reference_tokens(root / "base", adapters, PROMPTS, ROW_LORAS, NEW_TOKENS)
    base = reference_tokens(root / "base", adapters, PROMPTS, [""] * len(PROMPTS), NEW_TOKENS)
    return {"root": root, "adapters": adapters, "ref": ref, "base": base}


def _executor(setup: dict[str, Any], cache_dir: Path, **changes: object) -> ModelExecutor:
    return ModelExecutor(_executor_config(setup, cache_dir, **changes))


def _executor_config(setup: dict[str, Any], cache_dir: Path, **changes: object) -> ExecutorConfig:
    values: dict[str, object] = {
        "model": str(setup["root"] / "base"),
        "device": "cpu",
        "max_reqs": 8,
        "kv_slots": 512,
        "max_context_len": 64,
        "cache_dir": str(cache_dir),
        "dtype": "float32",
        "graph_backend": "standin",
        "graph_batch_sizes": "4",
        "piecewise_token_sizes": "32",
        "lora": ",".join(f"{n}={p}" for n, p in setup["adapters"].items()),
        "max_loras": 3,
        "max_lora_rank": 16,
    }
    values.update(changes)
    return ExecutorConfig(**values)  # type: ignore[arg-type]


def _recording(ex: ModelExecutor, seen: list[ForwardOutput]) -> Callable[..., ForwardOutput]:
    def forward(fb: ForwardBatch, **kwargs: Any) -> ForwardOutput:
        out = ex.forward(fb, **kwargs)
        seen.append(out)
        return out

    return forward


@pytest.mark.parametrize(
    ("graph_mode", "path"),
    [("none", "eager"), ("decode", "full_graph"), ("extend", "piecewise")],
)
def test_mixed_batch_matches_peft_per_row(
    setup: dict[str, Any], cache_dir: Path, graph_mode: str, path: str
) -> None:
    ex = _executor(setup, cache_dir, graph_mode=graph_mode)
    seen: list[ForwardOutput] = []
    forward = _recording(ex, seen)
    got = generate(forward, ex.limits, PROMPTS, max_new_tokens=NEW_TOKENS, lora=ROW_LORAS)
    assert got == setup["ref"]
    assert any(o.stats.path == path for o in seen), [o.stats.path for o in seen]
    assert all(o.stats.lora_rows == 3 for o in seen if o.stats.batch_size == 4)
    # The adapters change the tokens (else this would test nothing), and base rows are base.
    assert got[0] != setup["base"][0] and got[2] != setup["base"][2]
    assert got[1] == setup["base"][1]
    # A base-only batch runs no LoRA work, with the adapters still loaded.
    seen.clear()
    assert generate(forward, ex.limits, PROMPTS, max_new_tokens=NEW_TOKENS) == setup["base"]
    assert all(o.stats.lora_rows == 0 for o in seen)


def test_load_unload_and_refusals_change_nothing_else(
    setup: dict[str, Any], cache_dir: Path, tmp_path: Path
) -> None:
    ex = _executor(setup, cache_dir, graph_mode="none", max_loras=2)
    adapters = setup["adapters"]
    base_dir = setup["root"] / "base"
    assert [a.name for a in ex.info.lora.adapters] == ["attn8", "mlp16"]
    assert ex.info.lora.max_loras == 2 and ex.info.lora.max_lora_rank == 16

    # A request starts on mlp16 (row 1) and stays live: unloading mlp16 is refused, naming it.
    start = make_extend_batch(
        input_ids=[PROMPTS[2]], req_pool_indices=[1], out_cache_loc=[list(range(1, 8))]
    )
    start = dataclasses.replace(start, row_adapters=(RowAdapter(1, "mlp16"),))
    assert ex.forward(start).stats.lora_rows == 1
    with pytest.raises(LoraStateError, match=r"1 live row\(s\): 1"):
        ex.unload_lora("mlp16")
    # An unknown adapter name in a batch is refused and changes nothing.
    with pytest.raises(BatchValidationError, match="nope"):
        ex.forward(
            dataclasses.replace(
                make_extend_batch(input_ids=[[5]], req_pool_indices=[2], out_cache_loc=[[9]]),
                row_adapters=(RowAdapter(2, "nope"),),
            )
        )
    ex.unload_lora("attn8")  # unused: fine
    # Releasing the row frees mlp16's last user (checked below by a mixed batch using it).
    release = make_extend_batch(input_ids=[[5]], req_pool_indices=[2], out_cache_loc=[[9]])
    assert ex.forward(dataclasses.replace(release, released_req_pool_indices=torch.tensor([1])))
    assert ex.lora is not None and ex.lora.table.rows_using(2) == []

    # Refused loads, nothing changed: a rank over the cap, a target this model has no
    # adapter slot for, every slot taken, a name loaded already.
    r32 = make_adapter(base_dir, tmp_path / "r32", {**MLP_R16, "r": 32}, seed=3)
    with pytest.raises(LoraAdapterError, match="over the cap"):
        ex.load_lora("r32", str(r32))
    head = make_adapter(base_dir, tmp_path / "head", {"r": 4, "target_modules": ["lm_head"]}, 4)
    with pytest.raises(LoraAdapterError, match="lm_head"):
        ex.load_lora("head", str(head))
    with pytest.raises(LoraStateError, match="loaded already"):
        ex.load_lora("mlp16", str(adapters["attn8"]))
    assert [a.name for a in ex.info.lora.adapters] == ["mlp16"]

    # Load another adapter into the freed slot; release row 0; a mixed batch gets peft's
    # tokens for every row, the adapter now named attn8b.
    ex.load_lora("attn8b", str(adapters["attn8"]))
    with pytest.raises(LoraSlotsFullError):
        ex.load_lora("third", str(adapters["attn8"]))
    loras = [n.replace("attn8", "attn8b") for n in ROW_LORAS]
    got = generate(ex.forward, ex.limits, PROMPTS, max_new_tokens=NEW_TOKENS, lora=loras)
    assert got == setup["ref"]


def test_served_adapters_are_operator_calls_and_rows_get_their_tokens(
    setup: dict[str, Any], cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Over gRPC: LoadLora / UnloadLora need the runtime-config token (a call without it is
    refused, nothing loaded); GetInfo lists the adapters and caps; a batch's row adapters
    give peft's tokens; the refusals map to their status codes."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    adapters = setup["adapters"]
    config = _executor_config(setup, cache_dir, graph_mode="decode", lora="", max_loras=2)
    with running_server(config, runtime_config_token_file=str(token_file)) as srv:
        target = f"127.0.0.1:{srv.port}"
        with ExecutorClient(target) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.load_lora("attn8", str(adapters["attn8"]))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert c.info().info.lora.adapters == ()
        with ExecutorClient(target, token="s3cret") as c:
            for s in SPECS:
                assert c.load_lora(s.name, str(adapters[s.name])).name == s.name
            info = c.info().info
            assert [a.name for a in info.lora.adapters] == ["attn8", "mlp16"]
            assert (info.lora.max_loras, info.lora.max_lora_rank) == (2, 16)
            for call, code in (
                (lambda: c.load_lora("x", str(adapters["attn8"])), "RESOURCE_EXHAUSTED"),
                (lambda: c.unload_lora("nope"), "NOT_FOUND"),
                (lambda: c.load_lora("attn8", "/nonexistent"), "FAILED_PRECONDITION"),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code().name == code, err.value.details()
            got = generate(
                c.forward, info.limits, PROMPTS, max_new_tokens=NEW_TOKENS, lora=ROW_LORAS
            )
            assert got == setup["ref"]
            # Metrics: live rows per adapter (every request was released) and the operations.
            url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            assert 'model_executor_lora_running_rows{adapter="attn8"} 0.0' in text
            assert 'model_executor_lora_operations_total{operation="loaded"} 2.0' in text
            assert 'model_executor_lora_operations_total{operation="load_refused"} 2.0' in text
            assert c.unload_lora("attn8").slot == 1
            with pytest.raises(grpc.RpcError) as err:
                c.load_lora("bad", str(tmp_path))  # not an adapter directory
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The CLI: load-lora / unload-lora send the token from --token-file.
        auth = ["--target", target, "--token-file", str(token_file)]
        assert cli.main(["load-lora", "attn8", str(adapters["attn8"]), *auth]) == 0
        printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
        assert json.loads(printed[-1])["slot"] == 1  # (the server's log lines share stdout)
        assert cli.main(["unload-lora", "nope", *auth]) == 1
        assert "NOT_FOUND" in capsys.readouterr().err
        assert cli.main(["unload-lora", "mlp16", *auth]) == 0


def test_generate_lora_names_one_adapter_or_one_per_prompt() -> None:
    assert prompt_loras("", 2) == ["", ""]
    assert prompt_loras("a", 3) == ["a", "a", "a"]
    assert prompt_loras("a,,b", 3) == ["a", "", "b"]
    with pytest.raises(ValueError, match="2 adapters for 3 prompts"):
        prompt_loras("a,b", 3)


@pytest.mark.parametrize("graph_mode", ["none", "both"])
def test_mixed_batch_matches_peft_per_row_at_tp2(
    setup: dict[str, Any], cache_dir: Path, graph_mode: str
) -> None:
    """Tensor parallelism: each rank reads its cut of every adapter (the heads and MLP columns
    it holds) and adds its part before the all-reduces; rank 0's tokens equal peft's per row,
    eagerly and on the graph paths."""
    from tests.tp_util import generate_tp

    config = _executor_config(setup, cache_dir, graph_mode=graph_mode, tp_size=2)
    run = {"max_new_tokens": NEW_TOKENS, "lora": list(ROW_LORAS)}
    [(got, paths)] = generate_tp(config, [list(p) for p in PROMPTS], [run], timeout_s=240)
    assert got == setup["ref"]
    if graph_mode == "both":
        assert "full_graph" in paths and "piecewise" in paths, paths
