"""A CPU-side guard for device correctness: tensor factory calls in shardwise that name no device.

On a machine without a GPU every tensor is a CPU tensor, so a path that creates its
flag, norm or buffer on the CPU next to CUDA parameters looks exactly like a correct
one. What *can* be seen on a CPU is the cause: a ``torch.zeros(...)`` / ``torch.tensor(...)``
(any factory that makes a tensor from nothing) called from shardwise without ``device=``
lands on the default device, whatever device the user's tensors are on.
:class:`FactoryCallsWithoutDevice` records such calls, by file and line, while a
training step runs; the scenarios of ``device_correct.py`` fail when it saw one. The
``*_like`` factories and ``new_*`` methods follow their input's device and are not
counted; tensors that are meant to live on the host say ``device="cpu"``.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

import shardwise

__all__ = ["FactoryCallsWithoutDevice"]

#: Factories that create a tensor from nothing (on the default device unless told).
FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
                       "eye", "linspace", "empty_strided", "scalar_tensor"})
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SHARDWISE_DIR = os.path.dirname(shardwise.__file__) + os.sep


class FactoryCallsWithoutDevice(TorchFunctionMode):
    """Records ``file:line torch.<factory>`` for each deviceless factory call made from ``package_dir``."""

    def __init__(self, package_dir: Optional[str] = None) -> None:
        super().__init__()
        self.package_dir = package_dir or _SHARDWISE_DIR
        self.found: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FACTORIES and kwargs.get("device") is None:
            site = self._caller()
            if site is not None:
                self.found.append(f"{site} torch.{name}")
        return func(*args, **kwargs)

    def _caller(self) -> Optional[str]:
        """The first frame outside torch and this module: reported when it is in ``package_dir``."""
        frame = sys._getframe(1)
        here = os.path.abspath(__file__)
        while frame is not None:
            filename = os.path.abspath(frame.f_code.co_filename)
            if filename == here or filename.startswith(_TORCH_DIR):
                frame = frame.f_back
                continue
            if filename.startswith(self.package_dir):
                return f"{os.path.relpath(filename, os.path.dirname(self.package_dir.rstrip(os.sep)))}:{frame.f_lineno}"
            return None
        return None
