"""The GGUF's own tokenizer against transformers' reading of the same file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor.models.loader import packaged_smollm2_path, resolve_model_spec
from executor.models.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world, this is a test",
    "  spaces   and\ttabs\n\nnewlines",
    "<|im_start|>user\nHi<|im_end|>\n",
    "café naïve 日本語 emoji 🎉",
    "numbers 12345 and 3.14, dates 2026-11-22",
    "def f(x):\n    return x ** 2  # square\n",
]


@pytest.fixture(scope="module")
def smollm2_tokenizers(cache_dir: Path) -> tuple[Tokenizer, object]:
    """Ours as a server loads it (from the run's cache dir, converted from the GGUF file by
    whichever test needed it first), and transformers' from the GGUF file."""
    path = packaged_smollm2_path()
    ours = load_tokenizer(resolve_model_spec("smollm2"), 49152, 1, (2,), cache_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, theirs


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers_and_round_trip(
    smollm2_tokenizers: tuple[Tokenizer, object], text: str
) -> None:
    ours, theirs = smollm2_tokenizers
    ids = ours.encode(text)
    assert ids == theirs(text).input_ids  # type: ignore[operator]
    assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_special_tokens_are_single_ids_and_skippable(
    smollm2_tokenizers: tuple[Tokenizer, object],
) -> None:
    ours, _ = smollm2_tokenizers
    ids = ours.encode("<|im_start|>assistant\nOK<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "assistant\nOK"
    assert ours.eos_token_ids == (2,)


def test_chat_template_matches_transformers(smollm2_tokenizers: tuple[Tokenizer, object]) -> None:
    ours, theirs = smollm2_tokenizers
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    assert ours.apply_chat_template(messages) == expected


@pytest.mark.slow
def test_cached_tokenizer_is_identical(tmp_path: Path) -> None:
    source = resolve_model_spec("smollm2")
    first = load_tokenizer(source, 49152, 1, (2,), tmp_path)
    assert list((tmp_path / "gguf").glob("*.tokenizer.json"))
    second = load_tokenizer(source, 49152, 1, (2,), tmp_path)
    assert second.encode(TEXTS[4]) == first.encode(TEXTS[4])
    assert second.chat_template == first.chat_template
    data = json.loads(first.to_json())
    assert isinstance(data["tokenizer"], str)  # read by `tokenizers` as it is
    data["tokenizer"] = json.loads(data["tokenizer"])  # a cache written as a nested object
    older = Tokenizer.from_json(json.dumps(data))
    assert older.encode(TEXTS[4]) == first.encode(TEXTS[4])


def test_byte_tokenizer_round_trips_any_text() -> None:
    tok = byte_tokenizer(512, 1, (2,))
    text = "héllo ✓"
    ids = tok.encode(text)
    assert ids == [3 + b for b in text.encode()]
    assert tok.decode(ids) == text
