"""The torch ZeRO-3 mode of ``keras_dp.py``: Keras-on-torch ``fit`` with ZeRO-3 vs torch FSDP2, both on gloo.

Run on 2 ranks:  mpirun -np 2 python benchmarks/keras_dp.py --keras-backend torch --zero3

In the same processes, on the same transport (the gloo process group that
``shardwise.init(backend="torch")`` makes torch.distributed's default group):

* shardwise: Keras 3 (torch backend) ``model.fit`` with
  ``shardwise.keras.ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=3)``: every layer's
  variables sharded over the ranks, gathered just before the layer runs;
* FSDP2: ``torch.distributed.fsdp.fully_shard`` on every ``nn.Linear`` and on the root,
  training the same MLP from the Keras model's initial weights with a plain torch loop
  and ``torch.optim.Adam(1e-3)``: same per-rank batches, cross-entropy.

Peak memory per rank is measured first, one contender at a time, the same way for
both (``_common.memory_phase``: resident-set high-water mark above the baseline,
while the contender is built and steps); then the timed rounds, interleaved.
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
from keras_torch_dp import keras_layout, torch_mlp

__all__ = ["run_torch_zero3"]

ZERO3 = "shardwise fit + ZeroOptimizer(stage=3) (torch/gloo)"
FSDP2 = "torch FSDP2 fully_shard, plain loop (gloo)"
MIB = 2 ** 20


def run_torch_zero3(args: argparse.Namespace) -> None:
    """shardwise Keras ZeRO-3 (torch backend, gloo) vs FSDP2 (gloo): peak memory, then step time."""
    import shardwise

    comm = shardwise.init(backend="torch").world
    torch.set_num_threads(args.threads)
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        raise SystemExit("shardwise.init(backend='torch') left no gloo default group for FSDP2 to share")
    import keras
    from torch.distributed.fsdp import fully_shard

    import shardwise.keras as hvd
    from _common import memory_phase

    size, rank, b = comm.size, comm.rank, args.batch
    x, y = worker_data(rank, size, b, max(args.steps, WARMUP_STEPS))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    initial = build_model().get_weights()

    def keras_zero3() -> Any:
        model = build_model()
        model.compile(optimizer=hvd.ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        return model

    def fit(model: Any) -> Callable[[int], None]:
        def run(steps: int) -> None:  # each call starts from the first batch
            model.fit(x, y, batch_size=b, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0)

        return run

    def fsdp2() -> tuple[nn.Module, Callable[[int], None]]:
        model = torch_mlp(initial)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)  # Keras Adam's epsilon

        def run(steps: int) -> None:  # the batches fit sees, in the same order
            for i in range(steps):
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(xt[i * b:(i + 1) * b]), yt[i * b:(i + 1) * b]).backward()
                opt.step()

        return model, run

    def measured_keras() -> Callable[[], None]:
        run = fit(keras_zero3())
        return lambda: run(1)

    def measured_fsdp2() -> Callable[[], None]:
        _, run = fsdp2()
        return lambda: run(1)

    peaks = memory_phase({ZERO3: measured_keras, FSDP2: measured_fsdp2}, comm, steps=3)

    sw_model = keras_zero3()
    fsdp_model, run_fsdp = fsdp2()
    times = time_rounds({ZERO3: fit(sw_model), FSDP2: run_fsdp}, args.steps, args.rounds)
    sw_weights = sw_model.get_weights()
    fsdp_weights = [w.full_tensor() if hasattr(w, "full_tensor") else w
                    for w in (p.detach() for p in fsdp_model.parameters())]
    reference = torch_mlp(initial)
    with torch.no_grad():
        for target, value in zip(reference.parameters(), fsdp_weights, strict=True):
            target.copy_(value)
    fsdp_keras = keras_layout(reference)
    check_synchronized(sw_weights, ZERO3)
    check_synchronized(fsdp_keras, FSDP2)

    if rank == 0:
        print(f"keras_dp [torch, ZeRO-3]: {size} workers, Keras {keras.__version__} / torch {torch.__version__}, "
              f"{model_name()}, Adam(1e-3), batch {b}/worker, {torch.get_num_threads()} intra-op thread(s), "
              f"Keras jit_compile=False, {args.steps} steps x {args.rounds} rounds (median, slowest rank), "
              f"{yield_setting()}")
        print("# same transport: torch.distributed gloo, one process group")
        rate = report(times, args.steps)
        print(f"ratio shardwise/FSDP2 step rate: {rate[ZERO3] / rate[FSDP2]:.2f}x")
        print(f"peak memory per rank above the baseline (largest rank): shardwise {peaks[ZERO3] / MIB:.1f} MiB, "
              f"FSDP2 {peaks[FSDP2] / MIB:.1f} MiB, ratio {peaks[ZERO3] / max(peaks[FSDP2], 1):.2f}x")
        steps = WARMUP_STEPS + args.rounds * args.steps
        print(f"final weights after {steps} steps on the same batches, max |shardwise - FSDP2|: "
              f"{max_difference(sw_weights, fsdp_keras):.1e} (Keras's Adam adds epsilon to sqrt(v) before the bias "
              "correction, torch's after it: the two part where a gradient is near epsilon, as they do in one "
              "process, where SGD agrees to 1e-8)")
