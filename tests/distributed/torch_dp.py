"""PyTorch data-parallel scenarios, run on every rank (see test_torch_dp_mp.py).

Every rank regenerates the whole global batch from a seed and trains a
single-process reference on it locally, so data-parallel results are checked
against exact single-process training (fp32, rtol 1e-5).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
import shardwise.torch as hvd

LOCAL_BATCH = 3
RTOL, ATOL = 1e-5, 1e-6


def _close(got: Any, want: Any, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _same_params(model: nn.Module, ref: nn.Module, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.detach(), q.detach(), f"{what} parameter {name}", rtol, atol)


# -- models and data --------------------------------------------------------------------------
class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 6, 3, stride=2)
        self.fc = nn.Linear(6 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # bias=False: the key bias of attention has an exactly-zero gradient (softmax is shift
        # invariant), whose rounding noise Adam would amplify into large, meaningless differences.
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True,
                                                bias=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).mean(1))


class Branchy(nn.Module):
    """A branch used on some steps/ranks, a never-used layer, a frozen layer and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch, self.never = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.tied = self.head
        self.frozen = nn.Linear(3, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.frozen(self.head(h) + 0.5 * self.tied(h))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"cnn": TinyCNN, "transformer": TinyTransformer, "branchy": Branchy}[kind]()


def _batch(kind: str, step: int, micro: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    shape, classes = {"cnn": ((1, 8, 8), 10), "transformer": ((5, 16), 4), "branchy": ((6,), 3)}[kind]
    return torch.randn((n,) + shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _branch_used(step: int, rank: int) -> bool:
    # step 0: rank 0 only; step 1: every rank; step 2: no rank.
    return (step % 3 == 0 and rank == 0) or step % 3 == 1


# -- one data-parallel run against its single-process reference --------------------------------
def _train(kind: str, opt_name: str, mode: str, *, steps: int = 3, micro: int = 1, cap: int = 25 << 20,
           compression: Any = hvd.Compression.none, average_micro: bool = False,
           tol: tuple[float, float] = (RTOL, ATOL), param_order: Callable[[list], list] = lambda ps: ps) -> None:
    rank, size = hvd.rank(), hvd.size()
    what = f"{kind}/{opt_name}/{mode} micro={micro} cap={cap} compression={compression.__name__}"
    model, ref = _model(kind), _model(kind)
    opt = _optimizer(opt_name, param_order(list(model.parameters())))
    ref_opt = _optimizer(opt_name, ref.parameters())
    if mode == "ddp":
        net = hvd.DistributedDataParallel(model, bucket_cap_bytes=cap, compression=compression)
    else:
        net = model
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                       backward_passes_per_step=micro, bucket_cap_bytes=cap,
                                       average_aggregated_gradients=average_micro)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.7)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    scale = 1.0 / micro if average_micro else 1.0
    for step in range(steps):
        for m in range(micro):
            x, y = _batch(kind, step, m, size * LOCAL_BATCH)
            quiet = net.no_sync() if mode == "ddp" and m < micro - 1 else contextlib.nullcontext()
            with quiet:
                if kind == "branchy":
                    F.cross_entropy(net(x[mine], _branch_used(step, rank)), y[mine]).backward()
                else:
                    F.cross_entropy(net(x[mine]), y[mine]).backward()
            if mode == "ddp":  # done at the end of backward (or not started inside no_sync)
                assert not net.synchronizer.pending
            if kind == "branchy":
                shards = [slice(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH) for r in range(size)]
                loss = sum(F.cross_entropy(ref(x[s], _branch_used(step, r)), y[s]) for r, s in enumerate(shards))
                (loss / size).backward()
            else:
                (F.cross_entropy(ref(x), y) * scale).backward()
        opt.step()
        ref_opt.step()
        if kind == "branchy":
            for p, q in zip(model.parameters(), ref.parameters()):
                assert (p.grad is None) == (q.grad is None), f"{what}: grad presence differs at step {step}"
            assert model.never.weight.grad is None and model.frozen.weight.grad is None
        opt.zero_grad()
        ref_opt.zero_grad()
        sched.step()
        ref_sched.step()
    _same_params(model, ref, what, *tol)


