"""Each model family against transformers' own implementation, on a random tiny config that
transformers builds locally and saves as a Hugging Face directory (safetensors).

Prefill logits within 1e-3 and greedy tokens equal to transformers' on every path (eager,
full-graph DECODE, piecewise EXTEND: the path that ran is asserted), at tp 2, and through a
served model; an unknown architecture is refused at start-up naming the supported ones.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from executor.client.grpc_client import ExecutorClient
from executor.client.scheduler import generate
from executor.config import ExecutorConfig
from executor.graphs.factory import GraphFactory
from executor.model_executor import ModelExecutor
from executor.models.config import AttentionConfig, ModelConfig
from executor.models.gguf_loader import load_gguf
from executor.models.hf_loader import load_hf_directory
from executor.models.loader import read_model_config
from executor.models.moe import SparseMoeBlock
from executor.models.registry import create_model
from executor.models.tiny_random import TINY_CONFIGS, tiny_random_weights
from executor.models.weights import load_hf_weights
from tests.gguf_writer import write_gguf
from tests.parity_util import assert_greedy_matches, check_parity, hf_greedy
from tests.server_util import running_server, tiny_config
from tests.tp_util import generate_tp

transformers = pytest.importorskip("transformers")

SMALL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
HF_CONFIGS: dict[str, Callable[[], object]] = {
    # head_dim 32, not hidden / heads (16): Qwen3 allows it.
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32, rope_theta=1e6),
    # 4 experts, top 2, renormalised; layer 1 of 3 dense (mlp_only_layers).
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **{**SMALL, "num_hidden_layers": 3},
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # 4 layers, the even ones windowed to 8 keys (every prompt but the 1-token one is longer,
    # and generation runs past it), soft-capped scores and logits, q.k scaled by 24 ** -0.5
    # (not head_dim), tied embeddings; transformers' eager attention (its reference path).
    "gemma2": lambda: transformers.Gemma2Config(
        **{**SMALL, "num_hidden_layers": 4, "tie_word_embeddings": True},
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        attn_implementation="eager",
    ),
}
PROMPT_LENGTHS = (1, 7, 40)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights at the scale of `tiny_random` (transformers' 0.02 init leaves every logit
    near every other, so greedy tokens would sit on near-ties): norms near 1, linears
    1/sqrt(fan_in), embeddings N(0, 1), the head 4x."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5 * (4.0 if "lm_head" in name else 1.0))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, object]]:
    """`family` -> (its saved directory, the transformers model), built once per module."""
    built: dict[str, tuple[Path, object]] = {}

    def get(family: str) -> tuple[Path, object]:
        if family not in built:
            model = transformers.AutoModelForCausalLM.from_config(
                HF_CONFIGS[family](), dtype=torch.float32
            )
            _randomize(model, seed=0)
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)  # safetensors
            built[family] = (path, model.eval())
        return built[family]

    return get


def _config(model: Path | str, cache_dir: Path, **changes: object) -> ExecutorConfig:
    values: dict[str, object] = {
        "model": str(model),
        "device": "cpu",
        "max_reqs": 8,
        "kv_slots": 1024,
        "max_context_len": 256,  # one KV bucket
        "cache_dir": str(cache_dir),
        "dtype": "float32",
        "graph_backend": "standin",
        "graph_batch_sizes": "4",  # 3 requests pad to 4
        "piecewise_token_sizes": "64",  # the prompts prefill together in 48 tokens
    }
    values.update(changes)
    return ExecutorConfig(**values)  # type: ignore[arg-type]


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
@pytest.mark.parametrize(
    ("graph_mode", "path"),
    [("none", "eager"), ("decode", "full_graph"), ("extend", "piecewise")],
)
def test_family_matches_transformers_on_each_path(
    hf_model: Callable[[str], tuple[Path, object]],
    cache_dir: Path,
    family: str,
    graph_mode: str,
    path: str,
) -> None:
    directory, hf = hf_model(family)
    ex = ModelExecutor(_config(directory, cache_dir, graph_mode=graph_mode))
    assert ex.info.architecture == transformers.AutoConfig.from_pretrained(directory).model_type
    paths = check_parity(ex, hf, _prompts(512))  # type: ignore[arg-type]
    assert paths[path] > 0, paths


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_family_at_tp2_gives_transformers_tokens(
    hf_model: Callable[[str], tuple[Path, object]], cache_dir: Path, family: str
) -> None:
    """Two gloo ranks, eagerly and then on both graph paths (a runtime toggle)."""
    directory, hf = hf_model(family)
    prompts = _prompts(512, seed=1)
    greedy = {"max_new_tokens": 16, "ignore_eos": True}
    runs = [greedy, {"toggles": {"graph_mode": "both"}}, greedy]
    config = _config(directory, cache_dir, graph_mode="none", tp_size=2)
    [(eager, eager_paths), (graphs, graph_paths)] = generate_tp(config, prompts, runs)
    assert eager_paths == ["eager"] and {"full_graph", "piecewise"} <= set(graph_paths)
    for prompt, a, b in zip(prompts, eager, graphs, strict=True):
        ref, gaps = hf_greedy(hf, prompt, 16)  # type: ignore[arg-type]
        assert_greedy_matches(a, ref, gaps)
        assert_greedy_matches(b, ref, gaps)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_served_family_answers_with_transformers_tokens(
    hf_model: Callable[[str], tuple[Path, object]], tmp_path: Path, family: str
) -> None:
    directory, hf = hf_model(family)
    prompts = _prompts(512, seed=2)
    config = tiny_config(tmp_path, model=str(directory), graph_mode="both")
    with running_server(config) as running, ExecutorClient(f"127.0.0.1:{running.port}") as c:
        info = c.info()
        assert info.info.architecture == family
        got = generate(c.forward, info.info.limits, prompts, max_new_tokens=16, ignore_eos=True)
    for prompt, tokens in zip(prompts, got, strict=True):
        ref, gaps = hf_greedy(hf, prompt, 16)  # type: ignore[arg-type]
        assert_greedy_matches(tokens, ref, gaps)


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_family_loads_from_gguf_with_the_same_weights(
    hf_model: Callable[[str], tuple[Path, object]], tmp_path: Path, family: str
) -> None:
    directory, _ = hf_model(family)
    config, tensors = load_hf_directory(directory)
    write_gguf(tmp_path / "m.gguf", config, tensors)
    loaded_config, loaded = load_gguf(tmp_path / "m.gguf", cache_dir=None)
    assert loaded_config.architecture == config.architecture
    assert loaded_config.head_dim == config.head_dim
    assert loaded_config.attention == _gguf_attention(config)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        # Exact, but for Gemma 2's norms, stored plus one (float32 rounding of w + 1 - 1).
        torch.testing.assert_close(loaded[name], t, atol=3e-7, rtol=0, msg=name)


def _gguf_attention(config: ModelConfig) -> AttentionConfig | None:
    """What GGUF carries of `config.attention`: no query scalar (llama.cpp derives it)."""
    a = config.attention
    return None if a is None else dataclasses.replace(a, query_pre_attn_scalar=None)


def test_an_unknown_architecture_is_refused_naming_the_supported(
    hf_model: Callable[[str], tuple[Path, object]], tmp_path: Path, cache_dir: Path
) -> None:
    directory, _ = hf_model("qwen3")
    cfg = json.loads((directory / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MambaForCausalLM"], "mamba"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'MambaForCausalLM' is not supported") as err:
        read_model_config(_config(tmp_path, cache_dir))
    for name in (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Gemma2ForCausalLM",
    ):
        assert name in str(err.value)


def test_experts_run_grouped_and_dense_alike_and_capture_safely() -> None:
    """The grouped experts (sorted assignments, device-side offsets) equal a per-token
    reference and the dense fallback, and run under the capture rules (no host reads)."""
    config = TINY_CONFIGS["tiny-random-qwen3-moe"]
    model = create_model(config, 64, device=torch.device("cpu"), dtype=torch.float32)
    load_hf_weights(model, tiny_random_weights(config))
    block = model.decoder_layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    x = torch.randn(11, config.hidden_size, generator=torch.Generator().manual_seed(3))
    ids, weights = block.route(x)
    assert torch.allclose(weights.sum(-1), torch.ones(11))  # norm_topk_prob
    experts = block.experts
    reference = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(config.moe.top_k if config.moe else 0):
            e = int(ids[t, j])
            gate, up = F.linear(x[t], experts.gate_up[e]).chunk(2)
            reference[t] += weights[t, j] * F.linear(F.silu(gate) * up, experts.down[e])
    torch.testing.assert_close(experts.grouped(x, ids, weights), reference)
    torch.testing.assert_close(experts.dense(x, ids, weights), reference)
    out = torch.zeros_like(x)
    graph = GraphFactory(torch.device("cpu"), "standin").new()
    graph.capture(lambda: out.copy_(block(x)))
    graph.replay()
    torch.testing.assert_close(out, reference)


@pytest.mark.slow
def test_experts_compile_in_the_compiled_graph_backend(
    cache_dir: Path, graph_compiler: str
) -> None:
    """Under torch.compile (float32 on CPU) the experts take the dense form the compiler
    traces; the full-graph path then gives the eager tokens."""
    prompts = [[5, 6, 7, 8], [9, 10]]
    tokens = {}
    for backend, mode in (("standin", "none"), ("compiled", "decode")):
        ex = ModelExecutor(
            _config(
                "tiny-random-qwen3-moe",
                cache_dir,
                graph_backend=backend,
                graph_mode=mode,
                graph_batch_sizes="2",
            )
        )
        assert all(not r.failed for r in ex.control.capture_reports), ex.control.capture_reports
        paths: set[str] = set()

        def forward(batch: object, ex: ModelExecutor = ex, paths: set[str] = paths) -> object:
            out = ex.forward(batch)  # type: ignore[arg-type]
            paths.add(out.stats.path)
            return out

        tokens[mode] = generate(forward, ex.limits, prompts, max_new_tokens=6, ignore_eos=True)
        assert ("full_graph" in paths) == (mode == "decode"), paths
    assert tokens["decode"] == tokens["none"]
