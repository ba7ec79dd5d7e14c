"""The torch mode of ``keras_dp.py``: shardwise Keras-on-torch ``fit`` vs torch DDP, both on gloo.

Run on 2 ranks:  mpirun -np 2 python benchmarks/keras_dp.py --keras-backend torch

In the same processes, on the same transport (the one gloo process group that
``shardwise.init(backend="torch")`` creates as torch.distributed's default group):

* shardwise: Keras 3 (torch backend) ``model.fit`` with
  ``shardwise.keras.DistributedOptimizer`` on the torch backend; gradients reach the
  communicator as torch tensors, fused into buckets, one gloo allreduce per bucket;
* DDP: ``torch.nn.parallel.DistributedDataParallel`` (default 25 MiB buckets) on that
  default group, training the same MLP from the Keras model's initial weights with
  a plain torch loop: same per-rank batches, cross-entropy, ``torch.optim.SGD(0.01)``.

A second table times, in the same rounds, shardwise Keras-on-torch with the
optimizer on the mpi backend (its own communicator on ``MPI.COMM_WORLD``); no peer
here uses that transport, so it has no ratio. Keras runs the torch train step
eagerly (``jit_compile=False``), as DDP's loop does.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from keras_dp import (WARMUP_STEPS, build_model, check_synchronized, max_difference, model_name, report,
                      time_rounds, worker_data, yield_setting)

__all__ = ["run_torch"]

GLOO = "shardwise fit + DistributedOptimizer (torch/gloo)"
DDP = "torch DDP, plain loop (gloo)"
MPI_ALONE = "shardwise fit + DistributedOptimizer (mpi)"


def torch_mlp(keras_weights: list[np.ndarray]) -> nn.Sequential:
    """The benchmark MLP as torch modules, starting from a Keras model's weights (kernels transposed)."""
    layers: list[nn.Module] = []
    for kernel, bias in zip(keras_weights[::2], keras_weights[1::2], strict=True):
        linear = nn.Linear(*kernel.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(kernel.T))
            linear.bias.copy_(torch.from_numpy(bias))
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def keras_layout(model: nn.Module) -> list[np.ndarray]:
    """A torch MLP's weights in Keras's order and layout."""
    out = []
    for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
        out += [linear.weight.detach().numpy().T, linear.bias.detach().numpy()]
    return out


def run_torch(args: argparse.Namespace) -> None:
    """shardwise fit (torch backend, gloo) vs DDP (gloo), plus shardwise fit on mpi alone."""
    import shardwise

    comm = shardwise.init(backend="torch").world
    torch.set_num_threads(args.threads)
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        raise SystemExit("shardwise.init(backend='torch') left no gloo default group for DDP to share")
    import keras

    import shardwise.keras as hvd
    from shardwise.backends.mpi import MPICommunicator

    size, rank, b = comm.size, comm.rank, args.batch
    x, y = worker_data(rank, size, b, max(args.steps, WARMUP_STEPS))
    mpi_comm = MPICommunicator()

    def keras_contender(optimizer_comm: Any) -> Any:
        model = build_model()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), comm=optimizer_comm,
                                                           bucket_cap_bytes=int(args.bucket_mb * 2**20)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        hvd.broadcast_variables(model.variables, root_rank=0)
        return model

    def fit(model: Any) -> Callable[[int], None]:
        def run(steps: int) -> None:  # each call starts from the first batch
            model.fit(x, y, batch_size=b, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0)

        return run

    sw_model, mpi_model = keras_contender(comm), keras_contender(mpi_comm)
    ddp = nn.parallel.DistributedDataParallel(torch_mlp(sw_model.get_weights()),  # the default (gloo) group
                                              bucket_cap_mb=args.bucket_mb)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()

    def run_ddp(steps: int) -> None:  # the batches fit sees, in the same order
        for i in range(steps):
            ddp_opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(ddp(xt[i * b:(i + 1) * b]), yt[i * b:(i + 1) * b]).backward()
            ddp_opt.step()

    contenders = {GLOO: fit(sw_model), DDP: run_ddp, MPI_ALONE: fit(mpi_model)}
    times = time_rounds(contenders, args.steps, args.rounds)
    ddp_weights = keras_layout(ddp.module)
    check_synchronized(sw_model.get_weights(), GLOO)
    check_synchronized(ddp_weights, DDP)
    check_synchronized(mpi_model.get_weights(), MPI_ALONE)

    if rank == 0:
        print(f"keras_dp [torch]: {size} workers, Keras {keras.__version__} / torch {torch.__version__}, "
              f"{model_name()}, SGD(0.01), batch {b}/worker, {torch.get_num_threads()} "
              f"intra-op thread(s), Keras jit_compile=False, buckets {args.bucket_mb:g} MiB (both), "
              f"{args.steps} steps x {args.rounds} rounds (median, slowest rank), {yield_setting()}")
        print("# same transport: torch.distributed gloo, one process group")
        rate = report({name: times[name] for name in (GLOO, DDP)}, args.steps)
        print(f"ratio shardwise/DDP: {rate[GLOO] / rate[DDP]:.2f}x (target >= 1.0x)")
        print("# shardwise on the mpi backend (no peer on this transport)")
        report({MPI_ALONE: times[MPI_ALONE]}, args.steps)
        steps = WARMUP_STEPS + args.rounds * args.steps
        print(f"final weights after {steps} steps on the same batches, max |shardwise - DDP|: "
              f"gloo {max_difference(sw_model.get_weights(), ddp_weights):.1e}, "
              f"mpi {max_difference(mpi_model.get_weights(), ddp_weights):.1e}")
    mpi_comm.free()
