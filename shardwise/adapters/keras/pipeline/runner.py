"""Pipeline parallelism for a Keras 3 ``Sequential`` on any backend: layers split over ranks, and
data-parallel replicas of the pipeline where it is given a mesh's groups.

Each rank of the pipeline communicator keeps a contiguous run of the model's
layers (balanced by parameter count with
:func:`~shardwise.core.layer_partition.partition_layers`) and runs its action
list of a core GPipe or 1F1B schedule: each micro-batch's forward keeps its
backward for later (a TensorFlow tape, a torch autograd graph or a JAX ``vjp``,
see :mod:`.stage_grad`), activations and gradients go as numpy arrays through the
communicator (sends non-blocking, receives blocking, tags from
:meth:`~shardwise.core.pipeline.Schedule.tag`). The last stage divides the loss
by the number of micro-batches, so one step equals one full-batch step. Given the
:class:`~shardwise.core.mesh_groups.ParallelGroups` of a dp x pp mesh (the torch pipeline's
groups), the stages run over ``groups.pp`` and each stage's gradients and the loss are averaged
over ``groups.dp``: one step equals one step on the replicas' batches concatenated.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import keras
import numpy as np

from ....core.comm import Communicator
from ....core.errors import ConfigError
from ....core.layer_partition import partition_layers
from ....core.mesh_groups import ParallelGroups
from ....core.pipeline import Action, build_schedule
from .stage_grad import forward_for_backward

__all__ = ["KerasPipeline"]

_DTYPES = ("float32", "float64", "float16", "int64", "int32")
_MAX_DIMS = 8


class KerasPipeline:
    """This rank's stage of a Keras ``Sequential`` (built, with known input shape) and its schedule."""

    def __init__(self, model: Any, comm: Union[Communicator, ParallelGroups], loss_fn: Callable[[Any, Any], Any],
                 optimizer: Any, *, num_microbatches: int = 1, schedule: str = "gpipe",
                 costs: Optional[Sequence[float]] = None) -> None:
        """``comm``: the pipeline's ranks, first to last stage, or a mesh's groups (``build_groups``) whose
        ``pp`` group runs the stages and whose ``dp`` group holds replicas of the pipeline."""
        self.dp: Optional[Communicator] = None
        if isinstance(comm, ParallelGroups):
            if comm.tp.size > 1 or comm.ep is not None:
                raise ConfigError(f"the Keras pipeline splits layers over pp and replicates over dp; a mesh with "
                                  f"tp={comm.tp.size}, ep={comm.ep_size} is not supported")
            self.dp = comm.dp if comm.dp.size > 1 else None
            comm = comm.pp
        layers = list(model.layers)
        costs = [float(layer.count_params()) for layer in layers] if costs is None else list(costs)
        if len(costs) != len(layers):
            raise ConfigError(f"got {len(costs)} layer costs for a model of {len(layers)} layers")
        mine = partition_layers(costs, comm.size)[comm.rank]
        self.layers = layers[mine.start:mine.stop]
        self.schedule = build_schedule(schedule, comm.size, num_microbatches)
        self.comm, self.loss_fn, self.optimizer = comm, loss_fn, optimizer
        self.is_first, self.is_last = comm.rank == 0, comm.rank == comm.size - 1

    @property
    def trainable_weights(self) -> list:
        """Trainable weights of this rank's layers."""
        return [w for layer in self.layers for w in layer.trainable_weights]

    def __call__(self, x: Any, training: bool = False) -> Any:
        for layer in self.layers:
            x = layer(x, training=training)
        return x

    def _split(self, batch: Any, what: str) -> list:
        m = self.schedule.num_microbatches
        if batch is None:
            raise ConfigError(f"pipeline rank {self.comm.rank} needs {what} for its stage")
        batch = np.asarray(batch)
        if batch.ndim == 0 or batch.shape[0] % m:
            raise ConfigError(f"{what} batch size {batch.shape[:1]} is not divisible by num_microbatches={m}")
        return np.split(batch, m)

    def train_step(self, x: Any = None, y: Any = None) -> Optional[float]:
        """One optimizer step on a batch (``x`` on the first rank, ``y`` on the last); the loss on the last."""
        m, rank = self.schedule.num_microbatches, self.comm.rank
        xs = self._split(x, "inputs") if self.is_first else None
        ys = self._split(y, "targets") if self.is_last else None
        weights = self.trainable_weights
        grads: list = [None] * len(weights)
        backwards, inputs, outputs, out_grads, in_grads, pending, meta = {}, {}, {}, {}, {}, [], {}
        total = 0.0
        for a in self.schedule.actions[rank]:
            i = a.microbatch
            if a.kind == "forward":
                x_in = keras.ops.convert_to_tensor(xs[i]) if self.is_first else inputs.pop(i)
                target = keras.ops.convert_to_tensor(ys[i]) if self.is_last else None

                def run(inputs_: Any, target_: Any = target) -> Any:
                    out_ = self(inputs_, training=True)
                    return out_ if target_ is None else self.loss_fn(target_, out_) / m

                outputs[i], backwards[i] = forward_for_backward(run, x_in, weights, not self.is_first)
                if self.is_last:
                    total += float(keras.ops.convert_to_numpy(outputs[i]))
            elif a.kind == "backward":
                in_grads[i], got = backwards.pop(i)(out_grads.pop(i, None))
                outputs.pop(i)
                grads = [acc if g is None else (g if acc is None else acc + g) for acc, g in zip(grads, got)]
            elif a.kind == "recv_act":
                inputs[i] = keras.ops.convert_to_tensor(self._recv(a, self._meta(a, meta)))
            elif a.kind == "recv_grad":
                out = outputs[i]
                spec = (tuple(out.shape), keras.backend.standardize_dtype(out.dtype))
                out_grads[i] = keras.ops.convert_to_tensor(self._recv(a, spec))
            else:
                value = outputs[i] if a.kind == "send_act" else in_grads.pop(i)
                data = np.ascontiguousarray(keras.ops.convert_to_numpy(value))
                if a.kind == "send_act" and "sent" not in meta:
                    meta["sent"] = header = _header(data)
                    pending.append((self.comm.send_async(header, a.peer, self._meta_tag()), header))
                pending.append((self.comm.send_async(data, a.peer, self.schedule.tag(rank, a)), data))
        for handle, _ in pending:
            handle.wait()
        if self.dp is not None:
            grads = self._average(grads)
            total = float(self.dp.allreduce(np.array([total]), "average")[0]) if self.is_last else total
        self.optimizer.apply_gradients([(g, w) for g, w in zip(grads, weights) if g is not None])
        return total if self.is_last else None

    def _average(self, grads: list) -> list:
        """``grads`` averaged over the data-parallel replicas, in one all-reduce per dtype. Every replica
        of a stage holds the same weights, so the same gradients are present on each."""
        present = [i for i, g in enumerate(grads) if g is not None]
        arrays = {i: np.asarray(keras.ops.convert_to_numpy(grads[i])) for i in present}
        out = list(grads)
        for dtype in sorted({a.dtype.str for a in arrays.values()}):
            group = [i for i in present if arrays[i].dtype.str == dtype]
            flat = np.asarray(self.dp.allreduce(np.concatenate([arrays[i].reshape(-1) for i in group]), "average"))
            offset = 0
            for i in group:
                size = arrays[i].size
                out[i] = keras.ops.convert_to_tensor(flat[offset:offset + size].reshape(arrays[i].shape),
                                                     dtype=arrays[i].dtype.name)
                offset += size
        return out

    def _meta_tag(self) -> int:
        return 2 * self.schedule.num_microbatches * self.schedule.num_stages

    def _meta(self, a: Action, meta: dict) -> tuple:
        if "recv" not in meta:
            header = self.comm.recv(np.empty(_MAX_DIMS + 2, np.int64), a.peer, self._meta_tag())
            meta["recv"] = (tuple(int(d) for d in header[2:2 + header[0]]), _DTYPES[int(header[1])])
        return meta["recv"]

    def _recv(self, a: Action, spec: tuple) -> np.ndarray:
        shape, dtype = spec
        return self.comm.recv(np.empty(shape, dtype), a.peer, self.schedule.tag(self.comm.rank, a))


def _header(data: np.ndarray) -> np.ndarray:
    if data.ndim > _MAX_DIMS or data.dtype.name not in _DTYPES:
        raise ConfigError(f"cannot send an activation of shape {data.shape} and dtype {data.dtype}")
    header = np.zeros(_MAX_DIMS + 2, np.int64)
    header[0], header[1] = data.ndim, _DTYPES.index(data.dtype.name)
    header[2:2 + data.ndim] = data.shape
    return header
