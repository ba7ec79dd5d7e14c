"""Keras 3 callbacks with Horovod's semantics: broadcast, metric averaging, LR warmup/schedule, checkpoints.

They run on every Keras backend. A multi-rank :class:`DistributedOptimizer` needs
none of them to train safely: it turns ``jit_compile`` off on TensorFlow and gives
a ``LossScaleOptimizer`` around it a finite check shared by all ranks by itself
(see :mod:`.hooks`); the callbacks repeat both at the start of training, which
changes nothing when it is done already. On JAX, where ``fit`` keeps the model's
state outside its variables during an epoch, callbacks sync that state before
they read or write variables between steps.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import keras
import numpy as np

from ...core.comm import Communicator
from ...core.errors import ConfigError
from .checkpoint import save_checkpoint
from .hooks import disable_xla, find_distributed_optimizer, share_finite_check, unwrap_optimizer
from .ops import broadcast_variables, sync_backend_state, world

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint", "ShardedCheckpoint"]


class _ShardwiseCallback(keras.callbacks.Callback):
    """Base: resolves the communicator lazily; re-checks XLA and loss scaling (idempotent, see :mod:`.hooks`)."""

    def __init__(self, comm: Optional[Communicator] = None) -> None:
        super().__init__()
        self._comm = comm

    @property
    def comm(self) -> Communicator:
        return world(self._comm)

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        disable_xla(self.model)
        share_finite_check(self.model)


class BroadcastGlobalVariablesCallback(_ShardwiseCallback):
    """Copy ``root_rank``'s model and optimizer variables to every rank once, before training.

    Done at the start of training when the model is built (its optimizer is built
    then too); otherwise after the first batch, as Horovod does. ``local_variables``
    are left as they are on each rank; ``device`` is accepted for Horovod
    compatibility (the collective runs where the backend runs it).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Optional[Sequence[Any]] = None, *,
                 comm: Optional[Communicator] = None) -> None:
        super().__init__(comm)
        self.root_rank = int(root_rank)
        self.local_variables = {id(v) for v in (local_variables or [])}
        self.broadcast_done = False

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        super().on_train_begin(logs)
        self.broadcast_done = False
        if getattr(self.model, "built", False) and self.model.variables:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self) -> None:
        sync_backend_state(self.model)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built and self.model.trainable_variables:
            optimizer.build(self.model.trainable_variables)
        variables = list(self.model.variables)
        if optimizer is not None:
            # ZeRO slots and shards differ per rank by design: never overwrite them with the root's.
            dist = find_distributed_optimizer(self.model)
            sharded = {id(v) for v in getattr(dist, "sharded_variables", [])} if dist is not None else set()
            if getattr(dist, "stage", None) == 3 and dist.built:
                # ZeRO-3's trainable variables live in its shards, cut from rank 0's values when it was built.
                sharded |= {id(v) for v in self.model.trainable_variables}
                variables = [v for v in variables if id(v) not in sharded]
            variables += [v for v in optimizer.variables if id(v) not in sharded]
        variables = [v for v in variables if id(v) not in self.local_variables]
        broadcast_variables(variables, self.root_rank, comm=self._comm)
        self.broadcast_done = True


class MetricAverageCallback(_ShardwiseCallback):
    """Replace each epoch's logs by their average over ranks (place it before callbacks that read them)."""

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        comm = self.comm
        if logs is None or comm.size == 1:
            return
        mine = sorted((k, float(v)) for k, v in logs.items() if _is_number(v))
        every = comm.allgather_object(mine)
        keys = [k for k, _ in mine]
        for r, theirs in enumerate(every):
            if [k for k, _ in theirs] != keys:
                raise ConfigError(f"MetricAverageCallback: rank {r} logged metrics {[k for k, _ in theirs]}, "
                                  f"rank {comm.rank} logged {keys}")
        for j, key in enumerate(keys):
            logs[key] = sum(theirs[j][1] for theirs in every) / len(every)


def _is_number(value: Any) -> bool:
    try:
        return np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.number)
    except (TypeError, ValueError):
        return False


