"""The README's and every docs/*.md page's Python snippets import only public modules, and every name they
use from shardwise exists.

Each ```python block of README.md and docs/*.md is parsed; its ``import``/``from ... import``
statements are resolved and every attribute chain read from a shardwise module
(``hvd.callbacks.BroadcastGlobalVariablesCallback``, ``shardwise.ray.run``) is looked up. The look-ups
run in a fresh interpreter, because importing ``shardwise.tensorflow`` configures TensorFlow's threads
for the whole process.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {"shardwise", "shardwise.torch", "shardwise.keras", "shardwise.tensorflow", "shardwise.ray", "shardwise.spark",
          "shardwise.spark.torch", "shardwise.spark.keras",
          "shardwise.checkpoint", "shardwise.torch.parallel", "shardwise.torch.embedding", "shardwise.torch.checkpoint",
          "shardwise.torch.elastic", "shardwise.keras.callbacks", "shardwise.keras.elastic", "shardwise.keras.zero",
          "shardwise.cli"}
#: The pages whose snippets are checked: the README and every page under docs/.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_CHECK = r'''
import importlib, json, sys
missing = []
for module, chain in json.loads(sys.stdin.read()):
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        missing.append(f"import {module}: {exc}")
        continue
    for i, attr in enumerate(chain):
        if not hasattr(obj, attr):
            missing.append(f"{module}.{'.'.join(chain[:i + 1])}")
            break
        obj = getattr(obj, attr)
print(json.dumps(missing))
'''


def _page_snippets(page: Path) -> list[tuple[str, str]]:
    """(``page:line``, source) of each ```python block of ``page``."""
    text = page.read_text()
    where = page.relative_to(ROOT).as_posix()
    return [(f"{where}:{text[:m.start()].count(chr(10)) + 2}", m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def _snippets() -> list[tuple[str, str]]:
    return [s for page in PAGES for s in _page_snippets(page)]


def _chain(node: ast.AST) -> list[str]:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
        return names[::-1]
    return []


def _uses(source: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(module, attribute chain) pairs the snippet reads, and its imports of non-public shardwise modules."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    uses, private = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "shardwise":
                    continue
                if a.name not in PUBLIC:
                    private.append(a.name)
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    aliases.setdefault("shardwise", "shardwise")
                uses.append((a.name, []))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "shardwise":
            if node.module not in PUBLIC:
                private.append(node.module)
            uses.extend((node.module, [a.name]) for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):  # every prefix of a chain too: each must exist anyway
            chain = _chain(node)
            if chain and chain[0] in aliases:
                module, rest = aliases[chain[0]], chain[1:]
                # ``shardwise.ray.run`` after ``import shardwise.ray``: the longest imported module wins
                while rest and f"{module}.{rest[0]}" in PUBLIC:
                    module, rest = f"{module}.{rest[0]}", rest[1:]
                uses.append((module, rest))
    return uses, private


def test_readme_has_python_snippets():
    assert len(_snippets()) >= 8
    # the README keeps one example per kind of user; the rest lives in docs/
    assert len(_page_snippets(ROOT / "README.md")) >= 4
    assert any(page.parent.name == "docs" for page in PAGES)


@pytest.mark.parametrize("line, source", _snippets(), ids=[where for where, _ in _snippets()])
def test_snippet_imports_only_public_modules(line, source):
    _, private = _uses(source)
    assert not private, f"{line}: snippet imports internal modules {private}; use {sorted(PUBLIC)}"


@pytest.mark.timeout(180)
def test_every_shardwise_name_in_the_snippets_exists():
    pytest.importorskip("torch")
    pytest.importorskip("keras")
    uses = sorted({(m, tuple(c)) for _, src in _snippets() for m, c in _uses(src)[0]})
    assert any(m == "shardwise.keras" for m, _ in uses) and any(m == "shardwise.torch" for m, _ in uses)
    out = subprocess.run([sys.executable, "-c", _CHECK], input=json.dumps(uses), capture_output=True, text=True,
                         cwd=ROOT, timeout=170, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    missing = json.loads(out.stdout.strip().splitlines()[-1])
    assert not missing, f"README/docs snippets use names that do not exist: {missing}"


def test_files_the_pages_name_exist():
    """A path in backticks (``shardwise/core/memory.py``, ``adapters/torch/zero/``, ``examples/dlrm.py``)
    names a file or folder of this repository, so pages follow the code when it moves."""
    roots = ("shardwise", "benchmarks", "examples", "tests", "scripts", "docs", "core", "backends", "adapters",
             "checkpoint", "cli", "elastic", "ray")
    pattern = re.compile(r"`((?:%s)/[\w/.-]*)`" % "|".join(roots))
    missing = []
    for page in PAGES:
        for m in pattern.finditer(page.read_text()):
            path = m.group(1).rstrip(".")
            if not ((ROOT / path).exists() or (ROOT / "shardwise" / path).exists()):
                missing.append(f"{page.relative_to(ROOT).as_posix()}: {path}")
    assert not missing, f"pages name files that do not exist: {missing}"
