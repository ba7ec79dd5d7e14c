"""The Keras backends the multi-process Keras tests run under, as pytest parameters.

Each parameter sets ``KERAS_BACKEND`` for the ranks; a backend whose framework is
not installed is skipped, never silently replaced by another.
"""

from __future__ import annotations

import importlib.util

import pytest

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}
_MODULE = {"tensorflow": "tensorflow", "torch": "torch", "jax": "jax"}


def keras_backends(*names: str) -> list:
    """``pytest.param`` per Keras backend, skipped when its framework is missing."""
    names = names or tuple(_MODULE)
    return [pytest.param(n, id=n, marks=pytest.mark.skipif(importlib.util.find_spec(_MODULE[n]) is None,
                                                           reason=f"{_MODULE[n]} is not installed"))
            for n in names]


def env_for(keras_backend: str, **extra: str) -> dict[str, str]:
    """The ranks' environment for ``keras_backend``."""
    return dict(ENV, KERAS_BACKEND=keras_backend, **extra)
