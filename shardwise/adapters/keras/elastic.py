"""Horovod's ``hvd.elastic`` for Keras 3: :class:`KerasState`, the state callbacks and :func:`run`.

``KerasState(model, optimizer=None, epoch=0, batch=0)`` commits host copies of the
model's weights and the optimizer's variables and brings new workers to rank 0's
values by broadcast. After a reset a :class:`~.optimizer.DistributedOptimizer`
follows the new world: its torch backward overlap (which holds the old
communicator) is rebuilt, and the model's train function is traced again (on
TensorFlow and JAX the traced step holds the old communicator). Training runs in
``model.fit`` with :class:`CommitStateCallback`, :class:`UpdateBatchStateCallback`
and :class:`UpdateEpochStateCallback`, inside a function wrapped by :func:`run`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import keras
import numpy as np

from ...context import abort_connections
from ...core.errors import CollectiveTimeoutError, ConfigError, WorkerLostError, is_peer_loss
from ...elastic.run import run_fn
from ...elastic.state import ObjectState, State
from ..horovod.process_sets import shutdown_coordinators
from . import hvd_portable
from .bridges import backend_name
from .hooks import distributed_in
from .ops import broadcast_variables, sync_backend_state
from ... import context

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


def _init_and_shutdown() -> tuple[Callable[..., None], Callable[[], None]]:
    """The ``init`` and ``shutdown`` that :mod:`shardwise.keras` has on the running Keras backend."""
    if backend_name() == "tensorflow":
        from ..tensorflow import basics  # TensorFlow is imported only where it is the backend

        return basics.init, basics.shutdown
    return hvd_portable.init, hvd_portable.shutdown


def _reset(lost: bool) -> None:
    """Horovod's reset: shut down (abruptly, without collectives, if a rank was ``lost``) and init again."""
    init, shutdown_world = _init_and_shutdown()
    if context.is_initialized() and context.current().backend == "torch":
        from ..torch.basics import abandon, shutdown  # also stops the gloo worker threads

        abandon() if lost else shutdown()
    elif lost:
        if context.is_initialized():
            abort_connections(context.current())
            shutdown_coordinators(context.current())
        context.shutdown()
    else:
        shutdown_world()
    init()


