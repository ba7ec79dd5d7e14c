"""Horovod's ``hvd.elastic.TensorFlowState``: variables and Python attributes kept in step with rank 0.

shardwise does not add or remove workers during a run, so :func:`run` only syncs the
state and calls the function; the state object still gives the commit/restore
discipline of Horovod's elastic training (roll back to the last commit).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from .functions import broadcast_object, broadcast_variables

__all__ = ["TensorFlowState", "run"]


class TensorFlowState:
    """Variables plus keyword attributes (``batch=``, ``epoch=``...) that :meth:`sync` takes from rank 0.

    :meth:`commit` saves the current values, :meth:`restore` goes back to the last
    saved ones; :meth:`sync` broadcasts rank 0's values and saves them. Eager only
    (TF2), as in Horovod.
    """

    def __init__(self, variables: Optional[Sequence[Any]] = None, session: Any = None, **kwargs: Any) -> None:
        if variables is None:
            raise ValueError("TensorFlowState needs the list of variables to track (TF2 has no global variables)")
        self.variables = list(variables)
        self._saved_attrs = dict(kwargs)
        self._set_attrs()
        self._save_values()

    def _set_attrs(self) -> None:
        for key, value in self._saved_attrs.items():
            setattr(self, key, value)

    def _save_values(self) -> None:
        self._values = [tf.identity(v) for v in self.variables]

    def save(self) -> None:
        """Remember the current variable values and attributes."""
        self._save_values()
        self._saved_attrs = {key: getattr(self, key) for key in self._saved_attrs}

    def commit(self) -> None:
        """Save the state (Horovod also checks for host changes here; shardwise has none)."""
        self.save()

    def restore(self) -> None:
        """Go back to the last saved variable values and attributes."""
        for var, value in zip(self.variables, self._values):
            var.assign(value)
        self._set_attrs()

    def sync(self) -> None:
        """Take rank 0's variables and attributes (collective), then save them."""
        broadcast_variables(self.variables, root_rank=0)
        self._save_values()
        if self._saved_attrs:
            self._saved_attrs = broadcast_object(self._saved_attrs, root_rank=0)
            self._set_attrs()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: sync the state (first argument) from rank 0, then call ``func(state, ...)``."""
    @functools.wraps(func)
    def wrapper(state: TensorFlowState, *args: Any, **kwargs: Any) -> Any:
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper
