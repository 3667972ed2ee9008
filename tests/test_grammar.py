"""JSON-schema constrained generation: the scheduler's grammars (xgrammar) drive the
executor's vocab masks, and what comes back over gRPC parses and validates."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from executor.client.grammar import Grammars
from executor.client.grpc_client import ExecutorClient
from executor.client.scheduler import ReferenceScheduler
from executor.core.controls_types import mask_words
from executor.models.tokenizer import Tokenizer, byte_tokenizer
from executor.service.server import RunningServer
from ops.logit_controls import unpack_bitmask
from tests.server_util import running_server, tiny_config

# Bounded so that a random model ends: enums, bools, bounded ints, short patterned strings.
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": -5, "maximum": 99},
        },
        "required": ["colour", "ok", "n"],
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9},
                    "admin": {"type": "boolean"},
                },
                "required": ["id", "admin"],
            },
            "kind": {"const": "login"},
        },
        "required": ["user", "kind"],
    },
]
PROMPTS = ["hi", "The answer, as JSON:", "x" * 30, "{"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    config = tiny_config(tmp_path_factory.mktemp("cache"), future_slots=64)
    with running_server(config) as running:
        yield running


def _tokenizer(client: ExecutorClient) -> tuple[Tokenizer, int]:
    info = client.info().info
    return byte_tokenizer(info.vocab_size, info.bos_token_id, info.eos_token_ids), info.vocab_size


def test_masks_have_the_executors_layout_and_never_allow_ids_past_the_tokenizer() -> None:
    """Bit j of word w allows token 32*w + j (xgrammar's layout is the executor's); a model
    vocabulary wider than the tokenizer's gets the executor's word count, extra ids off."""
    import xgrammar as xgr

    tok = byte_tokenizer(512, 1, (2,))
    grammars = Grammars(tok, 544)
    assert grammars.words == mask_words(544) == 17
    g = grammars.json_schema(SCHEMAS[0])
    words = torch.empty((2, grammars.words), dtype=torch.int32)
    words[0].fill_(0)
    g.fill(words, 1)
    allowed = unpack_bitmask(words, 544)
    assert not allowed[0].any()
    first = allowed[1].nonzero().flatten().tolist()
    assert first == [3 + ord("{")]  # compact JSON: the object opens, nothing else
    logits = torch.zeros(1, 544)
    xgr.apply_token_bitmask_inplace(logits, words[1:].clone())
    assert torch.equal(logits[0] == 0, allowed[1])
    # Walk the grammar at random: never an id past the tokenizer or a control byte.
    rng = random.Random(0)
    while not g.terminated:
        g.fill(words, 0)
        ids = unpack_bitmask(words[:1], 544)[0].nonzero().flatten().tolist()
        assert ids and max(ids) < 512 and min(ids) >= 3 + 0x20
        g.accept(rng.choice(ids))
    g.fill(words, 0)  # a finished request allows everything (its token is discarded)
    assert bool((words[0] == -1).all())


def test_a_schema_xgrammar_refuses_is_a_value_error() -> None:
    grammars = Grammars(byte_tokenizer(512, 1, (2,)), 512)
    with pytest.raises(ValueError, match="json schema"):
        grammars.json_schema('{"type": "object", "properties": {"a": {"type": "nope"}}}')


def _generate(server: RunningServer, *, stream: bool) -> list[tuple[dict[str, Any], str, str]]:
    """Every prompt under every schema at once: (schema, finish reason, text) per request."""
    with ExecutorClient(f"127.0.0.1:{server.port}") as client:
        tok, vocab = _tokenizer(client)
        info = client.info().info
        pipe = client.open_stream() if stream else None
        scheduler = ReferenceScheduler(
            client.retrying(),
            info.limits,
            info.eos_token_ids,
            overlap=stream,
            pipe=pipe,
            grammars=Grammars(tok, vocab),
        )
        reqs = [
            (schema, scheduler.add_request(tok.encode(p), max_new_tokens=120, json_schema=schema))
            for schema in SCHEMAS
            for p in PROMPTS
        ]
        scheduler.run()
        if pipe is not None:
            pipe.close()
    return [(schema, str(r.finish_reason), tok.decode(r.output_ids)) for schema, r in reqs]


@pytest.mark.slow
def test_json_schema_generation_through_grpc_parses_and_validates(server: RunningServer) -> None:
    """Unary batches carry their masks inline; on a stream with overlap each mask follows its
    batch (deferred) while the step runs. Both give JSON the schema accepts, the same tokens."""
    unary = _generate(server, stream=False)
    for schema, reason, text in unary:
        assert reason == "stop", text  # the JSON completed
        jsonschema.validate(json.loads(text), schema)
    assert len({text for _, _, text in unary}) > 3  # the prompts matter: not one answer
    assert _generate(server, stream=True) == unary


def test_grammar_and_controls_together_in_process(make_executor: Any) -> None:
    """In-process (an `InlinePipe` of the executor's forward): the mask rides in the batch,
    and a request without a schema shares the batch unmasked, with its controls applied."""
    from executor.core.controls_types import SamplingControls

    executor = make_executor()
    tok = byte_tokenizer(executor.info.vocab_size, 1, (2,))
    scheduler = ReferenceScheduler(
        executor.forward, executor.limits, (2,), grammars=Grammars(tok, executor.info.vocab_size)
    )
    banned = tuple(range(3, 200))
    free = scheduler.add_request(
        tok.encode("free"),
        max_new_tokens=8,
        ignore_eos=True,
        controls=SamplingControls(banned_token_ids=banned),
    )
    shaped = scheduler.add_request(tok.encode("shaped"), max_new_tokens=80, json_schema=SCHEMAS[0])
    scheduler.run()
    assert len(free.output_ids) == 8 and not set(free.output_ids) & set(banned)
    jsonschema.validate(json.loads(tok.decode(shaped.output_ids)), SCHEMAS[0])


def test_generate_flags_parse_into_sampling_controls() -> None:
    from executor.client.cli import build_parser
    from executor.client.cli_controls import sampling_controls
    from executor.core.controls_types import SamplingControls

    parser = build_parser()
    args = parser.parse_args(
        ["generate", "hi", "--repetition-penalty", "1.3", "--frequency-penalty", "0.5"]
        + ["--presence-penalty", "-0.25", "--logit-bias", "17=-100", "--logit-bias", "5=2.5"]
        + ["--min-tokens", "4", "--ban-ids", "7,8", "--allow-ids", "5,9,17"]
    )
    assert sampling_controls(args) == SamplingControls(
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        logit_bias=((5, 2.5), (17, -100.0)),
        min_tokens=4,
        banned_token_ids=(7, 8),
        allowed_token_ids=(5, 9, 17),
    )
    assert sampling_controls(parser.parse_args(["generate", "hi"])) is None  # neutral: none
    for bad, message in [
        (["--logit-bias", "17"], "--logit-bias: expected ID=BIAS"),
        (["--logit-bias", "3=1", "--logit-bias", "3=2"], "token 3 is given twice"),
        (["--ban-ids", "7,x"], "--ban-ids: expected token ids"),
    ]:
        with pytest.raises(ValueError, match=message):
            sampling_controls(parser.parse_args(["generate", "hi", *bad]))


@pytest.mark.slow
def test_cli_generate_with_a_json_schema_and_controls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process, overlapped on a stream (deferred masks): each answer is JSON the schema
    accepts; a bad flag fails before any model loads."""
    from executor.client.cli import main

    monkeypatch.setattr("executor.client.cli_session.configure_logging", lambda *a, **k: None)
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[2]))
    args = ["generate", "hi", "there", "--model", "tiny-random", "--max-new-tokens", "60"]
    args += ["--cache-dir", str(tmp_path), "--max-reqs", "4", "--dtype", "float32"]
    args += ["--json-schema", str(schema_file), "--overlap", "--repetition-penalty", "1.2"]
    args += ["--ban-ids", str(3 + ord("5"))]  # the byte tokenizer's "5"
    assert main(args) == 0
    answers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(answers) == 2
    for text in answers:
        value = json.loads(text)
        jsonschema.validate(value, SCHEMAS[2])
        assert value["user"]["id"] != 5
    assert main([*args[:-2], "--ban-ids", "1,x"]) == 2
    assert "--ban-ids: expected token ids" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2s_byte_level_vocabulary_spells_valid_json(cache_dir: Path) -> None:
    """The default model's GGUF tokenizer (byte-level BPE, 49,152 ids) as xgrammar sees it:
    a random walk through each schema's masks decodes to JSON the schema accepts."""
    from executor.models.loader import resolve_model_spec
    from executor.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_spec("smollm2"), 49152, 1, (2,), cache_dir)
    grammars = Grammars(tok, 49152)
    assert grammars.info.vocab_type.name == "BYTE_LEVEL"
    rng = random.Random(0)
    words = torch.empty((1, grammars.words), dtype=torch.int32)
    for schema in SCHEMAS:
        g = grammars.json_schema(schema)
        out: list[int] = []
        while not g.terminated and len(out) < 200:
            g.fill(words, 0)
            ids = unpack_bitmask(words, 49152)[0].nonzero().flatten().tolist()
            token = rng.choice(ids)
            g.accept(token)
            out.append(token)
        jsonschema.validate(json.loads(tok.decode(out)), schema)
