"""Communicator implementations, one package per engine, started and created by name.

Each engine's package (``mpi``, ``torch``, ``tf``, ``horovod``, ``local``) exports its
communicator and ``init(launch, timeout)``, which starts the engine and returns what the
context then owns; :func:`engine` finds the package, :func:`create` the world communicator.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

from ..core.comm import Communicator
from ..core.errors import BackendError

__all__ = ["BACKENDS", "available_backends", "backend_status", "check_backend", "create", "engine"]

#: Backend name -> (its package, the Python package it needs).
BACKENDS = {
    "local": ("shardwise.backends.local", None),
    "mpi": ("shardwise.backends.mpi", "mpi4py"),
    "torch": ("shardwise.backends.torch", "torch"),
    "tf": ("shardwise.backends.tf", "tensorflow"),
    "horovod": ("shardwise.backends.horovod", "horovod"),
}


def backend_status() -> dict[str, str]:
    """For each backend: ``"available"`` or why it is not."""
    status = {}
    for name, (_, needs) in BACKENDS.items():
        if needs is None or importlib.util.find_spec(needs) is not None:
            status[name] = "available"
        else:
            status[name] = f"missing Python package '{needs}'"
    return status


def available_backends() -> list[str]:
    """Names of the backends whose engine is installed."""
    return [n for n, s in backend_status().items() if s == "available"]


def check_backend(name: str) -> None:
    """Raise :class:`BackendError` naming what is installed if ``name`` cannot be used."""
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)} "
                           f"(installed: {', '.join(available_backends())})")
    status = backend_status()[name]
    if status != "available":
        raise BackendError(f"backend {name!r} is not usable: {status}; "
                           f"installed backends: {', '.join(available_backends())}")


def engine(name: str) -> ModuleType:
    """The package of backend ``name``; its ``init(launch, timeout)`` starts the engine."""
    check_backend(name)
    return importlib.import_module(BACKENDS[name][0])


def create(name: str, **kwargs: Any) -> Communicator:
    """A world communicator of backend ``name`` (its engine must already be initialised)."""
    check_backend(name)
    if name == "local":
        from .local import LocalCommunicator
        return LocalCommunicator()
    if name == "mpi":
        from .mpi import MPICommunicator
        return MPICommunicator(**kwargs)
    if name == "horovod":
        from .horovod import HorovodCommunicator
        return HorovodCommunicator(**kwargs)
    if name == "tf":
        from .tf import TFCommunicator
        return TFCommunicator(**kwargs)
    from .torch import TorchCommunicator
    return TorchCommunicator(**kwargs)
