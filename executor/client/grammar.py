"""JSON-schema constrained generation on the scheduler's side, with xgrammar.

The executor samples under a per-step vocabulary bitmask (`ForwardBatch.vocab_mask`, or its
deferred form on a stream); the grammar that decides the mask lives here, with the scheduler:

    grammars = Grammars(tokenizer, info.vocab_size)     # once per model (tokenizer info)
    g = grammars.json_schema(schema)                    # per request; compiled once per schema
    g.fill(words, i)   # row i of an int32 [m, vocab_mask_words] mask: this step's tokens
    g.accept(token)    # the sampled token; g.terminated: the JSON is complete, stop

The mask layout is the executor's and xgrammar's alike: bit j (least significant first) of
int32 word w allows token 32*w + j, and `vocab_size` is the executor's (GetInfo), which may
exceed the tokenizer's: ids past the tokenizer are never allowed. A matcher terminates as
soon as the JSON is complete (no stop token needed), and the JSON is compact (no free
whitespace), so a request always ends within its schema's bounds. xgrammar's JSON strings
admit raw control characters, which JSON forbids (a strict parser refuses them): tokens that
spell any byte below 0x20 are never allowed here, as compact JSON needs none of them. (They
also admit UTF-8-encoded surrogates, which a byte-fallback vocabulary sampled at random can
spell; a schema's `pattern` bounds a string's characters where that matters.)

xgrammar is imported only when a grammar is built, so a scheduler without schemas never loads
it (nor the transformers it imports).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from executor.core.controls_types import VocabMask, mask_words
from executor.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

    from executor.client.requests import Request


def _vocab_type(tokenizer: Tokenizer) -> tuple[str, bool]:
    """xgrammar's vocabulary type (how tokens spell bytes) and whether the tokenizer prepends
    a space, from the tokenizer's own description."""
    desc = json.loads(tokenizer.tokenizer.to_str())

    def types(part: Any) -> list[dict[str, Any]]:
        if not isinstance(part, dict):
            return []
        nested = part.get("decoders") or part.get("pretokenizers") or part.get("normalizers")
        return [part] + [p for n in nested or () for p in types(n)]

    parts = types(desc.get("decoder")) + types(desc.get("pre_tokenizer"))
    names = {p.get("type") for p in parts}
    prefix = any(
        p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never" for p in parts
    )
    if "ByteLevel" in names:
        return "BYTE_LEVEL", False
    if "ByteFallback" in names or desc.get("model", {}).get("byte_fallback"):
        return "BYTE_FALLBACK", prefix
    return "RAW", prefix


class Grammars:
    """The model's tokenizer as xgrammar sees it, and each schema compiled once."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, threads: int = 2) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        encoded = [""] * vocab_size  # "": never allowed (special, or past the tokenizer)
        for token, i in tokenizer.tokenizer.get_vocab(with_added_tokens=True).items():
            if i < vocab_size and i not in tokenizer.special_ids:
                encoded[i] = token
        vocab_type, prefix = _vocab_type(tokenizer)
        self.info = xgr.TokenizerInfo(
            encoded,
            xgr.VocabType[vocab_type],
            vocab_size=vocab_size,
            stop_token_ids=list(tokenizer.eos_token_ids) or None,
            add_prefix_space=prefix,
        )
        # Bit set: the token spells no control byte (the AND of every row's mask).
        printable = torch.zeros(self.words * 32, dtype=torch.bool)
        decoded = self.info.decoded_vocab[:vocab_size]
        printable[: len(decoded)] = torch.tensor([bool(t) and min(t) >= 0x20 for t in decoded])
        weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
        packed = (printable.view(self.words, 32).long() * weights).sum(-1)
        self.printable = packed.to(torch.int32)  # wraps to int32 as the words do: [words]
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self._compiled: dict[str, xgrammar.CompiledGrammar] = {}

    def json_schema(self, schema: str | dict[str, Any]) -> RequestGrammar:
        """A fresh matcher for one request; raises ValueError for a schema xgrammar refuses."""
        import xgrammar as xgr

        text = (
            schema if isinstance(schema, str) else json.dumps(schema)
        )  # key order is property order
        compiled = self._compiled.get(text)
        if compiled is None:
            try:
                compiled = self._compiler.compile_json_schema(text, any_whitespace=False)
            except (RuntimeError, ValueError) as exc:
                raise ValueError(f"json schema: {exc}") from exc
            self._compiled[text] = compiled
        return RequestGrammar(
            xgr.GrammarMatcher(compiled, terminate_without_stop_token=True), self.printable
        )


class RequestGrammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, printable: torch.Tensor) -> None:
        self.matcher = matcher
        self.printable = printable

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill(self, words: torch.Tensor, index: int) -> None:
        """Write the next token's allowed set into row `index` of `words` (int32, CPU,
        contiguous, [m, vocab_mask_words]); a finished request allows everything (its token
        is discarded)."""
        if self.terminated:
            words[index].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(words, index)
            words[index] &= self.printable

    def accept(self, token: int) -> None:
        """Advance past a sampled token; a token the mask did not allow is a bug (the mask
        was not applied), so it raises."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(
                f"token {token} does not continue the grammar: was the vocab mask applied?"
            )


def step_mask(
    grammars: Grammars | None, members: Sequence[Request], masked: Sequence[int]
) -> VocabMask:
    """The vocab mask of the `masked` positions of a step of `members`."""
    assert grammars is not None
    words = torch.empty((len(masked), grammars.words), dtype=torch.int32)
    for k, i in enumerate(masked):
        grammar = members[i].grammar
        assert grammar is not None
        grammar.fill(words, k)
    rows = None if len(masked) == len(members) else torch.tensor(list(masked), dtype=torch.int64)
    return VocabMask(words, rows)


def masked_positions(members: Sequence[Request], produces: Sequence[bool]) -> list[int]:
    """Positions whose token is kept and constrained by a grammar."""
    return [
        i
        for i, (r, p) in enumerate(zip(members, produces, strict=True))
        if p and r.grammar is not None
    ]
