"""Regenerate the settings tables of docs/configuration.md from the config dataclasses.

    python docs/gen_configuration.py          # rewrite the tables in place
    python docs/gen_configuration.py --check  # exit 1 if they are out of date

Only the text between `<!-- BEGIN GENERATED: name -->` and `<!-- END GENERATED: name -->` is
replaced (one block per dataclass, from `executor.service.settings.describe`); the prose around it is
written by hand. `tests/test_docs.py` fails when the file is out of date.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.config import ExecutorConfig
from executor.service.server_config import ServerConfig
from executor.service.settings import describe

DOC = Path(__file__).resolve().parent / "configuration.md"
BLOCKS: dict[str, type] = {"executor": ExecutorConfig, "server": ServerConfig}


def _default(value: Any) -> str:
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def table(cls: type) -> str:
    rows = ["| flag | environment variable | default | meaning |", "|---|---|---|---|"]
    for _name, flag, env, default, help_text in describe(cls):
        meaning = help_text.replace("|", "\\|")
        rows.append(f"| `{flag}` | `{env}` | {_default(default)} | {meaning} |")
    return "\n".join(rows)


def render(text: str) -> str:
    """`text` with every generated block brought up to date."""
    for name, cls in BLOCKS.items():
        pattern = re.compile(
            rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.S
        )
        if not pattern.search(text):
            raise ValueError(f"{DOC.name}: no generated block for {name!r}")
        text = pattern.sub(lambda m, cls=cls: m.group(1) + table(cls) + "\n" + m.group(2), text)
    return text


def main() -> int:
    current = DOC.read_text()
    fresh = render(current)
    if "--check" in sys.argv[1:]:
        if fresh != current:
            print(f"{DOC} is out of date: run python docs/gen_configuration.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
