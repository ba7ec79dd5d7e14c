"""``KerasEstimator`` -> ``KerasModel``: Horovod's ``horovod.spark.keras`` on shardwise.

::

    from shardwise.spark.estimator.keras import KerasEstimator

    est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.1),
                         loss="sparse_categorical_crossentropy", feature_cols=["features"],
                         label_cols=["label"], batch_size=32, epochs=5, store=Store.create("/tmp/store"))
    fitted = est.fit(train_df)                  # a KerasModel (Spark Transformer)
    pred = fitted.transform(test_df)            # adds "label__output"

The model travels to the workers as its JSON config and weights (``model.to_json()``,
``get_weights()``), the optimizer and loss as Keras-serialized configs (a loss that Keras
cannot serialize, e.g. a plain function, by cloudpickle; custom layers through
``custom_objects``). The workers run Keras on ``keras_backend`` (``KERAS_BACKEND``, default
``"torch"``); the collectives run on shardwise's ``backend`` (``"gloo"``).
``strategy``: ``"dp"`` (``shardwise.keras.DistributedOptimizer`` and the broadcast callback)
or ``"zero1"``/``"zero2"`` (``shardwise.keras.ZeroOptimizer``). Keras ZeRO-3 needs a sharded
build (``shardwise.keras.zero.sharded_build``) that a shipped model does not have: refused.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from shardwise.core.errors import ConfigError

from .common import (EstimatorParams, RankData, ShardwiseEstimator, ShardwiseModel, TrainSpec, as_columns, log,
                     mean_over_ranks, pandas_features, pandas_outputs, zero_stage)

STRATEGIES = ("dp", "zero1", "zero2")
KERAS_BACKENDS = ("torch", "jax", "tensorflow")


@contextlib.contextmanager
def _no_tensorflow_probe() -> Iterator[None]:
    """Keras's (de)serialization asks ``tf.available`` (is an object a ``tf.TensorShape``?), which imports
    TensorFlow when it is installed: seconds and hundreds of MiB per worker on the torch or JAX backend.
    Where TensorFlow is not imported yet no object can be one, so the probe answers False inside the block."""
    import keras

    try:
        from keras.src.utils import module_utils

        probe = getattr(module_utils, "tensorflow", None)
    except ImportError:  # another Keras layout: no probe to quiet
        probe = None
    if keras.backend.backend() == "tensorflow" or "tensorflow" in sys.modules or probe is None \
            or getattr(probe, "_available", True) is not None:
        yield
        return
    probe._available = False
    try:
        yield
    finally:
        probe._available = None


def _serialize(obj: Any, kind: str) -> tuple[str, Any]:
    """``("name", str)``, ``("keras", config)`` or ``("pickle", bytes)`` for a loss or optimizer."""
    import cloudpickle
    import keras

    if isinstance(obj, str):
        return "name", obj
    module = keras.optimizers if kind == "optimizer" else keras.losses
    try:
        with _no_tensorflow_probe():
            config = module.serialize(obj)
            module.deserialize(config)  # only what Keras reads back travels as config
        return "keras", config
    except Exception:  # noqa: BLE001 - anything Keras cannot round-trip goes by cloudpickle
        return "pickle", cloudpickle.dumps(obj)


def _deserialize(entry: tuple[str, Any], kind: str, custom_objects: dict) -> Any:
    import cloudpickle
    import keras

    how, value = entry
    if how == "pickle":
        return cloudpickle.loads(value)
    module = keras.optimizers if kind == "optimizer" else keras.losses
    if how == "keras":
        with _no_tensorflow_probe():
            return module.deserialize(value, custom_objects=custom_objects)
    return module.get(value) if kind == "optimizer" else value


def _rebuild(payload: dict) -> Any:
    import cloudpickle
    import keras

    custom = cloudpickle.loads(payload["custom_objects"])
    with _no_tensorflow_probe():
        model = keras.models.model_from_json(payload["json"], custom_objects=custom)
    model.set_weights(payload["weights"])
    return model


class KerasEstimator(ShardwiseEstimator):
    """Train a Keras 3 model on a Spark DataFrame over ``num_proc`` ranks; ``fit`` returns a :class:`KerasModel`.

    ``model``: a built Keras model (one input per feature column, one output per label column);
    ``optimizer``: a Keras optimizer (or its name); ``loss``: a loss name, Keras loss or function.
    The other parameters are :class:`~shardwise.spark.estimator.torch.TorchEstimator`'s.
    """

    def __init__(self, *, model: Any = None, optimizer: Any = None, loss: Any = None,
                 feature_cols: Union[str, Sequence[str], None] = None,
                 label_cols: Union[str, Sequence[str], None] = None, store: Any = None,
                 num_proc: Optional[int] = None, batch_size: int = 32, val_batch_size: Optional[int] = None,
                 epochs: int = 1, validation: Union[float, str, None] = None, strategy: Any = "dp",
                 run_id: Optional[str] = None, shuffle: bool = True, random_seed: int = 0, verbose: int = 1,
                 partitions_per_process: int = 1, output_cols: Optional[Sequence[str]] = None,
                 backend: str = "gloo", keras_backend: str = "torch",
                 custom_objects: Optional[dict[str, Any]] = None) -> None:
        import keras

        if not isinstance(model, keras.Model):
            raise ConfigError(f"model must be a keras.Model, got {type(model).__name__}")
        if not model.built:
            raise ConfigError("the Keras model is not built: give it an Input (or call build) before the estimator")
        if optimizer is None or loss is None:
            raise ConfigError(f"KerasEstimator needs an optimizer and a loss (got optimizer={optimizer!r}, "
                              f"loss={loss!r})")
        if keras_backend not in KERAS_BACKENDS:
            raise ConfigError(f"unknown keras_backend {keras_backend!r}; expected one of {list(KERAS_BACKENDS)}")
        if zero_stage(strategy, STRATEGIES) is None:
            hint = " (Keras ZeRO-3 needs shardwise.keras.zero.sharded_build: use it directly)" \
                if strategy == "zero3" else ""
            raise ConfigError(f"unknown strategy {strategy!r} for Keras; expected one of {list(STRATEGIES)}{hint}")
        params = EstimatorParams(
            num_proc=num_proc, feature_cols=as_columns(feature_cols, "feature_cols"),
            label_cols=as_columns(label_cols, "label_cols"), store=store, batch_size=batch_size,
            val_batch_size=val_batch_size, epochs=epochs, validation=validation, strategy=strategy, run_id=run_id,
            shuffle=shuffle, random_seed=random_seed, verbose=verbose, partitions_per_process=partitions_per_process,
            output_cols=tuple(output_cols) if output_cols is not None else None, backend=backend)
        if len(model.inputs) != len(params.feature_cols) or len(model.outputs) != len(params.label_cols):
            raise ConfigError(f"the model has {len(model.inputs)} input(s) and {len(model.outputs)} output(s); "
                              f"feature_cols {list(params.feature_cols)} and label_cols {list(params.label_cols)} "
                              f"must match them one to one")
        super().__init__(params)
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.keras_backend = keras_backend
        self.custom_objects = dict(custom_objects or {})

    def getModel(self) -> Any:
        return self.model

    def getOptimizer(self) -> Any:
        return self.optimizer

    def getLoss(self) -> Any:
        return self.loss

    def _payload(self) -> dict:
        import cloudpickle

        with _no_tensorflow_probe():
            config = self.model.to_json()
        return {"json": config, "weights": [np.asarray(w) for w in self.model.get_weights()],
                "optimizer": _serialize(self.optimizer, "optimizer"), "loss": _serialize(self.loss, "loss"),
                "custom_objects": cloudpickle.dumps(self.custom_objects)}

    def _env(self) -> dict[str, str]:
        return {"KERAS_BACKEND": self.keras_backend}

    def _train_fn(self) -> Callable[[TrainSpec], Any]:
        return train

    def _make_model(self, result: dict, spec: TrainSpec) -> "KerasModel":
        payload = dict(spec.payload, weights=result["weights"])
        return KerasModel(payload=payload, history=result["history"], features=spec.data.features,
                          label_cols=self._est.label_cols, output_cols=self._est.outputs(), run_id=spec.run_id,
                          keras_backend=self.keras_backend)


class KerasModel(ShardwiseModel):
    """The fitted Keras model; ``transform(df)`` adds one prediction column per label (``<label>__output``)."""

    def __init__(self, *, payload: dict, history: dict, features: Sequence[Any], label_cols: Sequence[str],
                 output_cols: Sequence[str], run_id: str, keras_backend: str = "torch",
                 batch_size: int = 256) -> None:
        self._payload = payload
        self._keras_backend = keras_backend
        self._model = _rebuild(payload)  # in the driver's Keras backend
        shapes = [o.shape[1:] for o in _predict(self._model, [np.zeros((1,) + f.shape, f.dtype) for f in features])]
        super().__init__(history=history, features=features, label_cols=label_cols, output_cols=output_cols,
                         output_shapes=shapes, run_id=run_id, batch_size=batch_size)

    def getModel(self) -> Any:
        """The trained Keras model (built from its config and the trained weights)."""
        return self._model

    def getWeights(self) -> list[np.ndarray]:
        return list(self._payload["weights"])

    def _predict_fn(self) -> Callable[[Iterator[Any]], Iterator[Any]]:
        payload, backend = self._payload, self._keras_backend
        features, outputs, batch = self._features, self._output_cols, self._batch_size

        def predict(batches: Iterator[Any]) -> Iterator[Any]:
            os.environ.setdefault("KERAS_BACKEND", backend)
            model = _rebuild(payload)
            for pdf in batches:
                for start in range(0, len(pdf), batch):
                    part = pdf.iloc[start:start + batch].copy()
                    for name, col in zip(outputs, pandas_outputs(_predict(model, pandas_features(part, features)))):
                        part[name] = col
                    yield part

        return predict


def _predict(model: Any, features: list[np.ndarray]) -> list[np.ndarray]:
    import keras

    out = model(features[0] if len(features) == 1 else features, training=False)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return [keras.ops.convert_to_numpy(o) for o in outs]


# -- on the workers --------------------------------------------------------------------------------------
def train(spec: TrainSpec) -> Optional[dict]:
    """What each rank runs (Keras on ``KERAS_BACKEND``): read its rows, train ``epochs`` epochs with one
    ``fit`` per epoch over its rows in the documented order, checkpoint each epoch; rank 0 returns
    ``{"weights": [numpy], "history": {...}}``, the others None."""
    import cloudpickle
    import keras

    import shardwise
    import shardwise.keras as hvd

    hvd.init()
    comm = shardwise.current().world
    rank, size = comm.rank, comm.size
    with _no_tensorflow_probe():
        keras.utils.set_random_seed(spec.seed)
    payload = spec.payload
    custom = cloudpickle.loads(payload["custom_objects"])
    model = _rebuild(payload)
    inner = _deserialize(payload["optimizer"], "optimizer", custom)
    stage = zero_stage(spec.strategy, STRATEGIES)
    opt = hvd.DistributedOptimizer(inner) if stage == 0 else hvd.ZeroOptimizer(inner, stage=stage)
    model.compile(optimizer=opt, loss=_deserialize(payload["loss"], "loss", custom))
    data = RankData.load(spec, rank, size, comm)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    history: dict[str, list[float]] = {"loss": []}
    if spec.data.val_path:
        history["val_loss"] = []

    def unpack(arrays: list[np.ndarray]) -> Any:
        return arrays[0] if len(arrays) == 1 else list(arrays)

    for epoch in range(spec.epochs):
        started = time.time()
        x, y = data.epoch_rows(spec, epoch, rank)
        fitted = model.fit(unpack(x), unpack(y), batch_size=spec.batch_size, epochs=epoch + 1, initial_epoch=epoch,
                           shuffle=False, verbose=0, callbacks=callbacks)
        history["loss"].append(mean_over_ranks(fitted.history["loss"][-1] * data.steps, data.steps, comm))
        if spec.data.val_path:
            n = len(data.val_features[0])
            loss = model.evaluate(unpack(data.val_features), unpack(data.val_labels),
                                  batch_size=spec.val_batch_size, verbose=0) if n else 0.0
            loss = loss[0] if isinstance(loss, (list, tuple)) else loss
            history["val_loss"].append(mean_over_ranks(float(loss) * n, n, comm))
        path = os.path.join(spec.store.get_checkpoint_path(spec.run_id), f"epoch-{epoch}")
        with spec.store.local_dir(path) as d:
            with _no_tensorflow_probe():  # it writes the optimizer's Keras config
                hvd.save_checkpoint(model, os.path.join(d, "shardwise"), step=epoch, epoch=epoch + 1)
            if rank == 0:
                model.save_weights(os.path.join(d, "model.weights.h5"))
        log(spec, rank, f"epoch {epoch} ({time.time() - started:.1f} s): " +
            ", ".join(f"{k}={v[-1]:.6g}" for k, v in history.items()))
    weights = [np.asarray(keras.ops.convert_to_numpy(w)) for w in model.get_weights()]
    return {"weights": weights, "history": history} if rank == 0 else None
