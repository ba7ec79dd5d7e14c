"""The package's house (issue 54): imports run one way, core <- backends <- context <- checkpoint <-
elastic <- adapters <- the public faces, no module imports itself back through others, and no
folder keeps a pile of files named for one concept (they get a package of their own).

Every import counts, at module level or inside a function; those under ``if TYPE_CHECKING:``
never run, so they count for the layers (a type from a higher layer is still a dependency on
it) but not for cycles. Read from the source with :mod:`ast`, so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

PACKAGE = Path(__file__).resolve().parents[2] / "shardwise"

#: Layer of each top-level part of the package; a module may import its own layer or lower ones.
LAYERS = {"core": 0, "backends": 1, "context": 2, "checkpoint": 3, "elastic": 4, "adapters": 5}
FACE = 6  # shardwise/__init__, shardwise.torch, .keras, .tensorflow, .ray, .spark, .cli, .bench
FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "mpi4py", "horovod")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def layer(module: str) -> int:
    parts = module.split(".")
    return FACE if len(parts) == 1 else LAYERS.get(parts[1], FACE)


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, typing_only: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every import node under ``tree``, with whether it sits under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, typing_only
        if isinstance(child, ast.If) and _type_checking(child):
            for node in child.body:
                yield from _imports(ast.Module(body=[node], type_ignores=[]), True)
            for node in child.orelse:
                yield from _imports(ast.Module(body=[node], type_ignores=[]), typing_only)
        else:
            yield from _imports(child, typing_only)


def _owner(name: str) -> Optional[str]:
    """The package module ``name`` (a module or a name inside one) lives in, or None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module.split(".")
        if node.level:
            if not MODULES[module].name == "__init__.py":
                base = base[:-1]
            base = base[:len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix
                 for alias in node.names]
    owners = {_owner(name) for name in names if name == "shardwise" or name.startswith("shardwise.")}
    return sorted(o for o in owners if o is not None and o != module)


def edges() -> list[tuple[str, str, bool, int]]:
    """(importer, imported, typing only, line) of every import inside the package."""
    out = []
    for module, path in sorted(MODULES.items()):
        for node, typing_only in _imports(ast.parse(path.read_text(), str(path))):
            out.extend((module, target, typing_only, node.lineno) for target in _targets(module, node))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    upward = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)}) at line {line}"
              for a, b, _, line in edges() if layer(b) > layer(a)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a, b, typing_only, _ in edges():
        if not typing_only:
            graph[a].add(b)
    assert not _cycles(graph), "\n".join(" <-> ".join(c) for c in _cycles(graph))


def test_core_and_checkpoint_import_no_framework() -> None:
    found = []
    for module, path in MODULES.items():
        if layer(module) not in (LAYERS["core"], LAYERS["checkpoint"]):
            continue
        for node, _ in _imports(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{module}:{node.lineno} imports {n}" for n in names
                      if not getattr(node, "level", 0) and n.split(".")[0] in FRAMEWORKS]
    assert not found, "\n".join(found)


def test_no_folder_holds_a_pile_of_files_named_for_one_concept() -> None:
    piles = []
    for folder in sorted({p.parent for p in MODULES.values()}):
        prefixes: dict[str, list[str]] = {}
        for path in folder.glob("*.py"):
            stem = path.stem.lstrip("_")
            if "_" in stem and path.stem != "__init__":
                prefixes.setdefault(stem.split("_")[0], []).append(path.name)
        piles += [f"{folder.relative_to(PACKAGE.parent)}: {sorted(names)}"
                  for names in prefixes.values() if len(names) >= 3]
    assert not piles, "\n".join(piles)


def test_the_walk_sees_what_it_checks() -> None:
    """The walk itself: it finds relative, absolute, in-function and TYPE_CHECKING imports."""
    found = {(a, b, t) for a, b, t, _ in edges()}
    assert ("shardwise.context", "shardwise.core.errors", False) in found
    assert any(a.startswith("shardwise.adapters.torch") and b == "shardwise.context" for a, b, _ in found)
    assert any(t for _, _, t in found)  # some imports are for type checking only
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert layer("shardwise.core.mesh") < layer("shardwise.backends.mpi") < layer("shardwise.context") \
        < layer("shardwise.adapters.torch") < layer("shardwise.torch")
