"""Write the values table of helm/model-executor/README.md from values.schema.json and
values.yaml, between the `values-table` markers:

    python helm/tools/values_table.py

tests/test_helm_chart.py fails when the README's table is not what this writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "model-executor"
START = "<!-- values-table:start (helm/tools/values_table.py writes this table) -->"
END = "<!-- values-table:end -->"
_MISSING = object()


def _type(prop: dict[str, Any]) -> str:
    kind = prop.get("type", "any")
    text = " or ".join(kind) if isinstance(kind, list) else kind
    if "enum" in prop and prop["enum"] and all(isinstance(v, str) for v in prop["enum"]):
        text += " (" + " \\| ".join(f"`{v}`" if v else '`""`' for v in prop["enum"]) + ")"
    return text


def _default(value: Any) -> str:
    if value is _MISSING:
        return ""
    text = json.dumps(value, separators=(", ", ": "))
    return f"`{text}`".replace("|", "\\|")


def _rows(schema: dict[str, Any], values: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    rows = []
    for key, prop in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        value = values.get(key, _MISSING) if isinstance(values, dict) else _MISSING
        if prop.get("type") == "object" and "properties" in prop:
            rows.extend(_rows(prop, value, path + "."))
        else:
            rows.append((path, _type(prop), _default(value), prop.get("description", "")))
    return rows


def table() -> str:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for path, kind, default, description in _rows(schema, values):
        if path == "global":
            continue
        description = description.replace("|", "\\|")
        lines.append(f"| `{path}` | {kind} | {default} | {description} |")
    return "\n".join(lines)


def readme_with_table(readme: str) -> str:
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main() -> int:
    path = CHART / "README.md"
    path.write_text(readme_with_table(path.read_text()))
    print(f"wrote the values table of {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
