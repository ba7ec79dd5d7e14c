"""Pipeline parallelism for a Keras 3 ``Sequential``: :class:`~.runner.KerasPipeline` runs a
core schedule over its stage's layers; :mod:`.stage_grad` keeps each forward's backward for later."""

from __future__ import annotations

from .runner import KerasPipeline

__all__ = ["KerasPipeline"]
