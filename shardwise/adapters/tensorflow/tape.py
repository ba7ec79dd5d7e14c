"""Horovod's ``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are reduced over ranks.

The wrapper holds the user's tape (recorded already, or used as the recording
context) and delegates everything but :meth:`DistributedGradientTape.gradient`. By
default all gradients of one call travel as one grouped request (Horovod sends one
allreduce per gradient unless ``groups`` is given; the result is the same).
``IndexedSlices`` are allgathered unless ``sparse_as_dense``; gradients of sources
registered as local are not reduced and, with ``scale_local_gradients``, divided by
the set size. :class:`GradientReducer` is the part shared with the legacy
``DistributedOptimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

import tensorflow as tf

from ..horovod.compression import Compression, Compressor
from ..horovod.process_sets import ProcessSet, global_process_set
from .ops import Adasum, Average, OpLike, grouped_allreduce, handle_average_backwards_compatibility
from .runtime import no_autograph

__all__ = ["GradientReducer", "DistributedGradientTape", "PartialDistributedGradientTape", "source_key"]


def source_key(source: Any) -> Any:
    """A hashable identity for a variable or tensor (TF's ``ref()``, else the object's id)."""
    ref = getattr(source, "ref", None)
    return ref() if callable(ref) else id(source)


def _split(items: list, groups: int) -> list[list]:
    """``items`` in ``groups`` contiguous chunks of near-equal size (the first ones larger)."""
    base, extra = divmod(len(items), groups)
    out, start = [], 0
    for g in range(groups):
        end = start + base + (1 if g < extra else 0)
        if end > start:
            out.append(items[start:end])
        start = end
    return out


@dataclass(frozen=True)
class GradientReducer:
    """How gradients are reduced: Horovod's options of ``DistributedGradientTape``/``DistributedOptimizer``."""

    compression: type[Compressor] = Compression.none
    sparse_as_dense: bool = False
    op: Any = Average
    gradient_predivide_factor: float = 1.0
    #: None: one request for all gradients; an int: that many requests; a list of lists of variables: one
    #: request per list (and one per gradient of a variable in none of them).
    groups: Union[None, int, Sequence[Sequence[Any]]] = None
    process_set: ProcessSet = global_process_set
    device_dense: str = ""
    device_sparse: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", handle_average_backwards_compatibility(self.op, None))
        if self.gradient_predivide_factor != 1.0 and self.op is not Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if self.groups is not None and not isinstance(self.groups, (list, tuple)) and int(self.groups) <= 0:
            raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")

    @no_autograph
    def reduce(self, grads: Sequence[Any], sources: Sequence[Any],
               use_generic_names: bool = False) -> list[Any]:
        """``grads`` (``None`` kept) reduced over the set; returned unchanged outside it or on one rank."""
        grads = [tf.convert_to_tensor(g) if self.sparse_as_dense and isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        if not self.process_set.included() or self.process_set.size() == 1:
            return list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        out = list(grads)
        for n, group in enumerate(self._groups(present, sources)):
            reduced = grouped_allreduce([grads[i] for i in group], device_dense=self.device_dense,
                                        device_sparse=self.device_sparse, compression=self.compression,
                                        op=self.op, prescale_factor=1.0 / self.gradient_predivide_factor,
                                        postscale_factor=self.gradient_predivide_factor,
                                        process_set=self.process_set, ignore_name_scope=use_generic_names,
                                        name=f"grad_{n}" if use_generic_names else None)
            for i, r in zip(group, reduced):
                out[i] = r
        return out

    def _groups(self, present: list[int], sources: Sequence[Any]) -> list[list[int]]:
        if self.groups is None or not present:
            return [present] if present else []
        if not isinstance(self.groups, (list, tuple)):
            return _split(present, int(self.groups))
        where = {source_key(s): i for i, s in enumerate(sources)}
        left, out = set(present), []
        for variables in self.groups:
            group = [where[source_key(v)] for v in variables if where.get(source_key(v)) in left]
            left -= set(group)
            if group:
                out.append(group)
        return out + [[i] for i in present if i in left]


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose :meth:`gradient` returns gradients reduced over the process set.

    Wrap a tape after recording (``tape = DistributedGradientTape(tape)``) or use the
    wrapper as the recording context; every other attribute is the wrapped tape's.
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                 op: OpLike = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Union[None, int, Sequence[Sequence[Any]]] = None,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> None:
        if not isinstance(gradtape, tf.GradientTape):
            raise ValueError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        if op == Adasum:
            raise ValueError("op=Adasum is not supported by DistributedGradientTape")
        self._tape = gradtape
        self._reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                                        groups if groups is not None or not num_groups else num_groups,
                                        process_set, device_dense, device_sparse)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources: set = set()

    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        if name == "_tape":
            raise AttributeError(name)
        return getattr(self._tape, name)

    @no_autograph
    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local: not reduced (and divided by the set size if scaling)."""
        self._local_sources.add(source_key(source))

    @no_autograph
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 use_generic_names: bool = False) -> Any:
        """The wrapped tape's gradients, reduced over ranks (same nesting; ``None`` kept)."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads, expand_composites=False)
        flat_grads = list(flat_grads)
        shared = [i for i, s in enumerate(flat_sources) if source_key(s) not in self._local_sources]
        reduced = self._reducer.reduce([flat_grads[i] for i in shared], [flat_sources[i] for i in shared],
                                       use_generic_names)
        for i, r in zip(shared, reduced):
            flat_grads[i] = r
        if self.scale_local_gradients and self._local_sources:
            n = self.process_set.size()
            for i, s in enumerate(flat_sources):
                if source_key(s) in self._local_sources and flat_grads[i] is not None:
                    flat_grads[i] = _divide(flat_grads[i], n)
        return tf.nest.pack_sequence_as(grads, flat_grads)

    @no_autograph
    def get_local_and_global_gradients(self, target: Any, sources: Sequence[Any], output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple[list, list]:
        """``(local, global)`` lists of ``(source, gradient)``, split by :meth:`register_local_source`."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if source_key(s) in self._local_sources else shared).append((s, g))
        return local, shared


def _divide(grad: Any, n: int) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / n, grad.indices, grad.dense_shape)
    return grad / n


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                                   op: OpLike = Average, gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: ProcessSet = global_process_set, local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> DistributedGradientTape:
    """A :class:`DistributedGradientTape` that keeps the gradients of ``local_layers``' weights local."""
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