# -- scenarios ----------------------------------------------------------------------------------
def data_parallel(backend: str) -> None:
    """Everything that trains, in one launch (torch.optim's first use costs seconds per process)."""
    hvd.init(backend=backend)
    _training()
    _one_collective_per_bucket()
    _features()
    hvd.shutdown()


def _training() -> None:
    """Equivalence with single-process training: models, optimizers, wrappers, caps, accumulation."""
    _train("cnn", "sgd", "opt")
    _train("cnn", "adam", "ddp")
    _train("transformer", "adam", "opt", cap=1)            # one parameter per bucket
    _train("transformer", "sgd", "ddp", cap=1000)          # linear1/linear2 weights exceed the cap
    _train("cnn", "sgd", "opt", micro=2)                   # backward_passes_per_step=2 (summed)
    _train("transformer", "adam", "opt", micro=2, average_micro=True)
    _train("cnn", "sgd", "ddp", micro=2)                   # no_sync() accumulation
    _train("branchy", "adam", "ddp", steps=4, cap=200)     # unused / frozen / tied parameters
    _train("branchy", "sgd", "opt", steps=4)
    # Ranks listing parameters in different orders agree on rank 0's order.
    _train("cnn", "sgd", "opt", param_order=lambda ps: ps[::-1] if hvd.rank() % 2 else ps)
    # Compression: fp16 within rtol 1e-3 / atol 1e-4, bf16 within rtol 1e-2 / atol 1e-3.
    _train("cnn", "sgd", "opt", compression=hvd.Compression.fp16, tol=(1e-3, 1e-4))
    _train("transformer", "sgd", "ddp", compression=hvd.Compression.fp16, tol=(1e-3, 1e-4))
    _train("cnn", "sgd", "opt", compression=hvd.Compression.bf16, tol=(1e-2, 1e-3))


def _one_collective_per_bucket() -> None:
    """A step issues exactly one allreduce per bucket: no separate collective for gradient presence."""
    model = _model("branchy")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), bucket_cap_bytes=200)
    sync = opt.synchronizer
    calls = []
    real = sync.comm

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def allreduce_async(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(kwargs.get("name"))
            return real.allreduce_async(*args, **kwargs)

    sync.comm = Counting()
    buckets = len(sync.plan.buckets)
    for step in range(3):
        x, y = _batch("branchy", step, 0, LOCAL_BATCH)
        F.cross_entropy(model(x, _branch_used(step, hvd.rank())), y).backward()
        opt.step()
        opt.zero_grad()
        if len(calls) != buckets * (step + 1):
            raise AssertionError(f"step {step}: {len(calls)} allreduces for {buckets} buckets: {calls}")
    sync.comm = real


def _expect(error: type, match: str, fn: Callable[[], Any]) -> str:
    try:
        fn()
    except error as exc:
        assert match in str(exc), f"expected {match!r} in: {exc}"
        return str(exc)
    raise AssertionError(f"expected {error.__name__} containing {match!r}")


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for group in opt.state_dict()["state"].values():
        for value in group.values():
            out.append(value if isinstance(value, torch.Tensor) else torch.tensor(float(value)))
    return out


def _features() -> None:
    """Mismatch errors, state broadcast, SyncBatchNorm, optimizer misuse errors."""
    rank, size = hvd.rank(), hvd.size()
    # Models that differ give a clear error on every rank (never a hang).
    bad = nn.Sequential(nn.Linear(4, 3 + (rank == 1)))
    msg = _expect(hvd.ModelMismatchError, "rank(s) [1]", lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(bad.parameters(), lr=0.1), named_parameters=bad.named_parameters()))
    assert "0.weight" in msg and "rank 1:" in msg, msg
    _expect(hvd.ModelMismatchError, "rank(s) [1]", lambda: hvd.DistributedDataParallel(bad))
    extra = nn.Sequential(*[nn.Linear(4, 4) for _ in range(1 + (rank == size - 1))])
    _expect(ValueError, f"rank(s) [{size - 1}]", lambda: hvd.DistributedDataParallel(extra))

    # Differently initialised ranks become identical: parameters and lazily created optimizer state.
    for opt_name in ("sgd", "adam"):
        torch.manual_seed(100 + rank)
        model = _model("cnn") if rank == 0 else TinyCNN()
        opt = _optimizer(opt_name, model.parameters())
        opt.param_groups[0]["lr"] *= rank + 1
        if rank == 0:  # only rank 0 has state
            x, y = _batch("cnn", 0, 0, 4)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        root_params = hvd.broadcast_object([p.detach().clone() for p in model.parameters()], 0)
        root_state = hvd.broadcast_object(_state_tensors(opt), 0)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), root_params))
        assert len(_state_tensors(opt)) == len(root_state) > 0
        assert all(torch.equal(a, b) for a, b in zip(_state_tensors(opt), root_state)), opt_name
        assert opt.param_groups[0]["lr"] == hvd.broadcast_object(opt.param_groups[0]["lr"], 0)
        dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_optimizer_state(dopt, root_rank=0)
        for step in range(2):
            x, y = _batch("cnn", step, rank, 4)
            F.cross_entropy(model(x), y).backward()
            dopt.step()
            dopt.zero_grad()
        gathered = hvd.allgather_object([p.detach() for p in model.parameters()])
        assert all(torch.equal(a, b) for other in gathered for a, b in zip(other, gathered[0]))

    # Misuse of DistributedOptimizer gives clear errors.
    model = _model("cnn")
    dopt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_bytes=1)
    x, y = _batch("cnn", 0, rank, 2)
    F.cross_entropy(model(x), y).backward()
    # Overlap: every bucket's allreduce was started from the hooks, during backward.
    assert dopt.synchronizer.started_buckets == len(dopt.synchronizer.plan.buckets) == 6
    _expect(shardwise.ShardwiseError, "before optimizer.step()", dopt.zero_grad)
    _expect(shardwise.ShardwiseError, "more than backward_passes_per_step=1",
            lambda: F.cross_entropy(model(x), y).backward())
    dopt.synchronize()
    with dopt.skip_synchronize():
        dopt.step()
    dopt.zero_grad()
    _expect(NotImplementedError, "Adasum", lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(_model("cnn").parameters(), lr=0.1), op=hvd.Adasum))
    _sync_batchnorm(rank, size)


