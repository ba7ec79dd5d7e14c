"""Reliability scenarios on real processes: mismatches, timeouts, rank death, crash and resume.

Run through the harness (``reliability:<function>``), or as a plain script so an
exception reaches shardwise's excepthook exactly as in a user's program::

    shardwise run -np 2 -- python tests/distributed/reliability.py <function> '{json kwargs}'

Lines starting with ``RELIABILITY`` are what the tests read back.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from typing import Optional

import numpy as np

import shardwise
from shardwise.core.errors import CollectiveMismatchError, CollectiveTimeoutError

# torch is imported only by the scenarios that need it: it dominates start-up time.


def _say(text: str) -> None:
    print(f"RELIABILITY {text}", flush=True)


def _expect_mismatch(comm, what: str, call, *fragments: str) -> None:
    start = time.monotonic()
    try:
        call()
    except CollectiveMismatchError as exc:
        took = time.monotonic() - start
        for fragment in fragments:
            assert fragment in str(exc), f"{what}: {fragment!r} not in {str(exc)!r}"
        _say(f"{what} rank {comm.rank} {took:.4f}s: {exc}")
        return
    raise AssertionError(f"{what}: rank {comm.rank} got no CollectiveMismatchError")


def _full(backend: str, shape: tuple[int, ...], value: float = 1.0):
    """float32 ones: torch tensors for the torch backend, numpy arrays otherwise."""
    if backend == "torch":
        import torch

        return torch.full(shape, value)
    return np.full(shape, value, dtype=np.float32)


def mismatches(backend: str) -> None:
    """Shape mismatch (Horovod's dims = [17 + rank] * 3), skipped call, trailing dims; then recover."""
    comm = shardwise.init(backend=backend, check=True).world
    r = comm.rank
    dims = (17 + r,) * 3
    _expect_mismatch(comm, "shape", lambda: comm.allreduce(_full(backend, dims), name="grad"),
                     "allreduce #1 'grad': rank 1 has shape (18, 18, 18) float32, rank 0 has (17, 17, 17) float32")
    comm.allreduce(_full(backend, (3,)), name="ok")

    def skip() -> None:
        if r != 1:
            comm.allreduce(_full(backend, (4,)), name="a")
        comm.allreduce(_full(backend, (4,)), name="b")

    _expect_mismatch(comm, "skip", skip, "collective #3: rank 1 called allreduce 'b' ((4,) float32), "
                                        "rank 0 called allreduce 'a' ((4,) float32)")
    _expect_mismatch(comm, "gather", lambda: comm.allgather(_full(backend, (2, 3 + r))),
                     "allgather #4: rank 1 has shape (2, 4) float32, rank 0 has (2, 3) float32")
    out = comm.allreduce(_full(backend, (5,), float(r)), name="after")
    assert out.tolist() == [float(sum(range(comm.size)))] * 5, out
    _say(f"recovered rank {r}")


def missing_rank(backend: str, seconds: float) -> None:
    """The last rank never arrives at an allreduce: every waiting rank names it, then the job ends."""
    comm = shardwise.init(backend=backend, timeout=seconds).world
    comm.allreduce(np.ones(4), name="warmup")
    if comm.rank == comm.size - 1:
        time.sleep(120)  # a hung rank
        return
    start = time.monotonic()
    try:
        comm.allreduce(np.ones(4), name="x")
    except CollectiveTimeoutError as exc:
        _say(f"timeout rank {comm.rank} {time.monotonic() - start:.2f}s: {exc}")
        time.sleep(1.0)  # let every waiting rank report before the first abort
        raise  # reaches shardwise's excepthook, which aborts the job
    raise AssertionError("no timeout")


def shutdown_joins_torch_workers() -> None:
    """shardwise.shutdown() joins the gloo worker threads even while the world is still referenced.

    A worker thread alive when the interpreter finalises can abort the process while it
    drops a finished operation's Python tensors; this job ends by exiting normally right
    after its last collective, as a training script does.
    """
    import torch
    from shardwise.core.errors import BackendError

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    world = shardwise.init(backend="torch").world
    with_group = threads()
    t = torch.ones(1 << 16)
    for _ in range(20):  # the last of these finishes just before shutdown
        world.allreduce_async(t, "sum", inplace=True).wait()
    shardwise.shutdown()
    after = threads()
    # ProcessGroupGloo runs 2 worker threads; without the join they outlive shutdown()
    assert after <= with_group - 2, (with_group, after)
    try:
        world.allreduce(t, "sum")
    except BackendError as exc:
        assert "freed" in str(exc), exc
    else:
        raise AssertionError("a freed torch communicator still reduced")
    _say(f"joined {with_group} {after}")


def raise_on_rank1(backend: str) -> None:
    comm = shardwise.init(backend=backend).world
    for step in range(5):
        if step == 3 and comm.rank == 1:
            raise RuntimeError(f"boom on rank 1 at step {step}")
        comm.allreduce(np.ones(8), name="loop")


def kill_rank1(backend: str) -> None:
    comm = shardwise.init(backend=backend).world
    for step in range(100_000):
        if step == 20 and comm.rank == 1:
            _say(f"killing rank 1 at {time.time():.3f}")
            os.kill(os.getpid(), signal.SIGKILL)
        comm.allreduce(np.ones(1024), name="loop")
    raise AssertionError("rank 0 finished a loop that should have been cut short")


# -- deterministic training with checkpoints ----------------------------------------------------
def _batch(rank: int) -> tuple:
    """Data that depends on numpy's and Python's global RNGs (so resuming must restore them)."""
    import torch

    x = np.random.randn(8, 6).astype(np.float32)
    noise = np.array([random.gauss(0.0, 0.1) for _ in range(8)], dtype=np.float32)
    y = np.sin(x.sum(1)) + noise + 0.1 * rank
    return torch.from_numpy(x), torch.from_numpy(y).unsqueeze(1)


class _Momentum:
    """SGD with momentum by hand: ``torch.optim`` imports ``torch._dynamo``, seconds per process."""

    def __init__(self, model, lr: float, beta: float) -> None:
        import torch

        self.params = dict(model.named_parameters())
        self.lr, self.beta = lr, beta
        self.bufs = {n: torch.zeros_like(p) for n, p in self.params.items()}

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for n, p in self.params.items():
                self.bufs[n].mul_(self.beta).add_(p.grad)
                p.sub_(self.lr * self.bufs[n])

    def state_dict(self) -> dict:
        return {"bufs": {n: b.clone() for n, b in self.bufs.items()}, "lr": self.lr, "beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        for n, b in self.bufs.items():
            b.copy_(state["bufs"][n])
        self.lr, self.beta = state["lr"], state["beta"]


def train(runs: list[dict], steps: int, every: int) -> None:
    """One or more training runs in a row; each ``{"ckpt_dir", "out"[, "crash_in_save"]}``."""
    for run in runs:
        _train_one(steps=steps, every=every, **run)


def _train_one(ckpt_dir: str, out: str, steps: int, every: int, crash_in_save: Optional[int] = None) -> None:
    """Data-parallel training on the mpi backend, checkpointing every ``every`` steps, resuming if it can."""
    import torch

    from shardwise.adapters.torch.checkpoint.training import restore_training, save_training

    comm = shardwise.init(backend="mpi").world
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    opt = _Momentum(model, lr=0.05, beta=0.9)
    torch.manual_seed(100 + comm.rank)  # dropout masks differ per rank
    np.random.seed(200 + comm.rank)
    random.seed(300 + comm.rank)
    resumed = restore_training(ckpt_dir, model=model, optimizer=opt, comm=comm)
    start = resumed["position"]["step"] if resumed else 0
    _say(f"rank {comm.rank} starts at step {start}")
    for step in range(start, steps):
        x, y = _batch(comm.rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for name, p in model.named_parameters():
            comm.allreduce(p.grad, "average", inplace=True, name=f"grad.{name}")
        opt.step()
        if (step + 1) % every == 0:
            if crash_in_save == step + 1 and comm.rank == 1:
                _crash_mid_save(ckpt_dir, step + 1)
            save_training(ckpt_dir, step + 1, model=model, optimizer=opt, comm=comm,
                          position={"epoch": 0, "step": step + 1})
    if comm.rank == 0:
        np.savez(out, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    _say(f"rank {comm.rank} finished {steps} steps")


def _crash_mid_save(ckpt_dir: str, step: int) -> None:
    """Rank 1 dies (SIGKILL) after writing half a checkpoint: a file, but no manifest."""
    from shardwise.checkpoint import atomic_write_bytes, checkpoint_dir

    atomic_write_bytes(checkpoint_dir(ckpt_dir, step) / "rng-rank-00001.json", b"{}")
    _say(f"rank 1 dies while saving step {step}")
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    globals()[sys.argv[1]](**json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}"))
