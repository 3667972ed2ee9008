"""Weight updates against transformers: an executor serving a tiny Llama built with
transformers takes another draw's state dict (Hugging Face names, lm_head included, as a
trainer sends them) and then gives that model's transformers logits and greedy tokens, on the
eager path and on graphs of both modes captured and run before the update. (Whole-step
compiled DECODE graphs over packed linears, the CPU's default, are checked across an update
and a release in tests/test_auto_choices.py, beside the compile it already pays for.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from executor.model_executor import ModelExecutor
from tests.parity_util import check_parity
from tests.test_model_families import SMALL, _randomize
from tests.weights_util import config, greedy, update

# Every test here loads an executor or starts a server: over half a second each.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (1, 7, 40)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, object]]:
    """seed -> (the saved directory, the transformers model) of a tiny Llama, built once."""
    built: dict[int, tuple[Path, object]] = {}

    def get(seed: int) -> tuple[Path, object]:
        if seed not in built:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
            _randomize(model, seed=seed)
            path = tmp_path_factory.mktemp(f"llama-{seed}")
            model.save_pretrained(path)
            built[seed] = (path, model.eval())
        return built[seed]

    return get


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _state(hf: object) -> dict[str, torch.Tensor]:
    """What a trainer sends: the model's state dict, Hugging Face names, lm_head included."""
    assert isinstance(hf, torch.nn.Module)
    return {n: t.detach().clone() for n, t in hf.state_dict().items()}


@pytest.mark.parametrize(
    ("overrides", "paths"),
    [
        ({"graph_mode": "none", "linear_kernel": "aten"}, {"eager"}),
        ({"graph_mode": "both", "linear_kernel": "onednn"}, {"full_graph", "piecewise"}),
    ],
    ids=["eager", "graphs-packed"],
)
def test_an_update_gives_the_new_models_transformers_tokens_on_each_path(
    llama: Callable[[int], tuple[Path, object]],
    cache_dir: Path,
    overrides: dict[str, object],
    paths: set[str],
) -> None:
    directory, _ = llama(0)
    _, new = llama(1)
    cfg = config(
        cache_dir,
        str(directory),
        graph_batch_sizes="4",  # 3 requests pad to 4
        piecewise_token_sizes="64",  # the prompts prefill together in 48 tokens
        **overrides,
    )
    ex = ModelExecutor(cfg)
    before = greedy(ex, prompts=_prompts(0))  # the graphs run on the old weights first

    result = update(ex, _state(new), "rl-step-1")
    assert result.version == "rl-step-1"
    ran = check_parity(ex, new, _prompts(1))  # type: ignore[arg-type]
    assert paths <= set(ran), ran  # the graphs captured before the update ran the new weights
    assert greedy(ex, prompts=_prompts(0)) != before
