"""``TorchEstimator`` -> ``TorchModel``: Horovod's ``horovod.spark.torch`` on shardwise.

::

    from shardwise.spark.estimator.torch import TorchEstimator
    from shardwise.spark.store import Store

    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss=torch.nn.functional.cross_entropy, feature_cols=["features"],
                         label_cols=["label"], batch_size=32, epochs=5, validation=0.1,
                         store=Store.create("/tmp/store"), strategy="zero2")
    fitted = est.fit(train_df)                  # a TorchModel (Spark Transformer)
    pred = fitted.transform(test_df)            # adds "label__output"

``strategy``: ``"dp"`` (Horovod's ``DistributedOptimizer``), ``"zero1"``/``"zero2"``/``"zero3"``
(:class:`shardwise.torch.ZeroOptimizer`), or a :class:`~shardwise.core.layout.ParallelLayout` /
DeepSpeed config dict run by :func:`shardwise.torch.parallelize` - data parallel and ZeRO layouts
only (``tp = pp = cp = 1``: every rank holds a whole model replica, or its ZeRO shard).
The model and loss travel to the workers by cloudpickle; the optimizer as its class and
hyperparameters (a fresh optimizer is built on the workers; one parameter group).
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from shardwise.core.errors import ConfigError

from .common import (EstimatorParams, RankData, ShardwiseEstimator, ShardwiseModel, TrainSpec, as_columns, log,
                     mean_over_ranks, pandas_features, pandas_outputs, zero_stage)

STRATEGIES = ("dp", "zero1", "zero2", "zero3")


def _optimizer_spec(optimizer: Any) -> tuple[type, dict[str, Any]]:
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer instance (over the model's parameters), got "
                          f"{type(optimizer).__name__}")
    if len(optimizer.param_groups) != 1:
        raise ConfigError(f"the optimizer has {len(optimizer.param_groups)} parameter groups; the estimator rebuilds "
                          f"it on the workers from its class and hyperparameters, with one group")
    group = optimizer.param_groups[0]
    return type(optimizer), {k: group.get(k, v) for k, v in optimizer.defaults.items()}


def _check_strategy(strategy: Any) -> None:
    from shardwise.core.layout import ParallelLayout

    if zero_stage(strategy, STRATEGIES) is not None:
        return
    if isinstance(strategy, ParallelLayout):
        if strategy.tp > 1 or strategy.pp > 1 or getattr(strategy, "cp", 1) > 1:
            raise ConfigError(f"the Spark estimator runs data parallel and ZeRO layouts only (tp = pp = cp = 1: the "
                              f"ranks read different rows and each returns a whole model); got {strategy}")
        return
    if isinstance(strategy, dict):
        return  # a DeepSpeed config: parallelize checks it on the workers (tp/pp refused there too)
    raise ConfigError(f"unknown strategy {strategy!r}; expected one of {list(STRATEGIES)}, a ParallelLayout or a "
                      f"DeepSpeed config dict")


class TorchEstimator(ShardwiseEstimator):
    """Train a torch ``nn.Module`` on a Spark DataFrame over ``num_proc`` ranks; ``fit`` returns a :class:`TorchModel`.

    ``model``: the ``nn.Module`` (called as ``model(*features)``, one tensor per feature column);
    ``optimizer``: an optimizer over its parameters (class and hyperparameters are used);
    ``loss``: ``loss(output, label) -> scalar`` (mean over the batch), or one per label column
    (the model then returns one output per label; the losses are summed).
    ``batch_size`` rows per rank and step; ``validation``: a fraction or a column (see
    :func:`shardwise.spark.data.prepare_data`); ``shuffle``: a seeded per-epoch permutation of each
    rank's rows (``random_seed``); ``backend``: shardwise's process group (``"gloo"``).
    """

    def __init__(self, *, model: Any = None, optimizer: Any = None, loss: Any = None,
                 feature_cols: Union[str, Sequence[str], None] = None,
                 label_cols: Union[str, Sequence[str], None] = None, store: Any = None,
                 num_proc: Optional[int] = None, batch_size: int = 32, val_batch_size: Optional[int] = None,
                 epochs: int = 1, validation: Union[float, str, None] = None, strategy: Any = "dp",
                 run_id: Optional[str] = None, shuffle: bool = True, random_seed: int = 0, verbose: int = 1,
                 partitions_per_process: int = 1, output_cols: Optional[Sequence[str]] = None,
                 backend: str = "gloo") -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
        if not all(callable(f) for f in losses):
            raise ConfigError(f"loss must be a callable loss(output, label) (or one per label column), got {loss!r}")
        _check_strategy(strategy)
        params = EstimatorParams(
            num_proc=num_proc, feature_cols=as_columns(feature_cols, "feature_cols"),
            label_cols=as_columns(label_cols, "label_cols"), store=store, batch_size=batch_size,
            val_batch_size=val_batch_size, epochs=epochs, validation=validation, strategy=strategy, run_id=run_id,
            shuffle=shuffle, random_seed=random_seed, verbose=verbose, partitions_per_process=partitions_per_process,
            output_cols=tuple(output_cols) if output_cols is not None else None, backend=backend)
        if len(losses) not in (1, len(params.label_cols)):
            raise ConfigError(f"{len(losses)} losses for {len(params.label_cols)} label columns: give one loss, or "
                              f"one per label column")
        if not isinstance(strategy, str) and (len(params.feature_cols) > 1 or len(params.label_cols) > 1):
            raise ConfigError("a ParallelLayout / DeepSpeed strategy trains through parallelize's train_step, which "
                              "takes one input and one target: use one feature column and one label column")
        super().__init__(params)
        self.model = model
        self.optimizer_class, self.optimizer_kwargs = _optimizer_spec(optimizer)
        self.loss = losses

    def getModel(self) -> Any:
        return self.model

    def getOptimizer(self) -> tuple[type, dict[str, Any]]:
        return self.optimizer_class, dict(self.optimizer_kwargs)

    def getLoss(self) -> list[Callable]:
        return list(self.loss)

    def _payload(self) -> bytes:
        import cloudpickle

        return cloudpickle.dumps((self.model, self.loss, self.optimizer_class, self.optimizer_kwargs))

    def _train_fn(self) -> Callable[[TrainSpec], Any]:
        return train

    def _make_model(self, result: dict, spec: TrainSpec) -> "TorchModel":
        import torch

        model = copy.deepcopy(self.model)
        model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in result["state_dict"].items()})
        return TorchModel(model=model, history=result["history"], features=spec.data.features,
                          label_cols=self._est.label_cols, output_cols=self._est.outputs(),
                          run_id=spec.run_id)


class TorchModel(ShardwiseModel):
    """The fitted torch model; ``transform(df)`` adds one prediction column per label (``<label>__output``)."""

    def __init__(self, *, model: Any, history: dict, features: Sequence[Any], label_cols: Sequence[str],
                 output_cols: Sequence[str], run_id: str, batch_size: int = 256) -> None:
        self._model = model
        shapes = [o.shape[1:] for o in _predict(model, [np.zeros((1,) + f.shape, f.dtype) for f in features],
                                                len(label_cols))]
        super().__init__(history=history, features=features, label_cols=label_cols, output_cols=output_cols,
                         output_shapes=shapes, run_id=run_id, batch_size=batch_size)

    def getModel(self) -> Any:
        """The trained ``nn.Module`` (on the CPU)."""
        return self._model

    def _predict_fn(self) -> Callable[[Iterator[Any]], Iterator[Any]]:
        import cloudpickle

        blob = cloudpickle.dumps(self._model)
        features, outputs, batch = self._features, self._output_cols, self._batch_size
        n_out = len(self._label_cols)

        def predict(batches: Iterator[Any]) -> Iterator[Any]:
            model = cloudpickle.loads(blob)
            for pdf in batches:
                for start in range(0, len(pdf), batch):
                    part = pdf.iloc[start:start + batch].copy()
                    outs = _predict(model, pandas_features(part, features), n_out)
                    for name, col in zip(outputs, pandas_outputs(outs)):
                        part[name] = col
                    yield part

        return predict


def _predict(model: Any, features: list[np.ndarray], n_out: int) -> list[np.ndarray]:
    import torch

    model.eval()
    with torch.no_grad():
        out = model(*[torch.from_numpy(np.ascontiguousarray(f)) for f in features])
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if len(outs) != n_out:
        raise ConfigError(f"the model returned {len(outs)} output(s) for {n_out} label column(s)")
    return [o.detach().cpu().numpy() for o in outs]


# -- on the workers --------------------------------------------------------------------------------------
def _loss(losses: list[Callable], out: Any, labels: list[Any]) -> Any:
    outs = list(out) if isinstance(out, (list, tuple)) and len(labels) > 1 else [out]
    if len(outs) != len(labels):
        raise ConfigError(f"the model returned {len(outs)} output(s) for {len(labels)} label column(s)")
    fns = losses if len(losses) == len(labels) else losses * len(labels)
    return sum(f(o, y) for f, o, y in zip(fns, outs, labels))


class _Trainer:
    """The model and optimizer as the strategy builds them: ``step``, ``module``, ``full_state``, ``save``."""

    def __init__(self, model: Any, strategy: Any, opt_cls: type, opt_kwargs: dict, losses: list, comm: Any) -> None:
        import shardwise.torch as hvd

        self.losses, self.comm, self.original = losses, comm, model
        self.stage = zero_stage(strategy, STRATEGIES)
        self.pm = self.opt = None
        if self.stage == 0:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            self.opt = hvd.DistributedOptimizer(opt_cls(model.parameters(), **opt_kwargs),
                                                named_parameters=model.named_parameters())
            self.module = model
        elif self.stage:
            self.opt = hvd.ZeroOptimizer(model, opt_cls, stage=self.stage, **opt_kwargs)
            self.module = model
        else:
            loss = losses[0]
            self.pm = hvd.parallelize(model, opt_cls, strategy, loss_fn=loss, **opt_kwargs)
            if self.pm.groups.dp.size != comm.size:
                raise ConfigError(f"the layout {self.pm.layout} is not data parallel over all {comm.size} ranks; the "
                                  f"Spark estimator runs data parallel and ZeRO layouts only")
            self.module = self.pm.module
            self.opt = self.pm.optimizer
            self.stage = int(getattr(self.pm.layout, "zero_stage", 0))

    def step(self, feats: list, labels: list) -> float:
        if self.pm is not None:
            return float(self.pm.train_step(feats[0], labels[0]))
        self.opt.zero_grad()
        loss = _loss(self.losses, self.module(*feats), labels)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def full_state(self) -> dict[str, Any]:
        """The whole model's state dict, under the user's model's names (collective at ZeRO-3)."""
        state = dict(self.original.state_dict())  # parallelize trains the model's own parameters
        if self.stage == 3:  # those hold shards: gather them, and name them as the user's model does
            names = {id(p): n for n, p in self.original.named_parameters()}
            mine = dict(self.module.named_parameters())
            for name, full in self.opt.full_parameters().items():
                state[names.get(id(mine.get(name)), name)] = full
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def save(self, directory: str, epoch: int, state: dict[str, Any]) -> None:
        """Collective: this epoch's checkpoint into ``directory`` (a local folder)."""
        import torch

        if self.pm is not None:
            self.pm.save_checkpoint(os.path.join(directory, "parallel"), step=epoch)
        elif self.stage:
            from shardwise.torch import save_zero_checkpoint

            os.makedirs(os.path.join(directory, "zero"), exist_ok=True)
            save_zero_checkpoint(self.opt, os.path.join(directory, "zero"), step=epoch)
        elif self.comm.rank == 0:
            torch.save(self.opt.state_dict(), os.path.join(directory, "optimizer.pt"))
        if self.comm.rank == 0:
            torch.save(state, os.path.join(directory, "model.pt"))


