"""An elastic training run and its one-process replay, shared by the Ray and torchrun tests.

``train(config)`` runs on every worker under ``hvd.elastic.run``: a small float64
MLP, SGD with momentum, an :class:`ElasticSampler`, a commit every few steps. The
committed state carries a log of every step (world size and the global batch's
sample indices), so ``replay(log)`` in one process must give the same parameters.
One worker (rank ``kill_rank`` of the first generation) SIGKILLs itself mid-epoch
(with ``kill_parent``, first its parent: torchrun's elastic agent or the Spark task, so that the node is
gone); the survivors then train on until the job has ``final_size`` workers again.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

N, FEATURES, BATCH, EPOCHS, COMMIT_EVERY, LR = 192, 6, 4, 3, 3, 0.05


def data() -> tuple[Any, Any]:
    import torch

    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, FEATURES))
    y = np.sin(x @ rng.standard_normal(FEATURES))[:, None]
    return torch.from_numpy(x), torch.from_numpy(y)


def model() -> Any:
    import torch

    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def optimizer(params: Any, zero: int, module: Any) -> Any:
    import torch

    import shardwise.torch as hvd

    if zero:
        return hvd.ZeroOptimizer(module, torch.optim.SGD, stage=zero, lr=LR, momentum=0.9)
    return hvd.DistributedOptimizer(torch.optim.SGD(params, lr=LR, momentum=0.9),
                                    named_parameters=module.named_parameters())


def first_generation() -> bool:
    """Is this the job's first membership (Ray: generation 0; torchrun: its first start)?"""
    import shardwise

    generation = shardwise.current().owned.get("elastic_generation")
    if generation is not None:
        return generation == 0
    return os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"


def die(config: dict) -> None:
    """SIGKILL this worker (and, with ``kill_parent``, first what started it: the torchrun agent, the Spark task)."""
    if config.get("kill_parent"):
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def train(config: dict) -> dict:
    """One worker's elastic training; returns the committed log and the final parameters."""
    import torch

    import shardwise
    import shardwise.torch as hvd

    torch.set_num_threads(1)
    if os.environ.get("ELASTIC_DEBUG"):
        import faulthandler
        import logging

        trace = open(f"/tmp/elastic_{os.getpid()}.log", "w")
        logging.basicConfig(stream=trace, level=logging.INFO)
        faulthandler.dump_traceback_later(45, file=trace)
    hvd.init()
    x, y = data()
    net = model()
    opt = optimizer(net.parameters(), config.get("zero", 0), net)
    sampler = hvd.elastic.ElasticSampler(range(N), shuffle=True, seed=11)
    state = hvd.elastic.TorchState(net, opt, sampler=sampler, epoch=0, step=0, log=[])
    resets: list[int] = []
    recovered: list[float] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def loop(state: Any) -> None:
        while state.epoch < EPOCHS:
            if state.epoch == EPOCHS - 1:  # the test wants the last epoch on the regrown job
                while hvd.size() < config.get("final_size", 0):
                    time.sleep(0.2)
                    state.check_host_updates()
            order = list(sampler.remaining_indices)
            world = hvd.size()
            mine = list(iter(sampler))
            padded = [order[i % len(order)] for i in range(sampler.total_size)] if order else []
            for b in range(0, len(mine), BATCH):
                idx = mine[b:b + BATCH]
                if (config.get("kill_rank") == hvd.rank() and state.epoch == config.get("kill_epoch", 0)
                        and first_generation()
                        and state.step == config.get("kill_step", 7)):
                    if config.get("stamp"):
                        with open(config["stamp"], "w") as out:
                            out.write(repr(time.time()))
                    die(config)
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(net(x[idx]), y[idx])
                loss.backward()
                opt.step()
                if resets and not recovered:
                    recovered.append(time.time())  # the first step after the first re-forming
                step_global = [padded[b * world + i] for i in range(len(idx) * world)]
                state.log.append((state.epoch, world, sorted(step_global)))
                sampler.record_batch(b // BATCH, BATCH)
                state.step += 1
                time.sleep(config.get("step_sleep", 0.0))
                if state.step % COMMIT_EVERY == 0:
                    state.commit()
            sampler.set_epoch(state.epoch + 1)
            state.epoch += 1
            state.commit()

    loop(state)
    params = [p.detach().numpy().copy() for p in net.parameters()]
    if config.get("zero"):
        params = [v.numpy() for v in opt.full_parameters().values()]
    return {"log": state.log, "params": params, "size": hvd.size(), "resets": resets,
            "recovered_at": recovered[0] if recovered else None,
            "generation": shardwise.current().owned.get("elastic_generation")}


def replay(log: list) -> list[np.ndarray]:
    """The same steps in one process: each logged global batch, mean loss, SGD with momentum."""
    import torch

    x, y = data()
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    for _, _, idx in log:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[idx]), y[idx]).backward()
        opt.step()
    return [p.detach().numpy() for p in net.parameters()]


def check_epochs(log: list) -> None:
    """Every epoch saw every sample, none twice apart from the padding of the epoch's last batch."""
    for epoch in range(EPOCHS):
        steps = [(world, idx) for e, world, idx in log if e == epoch]
        seen = [i for _, idx in steps for i in idx]
        if set(seen) != set(range(N)):
            raise AssertionError(f"epoch {epoch} skipped samples {sorted(set(range(N)) - set(seen))[:10]}")
        repeats = len(seen) - N
        if repeats >= steps[-1][0]:  # padding: fewer than one sample per rank of the last world
            raise AssertionError(f"epoch {epoch} repeated {repeats} samples")
