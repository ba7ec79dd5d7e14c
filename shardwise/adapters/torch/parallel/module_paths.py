"""Submodules of a torch model by dotted path, with ``*`` standing for any one name."""

from __future__ import annotations

import re

from torch import nn

from ....core.errors import ConfigError

__all__ = ["get_module", "set_module", "matching_modules"]


def get_module(root: nn.Module, path: str) -> nn.Module:
    """The submodule at dotted ``path`` (``"transformer.h"``)."""
    try:
        return root.get_submodule(path)
    except AttributeError as exc:
        raise ConfigError(f"{type(root).__name__} has no module {path!r}: {exc}") from None


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    """Replace the submodule at dotted ``path``."""
    parent, _, name = path.rpartition(".")
    setattr(get_module(root, parent) if parent else root, name, module)


def _pattern(path: str) -> "re.Pattern[str]":
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in path.split(".")) + "$")


def matching_modules(root: nn.Module, path: str) -> list[str]:
    """Names of ``root``'s submodules at dotted ``path``, where ``*`` stands for any one name."""
    if "*" not in path:
        try:
            root.get_submodule(path)
        except AttributeError:
            return []
        return [path]
    pattern = _pattern(path)
    return [name for name, _ in root.named_modules() if name and pattern.match(name)]