def train(spec: TrainSpec) -> Optional[dict]:
    """What each rank runs: read its rows, train ``epochs`` epochs (on this rank's GPU where it has one),
    checkpoint each epoch; rank 0 returns ``{"state_dict": {name: numpy}, "history": {...}}``, the others None."""
    import cloudpickle
    import torch

    import shardwise
    import shardwise.torch as hvd

    hvd.init()
    comm = shardwise.current().world
    rank, size = comm.rank, comm.size
    torch.manual_seed(spec.seed)
    model, losses, opt_cls, opt_kwargs = cloudpickle.loads(spec.payload)
    # shardwise.init() bound this rank to cuda:local_rank where the task sees GPUs
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)
    data = RankData.load(spec, rank, size, comm)
    trainer = _Trainer(model, spec.strategy, opt_cls, opt_kwargs, losses, comm)
    history: dict[str, list[float]] = {"loss": []}
    if spec.data.val_path:
        history["val_loss"] = []

    def tensors(arrays: list[np.ndarray]) -> list[Any]:
        return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]

    for epoch in range(spec.epochs):
        started = time.time()
        trainer.module.train()
        total = 0.0
        for feats, labels in data.epoch_batches(spec, epoch, rank):
            total += trainer.step(tensors(feats), tensors(labels))
        history["loss"].append(mean_over_ranks(total, data.steps, comm))
        if spec.data.val_path:
            trainer.module.eval()
            vtotal, vcount = 0.0, 0
            with torch.no_grad():
                for feats, labels, n in data.val_batches(spec):
                    out = trainer.module(*tensors(feats))
                    if n:
                        vtotal += float(_loss(losses, out, tensors(labels))) * n
                        vcount += n
            history["val_loss"].append(mean_over_ranks(vtotal, vcount, comm))
        state = trainer.full_state()
        with spec.store.local_dir(os.path.join(spec.store.get_checkpoint_path(spec.run_id), f"epoch-{epoch}")) as d:
            trainer.save(d, epoch, state)
        log(spec, rank, f"epoch {epoch} ({time.time() - started:.1f} s): " +
            ", ".join(f"{k}={v[-1]:.6g}" for k, v in history.items()))
    if rank != 0:
        return None
    return {"state_dict": {k: v.numpy() for k, v in state.items()}, "history": history}
