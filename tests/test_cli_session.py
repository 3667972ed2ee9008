"""The CLI's shared session pieces: how prompts become the texts sent (--chat, --system), and
the process's entry."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

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


def test_the_process_entry_exits_with_the_code_after_what_an_exit_owes() -> None:
    """`run` (the console script) skips the interpreter's teardown, not the exit's duties:
    its code, a thread that is not a daemon joined, `atexit` functions run, the output
    flushed (piped: block-buffered)."""
    script = (
        "import atexit, sys, threading, time\n"
        "from executor.client import cli\n"
        "def main():\n"
        "    print('answer')\n"
        "    threading.Thread(target=lambda: (time.sleep(0.2), print('late'))).start()\n"
        "    return 3\n"
        "cli.main = main\n"
        "atexit.register(lambda: print('atexit'))\n"
        "cli.run()\n"
        "print('never')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 3, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["answer", "late", "atexit"]