def _graph_error(exc: BaseException) -> Optional[BaseException]:
    """The lost worker or collective timeout behind a TensorFlow or JAX runtime error, or ``None``.

    The collectives of a traced step run in ``tf.numpy_function`` or a JAX
    ``io_callback``; the framework re-raises their errors as its own, with the
    Python error in the message only.
    """
    if type(exc).__module__.split(".")[0] not in ("tensorflow", "jax", "jaxlib"):
        return None
    text = str(exc)
    if "CollectiveTimeoutError" in text:
        return CollectiveTimeoutError(text)
    if "WorkerLostError" in text or is_peer_loss(RuntimeError(text)):
        return WorkerLostError(text)
    return None


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: ``func(state, ...)`` survives lost and added workers (see :func:`shardwise.elastic.run_fn`)."""

    @functools.wraps(func)
    def attempt(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            lost = _graph_error(exc)
            if lost is None:
                raise
            raise lost from exc

    return run_fn(attempt, _reset)


class KerasState(ObjectState):
    """A Keras training's elastic state: the model's weights, the optimizer's variables and other attributes.

    ``optimizer`` defaults to the compiled ``model.optimizer``; it is built here if
    it is not yet, so that every worker, a newcomer too, commits and broadcasts the
    same variables. Keyword arguments (``epoch=0, batch=0, ...``) become
    attributes committed by deep copy, as in :class:`~shardwise.elastic.ObjectState`.
    """

    def __init__(self, model: keras.Model, optimizer: Optional[keras.optimizers.Optimizer] = None,
                 **kwargs: Any) -> None:
        if not model.built:
            raise ConfigError("KerasState needs a built model: give it an Input or call model.build(input_shape)")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ConfigError("KerasState needs an optimizer: compile the model first or pass optimizer=")
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.model, self.optimizer = model, optimizer
        self._saved_weights: list[np.ndarray] = []
        self._saved_optimizer: list[np.ndarray] = []
        self._save_model()
        super().__init__(**kwargs)

    def _variables(self) -> tuple[list[Any], list[Any]]:
        return list(self.model.weights), list(self.optimizer.variables)

    def _save_model(self) -> None:
        weights, opt_vars = self._variables()
        self._saved_weights = [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in weights]
        self._saved_optimizer = [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in opt_vars]

    def save(self) -> None:
        """Copy the weights, the optimizer's variables and the attributes to host memory."""
        self._save_model()
        super().save()

    def restore(self) -> None:
        """Back to the last commit; a torch backward overlap's step in flight is dropped (no collective)."""
        dist = distributed_in(self.optimizer)
        if dist is not None:
            dist.drop_overlap()
        weights, opt_vars = self._variables()
        if len(opt_vars) != len(self._saved_optimizer):
            raise ConfigError(f"the optimizer has {len(opt_vars)} variables, the commit {len(self._saved_optimizer)}")
        for var, value in zip(weights + opt_vars, self._saved_weights + self._saved_optimizer):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        """Rank 0's weights, optimizer variables and attributes on every rank (then kept as the commit)."""
        weights, opt_vars = self._variables()
        broadcast_variables(weights + opt_vars, 0)
        self._save_model()
        super().sync()

    def reset(self) -> None:
        """Follow the new world: rebuild the torch overlap and the traced train step."""
        dist = distributed_in(self.optimizer)
        if dist is not None:
            dist.rebind()
        if getattr(self.model, "train_function", None) is not None:
            self.model.train_function = None  # traced afresh by the next fit


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of each epoch (Horovod's).

    Put it after :class:`UpdateBatchStateCallback` and :class:`UpdateEpochStateCallback`
    in the callback list, so that the commit holds the updated batch and epoch.
    A commit due on an epoch's last batch (when ``fit`` knows its steps) is left to
    the epoch-end commit just after it: committed, that batch would say "every
    batch of this epoch done" with the epoch not yet counted, and a restore there
    would run one batch too many. A commit also checks for added or lost workers
    (:meth:`State.check_host_updates`).
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ConfigError(f"batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.batches_remaining = self.batches_per_commit  # the same count on every rank after a reset

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            steps = self.params.get("steps") if self.params else None
            if not (steps and int(batch) + 1 >= int(steps)):  # the epoch's last batch: on_epoch_end commits
                self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.commit()

    def commit(self) -> None:
        """Commit the state (on JAX, after writing ``fit``'s in-flight values back into the variables)."""
        sync_backend_state(self.model)
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of batches done in the current epoch; 0 at the end of an epoch.

    Horovod stores the index of the last batch instead, which repeats one batch
    after a reset. When ``fit`` knows its steps per epoch, the first epoch after a
    reset is shortened by the batches already done, as in Horovod; Keras 3 does not
    read ``params['steps']`` back, so that epoch is ended by ``model.stop_training``,
    which this callback clears again at the epoch's end (put callbacks that stop
    training at an epoch's end, such as ``EarlyStopping``, after this one). The
    data must then resume where the commit left off (e.g. a generator started at
    ``state.batch``).
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: Optional[int] = None
        self._offset = 0
        self._stopping = False

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.steps_per_epoch = None
        self._offset = int(getattr(self.state, "batch", 0) or 0)
        self._stopping = False

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = int(self.params["steps"])
            self.params["steps"] = self.steps_per_epoch - self._offset

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = self._offset + int(batch) + 1
        if self._offset and self.steps_per_epoch and self.state.batch >= self.steps_per_epoch:
            self.model.stop_training = self._stopping = True  # the resumed epoch is complete

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = 0
        self._offset = 0
        if self._stopping:
            self.model.stop_training = self._stopping = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Set ``state.epoch`` to the number of epochs done at the end of each epoch (Horovod's).

    ``fit``'s epochs count from the ``state.epoch`` it started at: call it as
    ``fit(epochs=total - state.epoch)`` (Horovod's way) or
    ``fit(initial_epoch=state.epoch, epochs=total)``.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = int(getattr(state, "epoch", 0) or 0)
        self._first_epoch: Optional[int] = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.initial_epoch = int(getattr(self.state, "epoch", 0) or 0)
        self._first_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self._first_epoch is None:
            self._first_epoch = int(epoch)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        first = self._first_epoch if self._first_epoch is not None else 0
        self.state.epoch = self.initial_epoch + int(epoch) - first + 1
