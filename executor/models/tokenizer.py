"""Text <-> token ids from the model's own files (the GGUF's vocabulary, or tokenizer.json).

The GGUF path rebuilds llama.cpp's byte-level BPE with the pre-tokenizer the file names
(`smollm` splits digits one by one before the GPT-2 split, as llama.cpp does), so ids
match what llama.cpp would feed the model. The built tokenizer is cached as
tokenizer.json next to the dequantized weights. Chat templates are the model's own Jinja
templates, rendered in a sandbox.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from executor.models.file_cache import atomic_write, cache_path
from executor.models.gguf_header import open_gguf
from executor.models.loader import ModelSource

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special.
_CONTROL = 3
_DIGIT_SPLIT_PRE = ("smollm", "llama3", "llama-bpe", "qwen2", "deepseek-llm", "deepseek-coder")


@dataclass
class Tokenizer:
    tokenizer: HFTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str | None
    special_ids: frozenset[int]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.id_to_token(self.bos_token_id)
            if self.bos_token_id is not None
            else "",
            eos_token=self.tokenizer.id_to_token(self.eos_token_ids[0])
            if self.eos_token_ids
            else "",
        )

    def to_json(self) -> str:
        meta = {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
            "special_ids": sorted(self.special_ids),
        }
        # The tokenizer's own JSON as one string: read back by `tokenizers` alone, not
        # parsed and dumped again in Python (a GGUF vocabulary's is megabytes).
        return json.dumps({"tokenizer": self.tokenizer.to_str(), "meta": meta})

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        data = json.loads(text)
        meta, own = data["meta"], data["tokenizer"]
        return cls(
            tokenizer=HFTokenizer.from_str(own if isinstance(own, str) else json.dumps(own)),
            bos_token_id=meta["bos_token_id"],
            eos_token_ids=tuple(meta["eos_token_ids"]),
            add_bos=meta["add_bos"],
            chat_template=meta["chat_template"],
            special_ids=frozenset(meta["special_ids"]),
        )


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def tokenizer_from_gguf(path: Path) -> Tokenizer:

    reader = open_gguf(path)
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tk = HFTokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre in _DIGIT_SPLIT_PRE:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(types) if t == _CONTROL]
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    eos = {
        int(x)
        for x in (
            _field(reader, "tokenizer.ggml.eos_token_id"),
            _field(reader, "tokenizer.ggml.eot_token_id"),
        )
        if x is not None
    }
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return Tokenizer(
        tokenizer=tk,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(sorted(eos)),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
        special_ids=frozenset(special),
    )


def tokenizer_from_hf_directory(path: Path) -> Tokenizer:
    tk_path = path / "tokenizer.json"
    if not tk_path.exists():
        raise ValueError(f"{path} has no tokenizer.json")
    tk = HFTokenizer.from_file(str(tk_path))
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    model_cfg = (
        json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    )
    eos = model_cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    special_ids = {i for i, t in tk.get_added_tokens_decoder().items() if t.special}
    return Tokenizer(
        tokenizer=tk,
        bos_token_id=model_cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        add_bos=bool(cfg.get("add_bos_token", False)),
        chat_template=cfg.get("chat_template"),
        special_ids=frozenset(special_ids),
    )


def byte_tokenizer(vocab_size: int, bos: int | None, eos: tuple[int, ...]) -> Tokenizer:
    """For models without a vocabulary (tiny-random): byte b is token 3 + b."""
    offset = 3
    if vocab_size < offset + 256:
        raise ValueError(
            f"a byte tokenizer needs a vocabulary of at least {offset + 256}, got {vocab_size}"
        )
    vocab = {f"<ctrl{i}>": i for i in range(offset)}
    vocab.update({f"<0x{b:02X}>": offset + b for b in range(256)})
    vocab.update({f"<unused{i}>": i for i in range(offset + 256, vocab_size)})
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, fuse_unk=False))
    tk.decoder = decoders.ByteFallback()
    return Tokenizer(
        tk, bos, eos, add_bos=False, chat_template=None, special_ids=frozenset(range(offset))
    )


def load_tokenizer(
    source: ModelSource,
    vocab_size: int,
    bos: int | None,
    eos: tuple[int, ...],
    cache_dir: Path | None,
) -> Tokenizer:
    """The tokenizer that belongs to `source`, cached beside the weights for GGUF files."""
    if source.kind == "tiny-random":
        return byte_tokenizer(vocab_size, bos, eos)
    assert source.path is not None
    if source.kind == "hf":
        return tokenizer_from_hf_directory(source.path)
    if cache_dir is None:
        return tokenizer_from_gguf(source.path)
    cached = cache_path(source.path, cache_dir, ".tokenizer.json")
    if cached.exists():
        return Tokenizer.from_json(cached.read_text())
    tok = tokenizer_from_gguf(source.path)
    atomic_write(cached, tok.to_json().encode())
    return tok