def _get_lr(optimizer: Any) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(_ShardwiseCallback):
    """Set the LR to ``initial_lr * multiplier(epoch)`` during epochs ``[start_epoch, end_epoch)``.

    ``multiplier`` is a function of the (fractional) epoch or a number ``m`` meaning
    ``m ** epoch``. With ``staircase`` the LR changes at each epoch's first batch,
    otherwise at every batch (epoch + batch / steps_per_epoch). ``momentum_correction``
    rescales SGD momentum buffers by new_lr / old_lr when the LR changes
    (Goyal et al. 2017; Horovod's scaled momentum for one batch, which Keras 3
    cannot change inside a traced step).
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None, *,
                 comm: Optional[Communicator] = None) -> None:
        super().__init__(comm)
        if initial_lr is None:
            raise ConfigError("initial_lr is required")
        self.initial_lr = float(initial_lr)
        self.multiplier: Callable[[float], float] = (
            multiplier if callable(multiplier) else (lambda epoch, m=float(multiplier): m ** epoch))
        self.start_epoch = int(start_epoch)
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        super().on_train_begin(logs)
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ConfigError(f"{type(self).__name__}: cannot detect the number of steps per epoch; "
                                  "pass steps_per_epoch=")
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust(epoch)
        else:
            self._adjust(epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)

    def _adjust(self, epoch: float) -> None:
        sync_backend_state(self.model)
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and old_lr > 0 and new_lr != old_lr:
            _scale_momentum(optimizer, new_lr / old_lr)


def _scale_momentum(optimizer: Any, ratio: float) -> None:
    """Multiply an SGD-style optimizer's momentum buffers by ``ratio`` (no-op for others)."""
    inner = unwrap_optimizer(optimizer)
    if not getattr(inner, "built", False) or not getattr(inner, "momentum", 0):
        return
    for buffer in getattr(inner, "momentums", None) or []:
        buffer.assign(buffer * ratio)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the LR from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` (Goyal et al. 2017).

    ``initial_lr`` is the already size-scaled target LR, as in Horovod.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0, *,
                 comm: Optional[Communicator] = None) -> None:
        if warmup_epochs <= 0:
            raise ConfigError(f"warmup_epochs must be positive, got {warmup_epochs}")

        def multiplier(epoch: float) -> float:
            # Shifted by one batch so that each epoch ends on a round value (Horovod).
            epoch += 1.0 / self.steps_per_epoch
            size = self.comm.size
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch, comm=comm)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and self.comm.rank == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(_ShardwiseCallback):
    """Save the model when ``monitor`` improves, on ``root_rank`` only, atomically (temp file + rename).

    ``filepath`` may use ``{epoch}`` and log keys; it must end in ``.keras`` (or
    ``.weights.h5`` with ``save_weights_only``). ``mode`` is ``min``, ``max`` or ``auto``.
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", mode: str = "auto",
                 save_weights_only: bool = False, verbose: int = 0, root_rank: int = 0, *,
                 comm: Optional[Communicator] = None) -> None:
        super().__init__(comm)
        suffixes = (".weights.h5",) if save_weights_only else (".keras", ".h5")
        if not str(filepath).endswith(suffixes):
            raise ConfigError(f"BestModelCheckpoint filepath {filepath!r} must end with {' or '.join(suffixes)}")
        if mode not in ("auto", "min", "max"):
            raise ConfigError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        if mode == "auto":
            mode = "max" if any(s in monitor for s in ("acc", "auc", "precision", "recall")) else "min"
        self.filepath = str(filepath)
        self.monitor = monitor
        self.mode = mode
        self.save_weights_only = save_weights_only
        self.verbose = verbose
        self.root_rank = int(root_rank)
        self.best = math.inf if mode == "min" else -math.inf
        self.saved: list[str] = []

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        value = (logs or {}).get(self.monitor)
        if value is None:
            warnings.warn(f"BestModelCheckpoint: metric {self.monitor!r} is not in the logs "
                          f"({sorted(logs or {})}); nothing saved", stacklevel=2)
            return
        value = float(value)
        if not (value < self.best if self.mode == "min" else value > self.best):
            return
        self.best = value
        if self.comm.rank != self.root_rank:
            return
        path = self.filepath.format(epoch=epoch + 1, **(logs or {}))
        self._save_atomically(path)
        self.saved.append(path)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: {self.monitor} improved to {value:.5f}, saved {path}")

    def _save_atomically(self, path: str) -> None:
        directory, name = os.path.split(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".tmp-{os.getpid()}-{name}")
        try:
            if self.save_weights_only:
                self.model.save_weights(tmp)
            else:
                self.model.save(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


class ShardedCheckpoint(_ShardwiseCallback):
    """Every rank writes its shards to ``directory/ckpt-<step>/`` (Keras's ``ModelCheckpoint`` for sharded state).

    ``save_freq`` is ``"epoch"`` or a number of batches. Each save is atomic: the
    manifest is committed by rank 0 after every rank's file is on disk, so a crash
    mid-save leaves the earlier checkpoints loadable (see :mod:`.checkpoint`).
    ``keep`` prunes all but the newest ``keep``. Resume with
    :func:`~.checkpoint.load_checkpoint` and ``fit(..., initial_epoch=info.epoch)``.
    """

    def __init__(self, directory: Union[str, "os.PathLike[str]"], save_freq: Union[str, int] = "epoch",
                 keep: Optional[int] = None, include_optimizer: bool = True, verbose: int = 0, *,
                 comm: Optional[Communicator] = None) -> None:
        super().__init__(comm)
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int)
                                     or save_freq < 1):
            raise ConfigError(f"save_freq must be 'epoch' or a positive number of batches, got {save_freq!r}")
        if keep is not None and int(keep) < 1:
            raise ConfigError(f"keep must be at least 1, got {keep}")
        self.directory = os.fspath(directory)
        self.save_freq = save_freq
        self.keep = keep
        self.include_optimizer = include_optimizer
        self.verbose = verbose
        self.saved: list[str] = []
        self._epoch = 0
        self._batches = 0

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.save_freq == "epoch":
            return
        self._batches += 1
        if self._batches % self.save_freq == 0:
            self._save(self._epoch, batch + 1)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def _save(self, epoch: int, batch: int) -> None:
        path = save_checkpoint(self.model, self.directory, include_optimizer=self.include_optimizer, keep=self.keep,
                               epoch=epoch, batch=batch, comm=self._comm)
        self.saved.append(str(path))
        if self.verbose > 0 and self.comm.rank == 0:
            print(f"\nShardedCheckpoint: saved {path}")