def _sync_batchnorm(rank: int, size: int) -> None:
    # Training a conv net with SyncBatchNorm (DDP) equals BatchNorm on the global batch.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 8 * 8, 10))
    ref = copy.deepcopy(net)
    ddp = hvd.DistributedDataParallel(hvd.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(net)))
    assert isinstance(ddp.module[1], hvd.SyncBatchNorm)
    opt, ref_opt = _optimizer("sgd", ddp.parameters()), _optimizer("sgd", ref.parameters())
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    for step in range(3):
        x, y = _batch("cnn", step, 0, size * LOCAL_BATCH)
        out, ref_out = ddp(x[mine]), ref(x)
        _close(out, ref_out[mine], f"SyncBatchNorm forward step {step}")
        F.cross_entropy(out, y[mine]).backward()
        F.cross_entropy(ref_out, y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    _same_params(ddp.module, ref, "SyncBatchNorm training")
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        _close(getattr(ddp.module[1], name), getattr(ref[1], name), f"SyncBatchNorm {name}")
    ddp.eval()
    ref.eval()
    x, _ = _batch("cnn", 9, 0, size * LOCAL_BATCH)
    _close(ddp(x[mine]), ref(x)[mine], "SyncBatchNorm eval")

    # Uneven local batches, (N, C) input: outputs, input gradients and summed weight gradients.
    torch.manual_seed(1)
    bn, ref_bn = hvd.SyncBatchNorm(5), nn.BatchNorm1d(5)
    with torch.no_grad():
        for m in (bn, ref_bn):
            m.weight.copy_(torch.linspace(0.5, 1.5, 5))
            m.bias.copy_(torch.linspace(-1, 1, 5))
    counts = [2 + r for r in range(size)]
    g = torch.Generator().manual_seed(7)
    x_all = torch.randn(sum(counts), 5, generator=g) * 3 + 1
    w_all = torch.randn(sum(counts), 5, generator=g)
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    x, x_ref = x_all[mine].clone().requires_grad_(), x_all.clone().requires_grad_()
    out, ref_out = bn(x), ref_bn(x_ref)
    (out * w_all[mine]).sum().backward()
    (ref_out * w_all).sum().backward()
    _close(out, ref_out[mine], "SyncBatchNorm uneven forward")
    _close(x.grad, x_ref.grad[mine], "SyncBatchNorm uneven input grad")
    _close(hvd.allreduce(bn.weight.grad, op=hvd.Sum), ref_bn.weight.grad, "SyncBatchNorm weight grad")
    _close(hvd.allreduce(bn.bias.grad, op=hvd.Sum), ref_bn.bias.grad, "SyncBatchNorm bias grad")
    _close(bn.running_var, ref_bn.running_var, "SyncBatchNorm uneven running_var")


def hvd_api() -> None:
    """The Horovod functional API on the world and on process sets (backend from SHARDWISE_BACKEND)."""
    hvd.init()  # exactly as a Horovod script does
    r, p = hvd.rank(), hvd.size()
    assert hvd.is_initialized() and (hvd.local_rank(), hvd.local_size()) == (r, p)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)

    def base(k: int) -> torch.Tensor:
        return torch.arange(6, dtype=torch.float32) * (k + 1) - 2

    x, every = base(r), torch.stack([base(k) for k in range(p)])
    _close(hvd.allreduce(x), every.mean(0), "allreduce default (Average)")
    _close(x, base(r), "allreduce leaves its input alone")
    _close(hvd.allreduce(x, op=hvd.Sum), every.sum(0), "allreduce Sum")
    _close(hvd.allreduce(x, average=False), every.sum(0), "allreduce average=False")
    _close(hvd.allreduce(x, op=hvd.Min), every.min(0).values, "allreduce Min")
    _close(hvd.allreduce(x, op=hvd.Max), every.max(0).values, "allreduce Max")
    _close(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), every.sum(0) / 2, "scaled")
    fp16 = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert fp16.dtype == torch.float32
    _close(fp16, every.mean(0), "allreduce fp16", rtol=1e-3, atol=1e-3)
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y
    _close(y, every.sum(0), "allreduce_")
    handle = hvd.allreduce_async(x, op=hvd.Max)
    _close(hvd.synchronize(handle), every.max(0).values, "allreduce_async")
    assert hvd.poll(handle)
    y = x.clone()
    handle = hvd.allreduce_async_(y)
    assert hvd.synchronize(handle) is y
    _close(y, every.mean(0), "allreduce_async_")
    xg = x.clone().requires_grad_()
    hvd.allreduce(xg, op=hvd.Sum).sum().backward()
    _close(xg.grad, torch.full_like(x, float(p)), "allreduce backward")
    # Adasum of identical vectors is that vector (the adaptive sum halves each of the parallel parts).
    _close(hvd.allreduce(base(0).double(), op=hvd.Adasum), base(0).double(), "allreduce Adasum")

    # allgather with first dimensions that differ per rank (and its gradient).
    t = torch.full((r + 1, 2), float(r), requires_grad=True)
    gathered = hvd.allgather(t)
    _close(gathered, torch.cat([torch.full((k + 1, 2), float(k)) for k in range(p)]), "allgather")
    gathered.sum().backward()
    _close(t.grad, torch.ones_like(t), "allgather backward")
    _close(hvd.synchronize(hvd.allgather_async(t.detach())), gathered.detach(), "allgather_async")

    _close(hvd.broadcast(x, root_rank=p - 1), base(p - 1), "broadcast")
    _close(x, base(r), "broadcast leaves its input alone")
    y = x.clone()
    assert hvd.broadcast_(y, root_rank=0) is y
    _close(y, base(0), "broadcast_")
    _close(hvd.synchronize(hvd.broadcast_async(x, 1)), base(1), "broadcast_async")

    # alltoall: even blocks, then explicit splits (rank i sends (i + j) % 2 + 1 rows to rank j).
    def rows(k: int, n: int) -> torch.Tensor:
        return torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + 100 * k

    got = hvd.alltoall(rows(r, 2 * p))
    _close(got, torch.cat([rows(k, 2 * p)[2 * r: 2 * r + 2] for k in range(p)]), "alltoall")
    splits = {k: [(k + j) % 2 + 1 for j in range(p)] for k in range(p)}
    out, received = hvd.alltoall(rows(r, sum(splits[r])), splits=splits[r])
    assert received.tolist() == [splits[k][r] for k in range(p)], received
    want = torch.cat([rows(k, sum(splits[k]))[sum(splits[k][:r]): sum(splits[k][:r + 1])] for k in range(p)])
    _close(out, want, "alltoall splits")

    # reducescatter: rows split like numpy.array_split, default op Average.
    full = torch.stack([torch.arange(2 * p + 1, dtype=torch.float32) * (k + 1) for k in range(p)])
    sizes = [len(c) for c in torch.arange(2 * p + 1).tensor_split(p)]
    lo = sum(sizes[:r])
    _close(hvd.reducescatter(full[r]), full.mean(0)[lo: lo + sizes[r]], "reducescatter")
    _close(hvd.reducescatter(full[r], op=hvd.Sum), full.sum(0)[lo: lo + sizes[r]], "reducescatter Sum")

    hvd.barrier()
    assert hvd.broadcast_object({"from": r}, root_rank=p - 1) == {"from": p - 1}
    assert hvd.allgather_object(r * 10) == [k * 10 for k in range(p)]
    assert list(hvd.DistributedSampler(range(4 * p), shuffle=False)) == list(range(r, 4 * p, p))
    assert hvd.scale_lr(0.1, p) == 0.1 * p

    # Process sets: a registered subset runs its own collectives; others are refused.
    pair = hvd.add_process_set([0, 1])
    odd = hvd.add_process_set(hvd.ProcessSet(range(1, p, 2)))
    assert hvd.global_process_set.size() == p and pair.size() == 2
    if r in (0, 1):
        assert pair.included() and pair.rank() == r
        _close(hvd.allreduce(x, op=hvd.Sum, process_set=pair), base(0) + base(1), "process set allreduce")
        _close(hvd.allgather(x[None], process_set=pair), torch.stack([base(0), base(1)]), "set allgather")
        _close(hvd.broadcast(x, 1, process_set=pair), base(1), "process set broadcast")
    else:
        assert not pair.included() and pair.rank() == -1
        _expect(ValueError, "not a member", lambda: hvd.allreduce(x, process_set=pair))
    if r % 2:
        members = list(range(1, p, 2))
        _close(hvd.allreduce(x, process_set=odd), torch.stack([base(k) for k in members]).mean(0), "odd set")
        assert hvd.allgather_object(r, process_set=odd) == members
    _expect(ValueError, "not registered", lambda: hvd.allreduce(x, process_set=hvd.ProcessSet([0])))
    assert hvd.remove_process_set(pair) and not hvd.remove_process_set(pair)
    hvd.barrier(process_set=hvd.global_process_set)
    hvd.shutdown()
    assert not hvd.is_initialized()


