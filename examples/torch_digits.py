"""Data-parallel training of a small CNN on scikit-learn's digits, Horovod style.

Run on two processes::

    shardwise run -np 2 -- python examples/torch_digits.py
    mpirun -np 2 python examples/torch_digits.py          # the same, with OpenMPI directly

Apart from the import this is a Horovod PyTorch script. Rank 0 prints per-epoch
metrics; every epoch ends with an atomic checkpoint in ``--checkpoint-dir``, and
``--resume`` continues a killed run from the newest complete one, ending with the
same parameters as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
import shardwise.torch as hvd
from shardwise.torch.checkpoint import restore_training, save_training


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.02, help="single-rank learning rate (scaled by the world size)")
    p.add_argument("--backend", default=None, help="mpi, torch or local (default: from the launcher)")
    p.add_argument("--checkpoint-dir", default="checkpoints/torch_digits")
    p.add_argument("--stop-after", type=int, default=None,
                   help="end the run after this epoch's checkpoint (to try --resume)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


class DigitsCNN(nn.Module):
    """Two conv layers on the 8x8 digit images, then a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Digits as (N, 1, 8, 8) float images in [0, 1], split 80/20 (the same split on every rank)."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(range(len(y)), test_size=0.2, random_state=seed, stratify=y.numpy())
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole test set: each rank scores its shard, then sums."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            totals += torch.tensor([F.cross_entropy(out, y, reduction="sum").item(),
                                    (out.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    totals = hvd.allreduce(totals, op=hvd.Sum)
    model.train()
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def main(argv: Optional[Sequence[str]] = None) -> dict[str, float]:
    args = parse_args(argv)
    hvd.init(backend=args.backend, monitor=True)  # monitor: time collectives vs compute
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_set, test_set = load_data(args.seed)
    train_sampler = hvd.DistributedSampler(train_set, hvd.size(), hvd.rank(), shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    # A sampler pads shards to equal length, which would score some test samples twice:
    # evaluate on disjoint, unpadded shards instead.
    test_shard = torch.utils.data.Subset(test_set, range(hvd.rank(), len(test_set), hvd.size()))
    test_loader = DataLoader(test_shard, batch_size=256)

    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=hvd.scale_lr(args.lr, hvd.size()), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    monitor = hvd.monitor_optimizer(optimizer)  # one monitored step per optimizer.step()

    world, first_epoch = shardwise.current().world, 0
    if args.resume:
        # Model, optimizer, every rank's RNG state and the data position: the rest of the
        # run then matches an uninterrupted one.
        found = restore_training(args.checkpoint_dir, model=model, optimizer=optimizer, comm=world)
        if found is not None:
            first_epoch = found["position"]["epoch"]
            scheduler.load_state_dict(found["metadata"]["scheduler"])
            if hvd.rank() == 0:
                print(f"resumed from {found['path']} at epoch {first_epoch}", flush=True)

    start, train_loss, test_loss, accuracy = time.time(), 0.0, 0.0, 0.0
    for epoch in range(first_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        seen = torch.zeros(2, dtype=torch.float64)  # loss sum, count
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            seen += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
        scheduler.step()
        seen = hvd.allreduce(seen, op=hvd.Sum)
        train_loss = float(seen[0] / seen[1])
        test_loss, accuracy = evaluate(model, test_loader)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}/{args.epochs}: train_loss={train_loss:.4f} test_loss={test_loss:.4f} "
                  f"test_accuracy={accuracy:.3f} comm={monitor.fraction:.0%} of step time", flush=True)
        # Atomic (temp file, fsync, rename; manifest last), the last two kept.
        path = save_training(args.checkpoint_dir, epoch + 1, model=model, optimizer=optimizer, comm=world,
                             position={"epoch": epoch + 1}, metadata={"scheduler": scheduler.state_dict()},
                             keep=2)
        if args.stop_after is not None and epoch + 1 >= args.stop_after:
            break
    if hvd.rank() == 0:
        print(hvd.format_monitor_summary(monitor))
        print(f"checkpoint: {args.checkpoint_dir} ({time.time() - start:.1f} s on {hvd.size()} ranks)")
        print(f"final: loss={train_loss:.4f} test_accuracy={accuracy:.3f}", flush=True)
        # One machine-readable line for scripts and tests (the lines above are for people).
        print("SHARDWISE_RESULT " + json.dumps({"example": "torch_digits", "ranks": hvd.size(),
                                                "epochs": args.epochs, "loss": train_loss, "test_loss": test_loss,
                                                "test_accuracy": accuracy}), flush=True)
    return {"loss": train_loss, "test_loss": test_loss, "test_accuracy": accuracy}


if __name__ == "__main__":
    main()
