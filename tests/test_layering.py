"""The package layout's import rules, checked on the source with `ast` (nothing is imported).

The step engine (`executor/*.py`, `executor/graphs/`, `executor/models/`) never reaches the
gRPC service, the observability adapters, the client side, gRPC, prometheus-client,
OpenTelemetry or the generated wire stubs: it reports through `executor.observer` and the
service adapts. The rule is transitive (an engine module that imports a helper that imports
grpc breaks it too) and counts every import statement, lazy ones inside functions and
`TYPE_CHECKING` blocks included. Below the engine, `ops` <- `registry` / `attention` <-
`executor` holds as the architecture says; above it, observability never imports the service
or the client, and the service never imports the client. Those layer rules are about what
runs: a type-only import (`if TYPE_CHECKING:`) may name an upper layer's types, as the
attention backends name `ForwardBatch` and the KV pools they are handed.
"""

from __future__ import annotations

import ast
from collections import deque
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("executor", "attention", "ops", "registry")

ENGINE_FORBIDDEN = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "prometheus_client",
    "opentelemetry",
    "model_executor",  # the generated wire stubs
    "executor.service",
    "executor.observability",
    "executor.client",
)
RULES: dict[str, tuple[str, ...]] = {
    "ops": ("registry", "attention", "executor"),
    "registry": ("attention", "executor"),
    "attention": ("executor",),
    "executor.observability": ("executor.service", "executor.client"),
    "executor.service": ("executor.client",),
}


def _module_path(name: str) -> Path | None:
    """The source file of a first-party module or package, None for anything else."""
    parts = name.split(".")
    if parts[0] not in FIRST_PARTY:
        return None
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_package(name: str) -> bool:
    path = _module_path(name)
    return path is not None and path.name == "__init__.py"


def _type_only_imports(tree: ast.Module) -> set[int]:
    """The ids of import nodes inside `if TYPE_CHECKING:` blocks."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                ids.update(id(n) for n in ast.walk(stmt))
    return ids


@cache
def direct_imports(name: str, *, runtime_only: bool = False) -> frozenset[str]:
    """Every module a first-party module names in an import statement, absolute, with the
    parent packages Python runs on the way (importing `a.b.c` runs `a` and `a.b` first).
    `runtime_only` leaves out the imports under `if TYPE_CHECKING:`."""
    path = _module_path(name)
    assert path is not None, name
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(name) else name.rpartition(".")[0]
    skip = _type_only_imports(tree) if runtime_only else set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                base = node.module or ""
            found.add(base)
            # `from pkg import mod` imports the submodule `pkg.mod` when there is one.
            found.update(
                f"{base}.{alias.name}"
                for alias in node.names
                if _module_path(f"{base}.{alias.name}")
            )
    with_parents = set(found)
    for mod in found:
        parts = mod.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts)))
    with_parents.discard(name)
    return frozenset(with_parents)


def _reaches(name: str, banned: tuple[str, ...], *, runtime_only: bool = False) -> list[str] | None:
    """The shortest import chain from `name` to a banned module, or None."""

    def is_banned(mod: str) -> bool:
        return any(mod == b or mod.startswith(b + ".") for b in banned)

    parent: dict[str, str | None] = {name: None}
    queue = deque([name])
    while queue:
        current = queue.popleft()
        for mod in sorted(direct_imports(current, runtime_only=runtime_only)):
            if mod in parent:
                continue
            parent[mod] = current
            if is_banned(mod):
                chain = [mod]
                step: str | None = current
                while step is not None:
                    chain.append(step)
                    step = parent[step]
                return chain[::-1]
            if _module_path(mod) is not None:
                queue.append(mod)
    return None


def _modules_under(folder: Path, *, recursive: bool) -> list[str]:
    files = folder.rglob("*.py") if recursive else folder.glob("*.py")
    return sorted(_module_name(p) for p in files)


def engine_modules() -> list[str]:
    """The engine's modules. `executor/__main__.py` is not one: it is the `python -m executor`
    entry, a one-line shim that runs the client side's CLI."""
    executor = ROOT / "executor"
    return [
        *(m for m in _modules_under(executor, recursive=False) if m != "executor.__main__"),
        *_modules_under(executor / "graphs", recursive=True),
        *_modules_under(executor / "models", recursive=True),
        *_modules_under(executor / "step", recursive=True),
    ]


def test_the_engine_is_what_the_layout_says() -> None:
    names = engine_modules()
    assert "executor.model_executor" in names
    assert "executor.graphs.decode_runner" in names
    assert "executor.models.llama" in names
    assert not any(n.startswith(("executor.service", "executor.client")) for n in names)
    top_level = [n for n in names if n.count(".") == 1 and not _is_package(n)]
    assert len(top_level) <= 12, f"executor/ holds {len(top_level)} modules: {top_level}"


@pytest.mark.parametrize("module", engine_modules())
def test_engine_module_never_reaches_the_service_side(module: str) -> None:
    chain = _reaches(module, ENGINE_FORBIDDEN)
    assert chain is None, "the engine reaches the service side: " + " -> ".join(chain)


@pytest.mark.parametrize("package", sorted(RULES))
def test_lower_layers_never_import_upper_ones(package: str) -> None:
    folder = ROOT.joinpath(*package.split("."))
    for module in _modules_under(folder, recursive=True):
        chain = _reaches(module, RULES[package], runtime_only=True)
        assert chain is None, f"{package} reaches upward: " + " -> ".join(chain)


def test_the_walker_sees_lazy_type_only_and_transitive_imports() -> None:
    """The rule checker itself: a lazy import inside a function, a type-only import and a
    chain through a helper each count (so a violation cannot hide behind one of them)."""
    # lazy: the CLI imports the server inside `cmd_serve`
    assert "executor.service.server" in direct_imports("executor.client.cli")
    # a real chain in the tree: the service's server reaches grpc through its own import
    assert _reaches("executor.service.server", ("grpc",)) == ["executor.service.server", "grpc"]
    # transitive: the CLI reaches grpc only through other modules
    chain = _reaches("executor.client.cli", ("prometheus_client",))
    assert chain is not None and len(chain) > 2
    # a type-only import counts for the engine rule, not for the runtime layer rules
    assert "executor.forward_batch" in direct_imports("attention.torch_paged")
    assert "executor.forward_batch" not in direct_imports(
        "attention.torch_paged", runtime_only=True
    )
