"""The CLI's shared session pieces: how prompts become the texts sent (--chat, --system), and
the process's entry."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from executor.client import cli
from executor.client.cli import build_parser
from executor.client.cli_session import prompt_texts


class _Template:
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)


def _texts(*flags: str) -> list[str]:
    args = build_parser().parse_args(["generate", *flags, "a", "b"])
    tok: Any = _Template()
    return prompt_texts(args, tok, list(args.prompts))


def test_prompts_go_as_given_without_chat() -> None:
    assert _texts() == ["a", "b"]


def test_chat_wraps_each_prompt_after_the_system_message() -> None:
    assert _texts("--chat") == ["user:a", "user:b"]
    assert _texts("--chat", "--system", "be brief") == [
        "system:be brief|user:a",
        "system:be brief|user:b",
    ]


def test_the_process_entry_exits_with_the_code_and_a_frozen_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`run` (the console script): the interpreter's exit then skips its walks of the heap."""
    monkeypatch.setattr(cli, "main", lambda: 3)
    assert gc.get_freeze_count() == 0
    try:
        with pytest.raises(SystemExit) as exited:
            cli.run()
        assert exited.value.code == 3
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
