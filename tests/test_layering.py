"""The package layout's import rules, checked on the source with `ast` (nothing is imported).

Floors: `executor/core/` (the vocabulary) imports nothing of the executor above it; the
folders of `executor/` (and the modules directly in it) form no import cycle at run time;
`executor/step/` is the roof of the engine, imported only by the executor that builds it and
by the service side. The step engine (everything in `executor/` but `service/`,
`observability/` and `client/`) never reaches gRPC, prometheus-client, OpenTelemetry or the
generated wire stubs: it reports through `executor.core.observer` and the service adapts. That
rule is transitive and counts every import statement, lazy ones inside functions and
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


SERVICE_SIDE = ("executor.service", "executor.observability", "executor.client")


def engine_modules() -> list[str]:
    """The engine's modules: everything in `executor/` but the service side. `__main__.py` is
    not one: it is the `python -m executor` entry, a one-line shim that runs the CLI."""
    return [
        m
        for m in _modules_under(ROOT / "executor", recursive=True)
        if m != "executor.__main__" and not m.startswith(SERVICE_SIDE)
    ]


def unit(module: str) -> str:
    """The unit the floors are drawn between: a subpackage of `executor/` (`executor.step`),
    or a module directly in `executor/` (`executor.config`)."""
    parts = module.split(".")
    if parts[0] != "executor" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2])


def unit_graph() -> dict[str, set[str]]:
    """unit -> the units its modules import at run time (type-only imports left out)."""
    graph: dict[str, set[str]] = {}
    for module in _modules_under(ROOT / "executor", recursive=True):
        src = unit(module)
        for target in direct_imports(module, runtime_only=True):
            dst = unit(target)
            if target.startswith("executor.") and dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_folders_of_the_executor_form_no_import_cycle() -> None:
    """The floors: at run time no folder of `executor/` (nor a module directly in it) reaches
    back to itself through another."""
    assert cycles(unit_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_core_imports_nothing_of_the_executor_above_it() -> None:
    for module in _modules_under(ROOT / "executor" / "core", recursive=True):
        above = sorted(
            t
            for t in direct_imports(module)
            if t.startswith("executor.") and not t.startswith("executor.core")
        )
        assert above == [], f"{module} imports {above}"


# `step/` is the engine's roof: only the executor that builds it (and the service side) use it.
STEP_USERS = ("executor.model_executor", "executor.tp_worker", "executor.step", *SERVICE_SIDE)


def test_nothing_below_the_step_imports_it() -> None:
    for module in engine_modules():
        if module.startswith(STEP_USERS):
            continue
        reached = sorted(t for t in direct_imports(module) if unit(t) == "executor.step")
        assert reached == [], f"{module} (below step/) imports {reached}"


def test_the_engine_is_what_the_layout_says() -> None:
    names = engine_modules()
    assert "executor.model_executor" in names
    assert "executor.graphs.decode_runner" in names
    assert "executor.models.llama" in names
    assert "executor.core.forward_batch" in names and "executor.controls.state" in names
    assert not any(n.startswith(SERVICE_SIDE) for n in names)
    top_level = [n for n in names if n.count(".") == 1 and not _is_package(n)]
    assert len(top_level) <= 12, f"executor/ holds {len(top_level)} modules: {top_level}"


@pytest.mark.slow
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
    assert "executor.core.forward_batch" in direct_imports("attention.torch_paged")
    assert "executor.core.forward_batch" not in direct_imports(
        "attention.torch_paged", runtime_only=True
    )