def digits_example(backend: str, checkpoint_dir: str) -> None:
    """examples/torch_digits.py end to end: accuracy above 0.9, atomic checkpoints, exact resume."""
    import importlib.util
    import os
    from pathlib import Path

    from shardwise.checkpoint import latest_checkpoint
    from shardwise.adapters.torch.checkpoint.training import load_torch

    path = Path(__file__).resolve().parents[2] / "examples" / "torch_digits.py"
    spec = importlib.util.spec_from_file_location("torch_digits", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    metrics = example.main(["--backend", backend, "--checkpoint-dir", checkpoint_dir])
    assert metrics["test_accuracy"] > 0.9, metrics
    hvd.barrier()
    if hvd.rank() == 0:
        assert sorted(os.listdir(checkpoint_dir)) == ["ckpt-10", "ckpt-9"], os.listdir(checkpoint_dir)
        newest = latest_checkpoint(checkpoint_dir)
        model = example.DigitsCNN()
        model.load_state_dict(load_torch(newest / "model.pt"))
    # A run stopped after epoch 1 and resumed ends exactly where an uninterrupted one does.
    whole = example.main(["--backend", backend, "--epochs", "3", "--checkpoint-dir", checkpoint_dir + "-whole"])
    example.main(["--backend", backend, "--epochs", "3", "--stop-after", "1", "--checkpoint-dir",
                  checkpoint_dir + "-cut"])
    resumed = example.main(["--backend", backend, "--epochs", "3", "--resume", "--checkpoint-dir",
                            checkpoint_dir + "-cut"])
    assert resumed == whole, (resumed, whole)
    hvd.shutdown()
