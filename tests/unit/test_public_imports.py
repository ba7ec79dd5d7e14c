"""Examples and documentation import only shardwise's public modules.

What users copy must keep working while the internals move: every ``examples/*.py`` and every
```python snippet of README.md and docs/*.md may import ``shardwise``, ``shardwise.torch[.x]``,
``shardwise.keras[.x]``, ``shardwise.tensorflow``, ``shardwise.checkpoint``, ``shardwise.ray``, ``shardwise.spark[.torch|.keras]`` and
``shardwise.cli``, but never ``shardwise.adapters``, ``shardwise.core``, ``shardwise.backends`` or a
``_private`` module or name. Parsing only: nothing is imported here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INTERNAL = ("adapters", "core", "backends")
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _snippets() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        where = page.relative_to(ROOT).as_posix()
        out += [(f"{where}:{text[:m.start()].count(chr(10)) + 2}", m.group(1))
                for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]
    return out


def internal_imports(source: str) -> list[str]:
    """The shardwise modules (or names) ``source`` imports that are not public."""
    bad = []

    def check(module: str, names: tuple[str, ...] = ()) -> None:
        parts = module.split(".")
        if parts[0] != "shardwise":
            return
        if (len(parts) > 1 and parts[1] in INTERNAL) or any(p.startswith("_") for p in parts[1:]):
            bad.append(module)
        bad.extend(f"{module}.{n}" for n in names if n.startswith("_"))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # a relative import is the package's own business, never a user's
                bad.append("." * node.level + (node.module or ""))
            elif node.module:
                check(node.module, tuple(a.name for a in node.names))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            if isinstance(node.args[0].value, str):
                check(node.args[0].value)
    return bad


def test_the_check_catches_internal_imports():
    assert internal_imports("from shardwise.adapters.torch.parallel import build_groups") \
        == ["shardwise.adapters.torch.parallel"]
    assert internal_imports("import shardwise.core.pipeline as p") == ["shardwise.core.pipeline"]
    assert internal_imports("from shardwise.backends import create") == ["shardwise.backends"]
    assert internal_imports("from shardwise.torch import _private") == ["shardwise.torch._private"]
    assert internal_imports("import shardwise.torch._impl") == ["shardwise.torch._impl"]
    assert internal_imports("importlib.import_module('shardwise.core.mesh')") == ["shardwise.core.mesh"]
    assert internal_imports("import shardwise, shardwise.torch as hvd\n"
                            "from shardwise.torch.parallel import parallelize\n"
                            "from shardwise.keras import callbacks\nimport torch.nn") == []


def test_there_is_something_to_check():
    assert len(EXAMPLES) >= 5
    assert len(_snippets()) >= 8


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_imports_only_public_modules(path):
    bad = internal_imports(path.read_text())
    assert not bad, f"examples/{path.name} imports internal modules {bad}: import from shardwise.torch[.parallel|" \
                    f".embedding|.checkpoint], shardwise.keras, shardwise.tensorflow, shardwise.checkpoint instead"


@pytest.mark.parametrize("where, source", _snippets(), ids=[w for w, _ in _snippets()])
def test_doc_snippet_imports_only_public_modules(where, source):
    bad = internal_imports(source)
    assert not bad, f"{where}: snippet imports internal modules {bad}"


def test_torch_topic_modules_reexport_the_flat_names():
    pytest.importorskip("torch")
    import shardwise.torch as hvd
    from shardwise.torch import checkpoint, embedding, parallel

    assert hvd.parallel is parallel and hvd.embedding is embedding and hvd.checkpoint is checkpoint
    for module in (parallel, embedding, checkpoint):
        assert module.__all__, module.__name__
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
            if hasattr(hvd, name):  # the flat name (kept for back-compat) is the same object
                assert getattr(hvd, name) is getattr(module, name), name
    # every flat name of shardwise.torch still resolves (Horovod's API and shardwise's additions)
    assert len(hvd.__all__) >= 108 and all(hasattr(hvd, n) for n in hvd.__all__)
    for name in ("parallelize", "ParallelLayout", "ZeroOptimizer", "PipelineExecutor", "build_schedule",
                 "ColumnParallelLinear", "TrainingConfig"):
        assert name in parallel.__all__, name
    assert {"ShardedEmbeddingBagCollection", "full_table", "plan_tables"} <= set(embedding.__all__)
    assert {"save_training", "restore_training", "load_zero_checkpoint"} <= set(checkpoint.__all__)
