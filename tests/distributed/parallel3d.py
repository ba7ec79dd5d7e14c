"""Pipeline, tensor and data parallelism on real processes, checked against one-process training.

Every rank builds the full reference model with the same seed, trains it on the
full global batch, and compares its own stage / shard after each step: the loss
(last stage), the gradients (after the dp average) and the parameters after the
optimizer step, in float64 to a tight tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.adapters.torch.parallel import (ColumnParallelLinear, PipelineExecutor, RowParallelLinear,
                                               VocabParallelEmbedding, average_gradients, build_groups,
                                               pipeline_from_sequential, split_sequential_chunks,
                                               vocab_parallel_cross_entropy)
from shardwise.core.pipeline import build_schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt_3d  # noqa: E402

RTOL, ATOL = 1e-9, 1e-11
WIDTH, BATCH = 6, 24


def _setup(backend: str) -> Any:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    return shardwise.init(backend=backend).world


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=what)


def _compare(part: nn.Module, ref: nn.Module, grads: bool, what: str) -> int:
    """Compare each parameter (or gradient) of ``part`` with its shard of the same-named reference one."""
    modules, count = dict(ref.named_modules()), 0
    for mname, mod in part.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            r = getattr(modules[mname], pname)
            full = r.grad if grads else r.detach()
            if isinstance(mod, ColumnParallelLinear):
                full = gpt_3d.pad_rows(full, mod.out_features)
            want = mod.shard_like(pname, full) if hasattr(mod, "shard_like") else full
            _close(p.grad if grads else p, want, f"{what}: {'grad' if grads else 'param'} {mname}.{pname}")
            count += 1
    return count


def _batch(step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, WIDTH, generator=gen), torch.randn(size, WIDTH, generator=gen)


def _mlp(depth: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


class _LikeNccl:
    """A communicator whose point-to-point messages behave as NCCL's do, on any backend.

    Tags are dropped, so messages between two ranks match in the order they are posted
    (torch's NCCL group ignores tags). And a rank's first message with each peer waits
    until that peer's first message with it (NCCL creates a pair's communicator then,
    blocking both): a rendezvous over ``handshake``, a communicator of its own.
    A pipeline that is right here is right on NCCL, which this machine does not have.
    """

    def __init__(self, inner: Any, handshake: Any) -> None:
        self._inner, self._handshake, self._met = inner, handshake, set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _meet(self, peer: int) -> None:
        if peer not in self._met:
            self._met.add(peer)
            sent = self._handshake.send_async(np.zeros(1), peer)
            self._handshake.recv(np.zeros(1), peer)
            sent.wait()

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Any:
        self._meet(dest)
        return self._inner.send_async(tensor, dest, 0)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Any:
        self._meet(source)
        return self._inner.recv_async(tensor, source, 0)

    def send(self, tensor: Any, dest: int, tag: int = 0) -> None:
        self._meet(dest)
        self._inner.send(tensor, dest, 0)

    def recv(self, tensor: Any, source: int, tag: int = 0) -> Any:
        self._meet(source)
        return self._inner.recv(tensor, source, 0)


def _train_pipeline(groups: Any, schedule: str, m: int, v: int = 1, steps: int = 2,
                    fixed_shape: bool = False, checkpoint: bool = False, nccl_like: bool = False) -> None:
    """Pipeline (x dp) training of an MLP equals full-batch training of the same MLP.

    ``nccl_like``: point-to-point messages behave as on NCCL (:class:`_LikeNccl`).
    """
    what = f"{schedule} p={groups.pp.size} m={m} v={v} dp={groups.dp.size}{' NCCL-like' if nccl_like else ''}"
    model, ref = _mlp(), _mlp()
    chunks = split_sequential_chunks(model, groups.pp.size, groups.pp.rank, v)
    local = BATCH // groups.dp.size
    shape = (local // m, WIDTH) if fixed_shape else None
    up, down, made = groups.pp, None, []
    if nccl_like:
        made = [groups.pp.duplicate() for _ in range(3)]
        up, down = _LikeNccl(up, made[0]), _LikeNccl(made[1], made[2])
    pipe = PipelineExecutor(chunks, build_schedule(schedule, groups.pp.size, m, v), up, F.mse_loss,
                            activation_shape=shape, checkpoint=checkpoint, down_comm=down)
    opt, ref_opt = (torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in (pipe.parameters(), ref.parameters()))
    lo = groups.dp.rank * local
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad(), ref_opt.zero_grad()
        loss = pipe.step(x[lo:lo + local], y[lo:lo + local])
        average_gradients(pipe.parameters(), groups.dp)
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        if pipe.is_last:
            _close(groups.dp.allreduce(loss, "average"), ref_loss, f"{what}: loss at step {step}")
        assert loss is None or pipe.is_last
        for chunk in pipe.chunks:
            _compare(chunk, ref, True, f"{what} step {step}")
        opt.step(), ref_opt.step()
    for chunk in pipe.chunks:
        _compare(chunk, ref, False, f"{what} after {steps} steps")
    out = pipe.predict(x[lo:lo + local])
    if pipe.is_last:
        _close(out, ref(x)[lo:lo + local], f"{what}: predict")
    for comm in made:
        comm.free()


class _WatchedSends:
    """A communicator that records, at each send, the gradient a watched weight holds then."""

    def __init__(self, inner: Any, weight: torch.Tensor) -> None:
        self._inner, self._weight, self.seen = inner, weight, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Any:
        grad = self._weight.grad
        self.seen.append(None if grad is None else grad.clone())
        return self._inner.send_async(tensor, dest, tag)


def _input_grads_leave_before_weight_grads(groups: Any) -> None:
    """The last stage sends each input gradient before adding that micro-batch's weight gradients."""
    model = _mlp()
    chunk = split_sequential_chunks(model, groups.pp.size, groups.pp.rank, 1)[0]
    down = groups.pp.duplicate()
    first_linear = next(m for m in chunk.modules() if isinstance(m, nn.Linear))
    watched = _WatchedSends(down, first_linear.weight)
    pipe = PipelineExecutor(chunk, build_schedule("1f1b", groups.pp.size, 4), groups.pp, F.mse_loss,
                            down_comm=watched)
    x, y = _batch(0)
    pipe.step(x, y)
    if pipe.is_last:
        assert len(watched.seen) == 4, len(watched.seen)
        # micro-batch 0 creates .grad (autograd); the last send precedes micro-batch 3's weight GEMM
        assert not torch.equal(watched.seen[-1], first_linear.weight.grad), "weight grads ran before the send"
        # the last rank keeps p - 1 >= 1 backwards' weight GEMMs queued past its next compute actions:
        # micro-batch 1's has not run when micro-batch 2's input gradient leaves
        assert torch.equal(watched.seen[1], watched.seen[2]), "weight grads of micro-batch 1 ran too early"
    down.free()


class TPNet(nn.Module):
    """Every tensor-parallel layer kind; plain torch layers when ``tp`` is None."""

    VOCAB, DIM = 11, 8

    def __init__(self, tp: Optional[Any]) -> None:
        super().__init__()
        v, d = self.VOCAB, self.DIM
        self.tp = tp
        if tp is None:
            self.emb = nn.Embedding(v, d)
            self.col1, self.row1 = nn.Linear(d, 12), nn.Linear(12, d)
            self.col2, self.row2 = nn.Linear(d, 6), nn.Linear(6, d)
            self.head = nn.Linear(d, v, bias=False)
        else:
            self.emb = VocabParallelEmbedding(v, d, tp)
            self.col1, self.row1 = ColumnParallelLinear(d, 12, tp), RowParallelLinear(12, d, tp)
            self.col2 = ColumnParallelLinear(d, 6, tp, gather_output=True)
            self.row2 = RowParallelLinear(6, d, tp, input_is_parallel=False)
            self.head = ColumnParallelLinear(d, v + (-v) % tp.size, tp, bias=False)  # padded vocab

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(ids)
        h = h + self.row1(torch.tanh(self.col1(h)))
        h = self.row2(torch.tanh(self.col2(h)))
        logits = self.head(h)
        if self.tp is None:
            return h, F.cross_entropy(logits.reshape(-1, self.VOCAB), target.reshape(-1))
        return h, vocab_parallel_cross_entropy(logits, target, self.tp, vocab_size=self.VOCAB).mean()


def _train_tp(groups: Any, steps: int = 3) -> None:
    """Tensor-parallel (x dp) training of TPNet equals one-process training."""
    what = f"tp={groups.tp.size} dp={groups.dp.size}"
    torch.manual_seed(1)
    ref = TPNet(None)
    model = TPNet(groups.tp)
    gpt_3d.load_reference(model, ref)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, ref))
    batch = 4 * groups.dp.size
    lo, hi = groups.dp.rank * 4, groups.dp.rank * 4 + 4
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        ids, target = (torch.randint(0, TPNet.VOCAB, (batch, 5), generator=gen) for _ in range(2))
        opt.zero_grad(), ref_opt.zero_grad()
        h, loss = model(ids[lo:hi], target[lo:hi])
        loss.backward()
        average_gradients(model.parameters(), groups.dp)
        ref_h, ref_loss = ref(ids, target)
        ref_loss.backward()
        _close(h, ref_h[lo:hi], f"{what}: hidden at step {step}")
        _close(groups.dp.allreduce(loss.detach(), "average"), ref_loss, f"{what}: loss at step {step}")
        assert _compare(model, ref, True, f"{what} step {step}") == 10
        opt.step(), ref_opt.step()
    _compare(model, ref, False, f"{what} after {steps} steps")


def _train_gpt(groups: Any, schedule: str = "1f1b", m: int = 2, steps: int = 2, checkpoint: bool = True) -> None:
    """The example GPT under pp x tp (x dp) equals the plain one-process GPT."""
    what = f"gpt {schedule} pp={groups.pp.size} tp={groups.tp.size} dp={groups.dp.size}"
    cfg = gpt_3d.GPTConfig(vocab=13, seq_len=8, dim=16, heads=4, layers=2)
    torch.manual_seed(2)
    ref = gpt_3d.build_gpt(cfg)
    model = gpt_3d.build_gpt(cfg, groups.tp)
    gpt_3d.load_reference(model, ref)
    chunks = split_sequential_chunks(model, groups.pp.size, groups.pp.rank)
    pipe = PipelineExecutor(chunks, build_schedule(schedule, groups.pp.size, m), groups.pp,
                            gpt_3d.gpt_loss(cfg, groups.tp), checkpoint=checkpoint)
    opt, ref_opt = (torch.optim.SGD(ps, lr=0.5) for ps in (pipe.parameters(), ref.parameters()))
    local = 4
    lo = groups.dp.rank * local
    ref_loss_fn = gpt_3d.gpt_loss(cfg)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, cfg.vocab, (local * groups.dp.size, cfg.seq_len + 1), generator=gen)
        opt.zero_grad(), ref_opt.zero_grad()
        loss = pipe.step(tokens[lo:lo + local, :-1], tokens[lo:lo + local, 1:])
        average_gradients(pipe.parameters(), groups.dp)
        ref_loss = ref_loss_fn(ref(tokens[:, :-1]), tokens[:, 1:])
        ref_loss.backward()
        if pipe.is_last:
            _close(groups.dp.allreduce(loss, "average"), ref_loss, f"{what}: loss at step {step}")
        _compare(chunks[0], ref, True, f"{what} step {step}")
        opt.step(), ref_opt.step()
    _compare(chunks[0], ref, False, f"{what} after {steps} steps")


def _layer_split(groups: Any) -> None:
    """Plain layer split (GPipe, one micro-batch) equals one-process training."""
    model, ref = _mlp(), _mlp()
    pipe = pipeline_from_sequential(model, groups.pp, F.mse_loss)
    x, y = _batch(0)
    loss = pipe.step(x, y)
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    if pipe.is_last:
        _close(loss, ref_loss, "layer split: loss")
    _compare(pipe.chunks[0], ref, True, "layer split")


def two_ranks(backend: str = "mpi") -> None:
    """PP 2 under every schedule (+ plain layer split), then TP 2."""
    world = _setup(backend)
    groups = build_groups(world, pp=2, dp=1)
    _layer_split(groups)
    _train_pipeline(groups, "gpipe", m=3, fixed_shape=True)
    _train_pipeline(groups, "1f1b", m=4, checkpoint=True)
    _train_pipeline(groups, "interleaved", m=4, v=2)
    # GPipe posts a gradient's receive while its peer still waits for activations; interleaved
    # ranks send each other activations and gradients, and post receives ahead of need
    _train_pipeline(groups, "gpipe", m=3, fixed_shape=True, nccl_like=True)
    _train_pipeline(groups, "interleaved", m=4, v=2, nccl_like=True)
    _train_pipeline(groups, "interleaved", m=4, v=2, fixed_shape=True, nccl_like=True)
    _input_grads_leave_before_weight_grads(groups)
    groups.free()
    groups = build_groups(world, tp=2, dp=1)
    _train_tp(groups)
    groups.free()


def four_ranks(backend: str = "mpi") -> None:
    """PP 4 under every schedule, DP x PP, DP x TP and PP x TP (2 x 2 each)."""
    world = _setup(backend)
    groups = build_groups(world, pp=4, dp=1)
    _train_pipeline(groups, "gpipe", m=4)
    _train_pipeline(groups, "1f1b", m=6)
    _train_pipeline(groups, "1f1b", m=2)  # fewer micro-batches than stages
    _train_pipeline(groups, "interleaved", m=4, v=2, fixed_shape=True)
    _train_pipeline(groups, "gpipe", m=4, nccl_like=True)
    _train_pipeline(groups, "interleaved", m=8, v=2, nccl_like=True)
    groups.free()
    groups = build_groups(world, dp=2, pp=2)
    _train_pipeline(groups, "1f1b", m=3)
    _train_pipeline(groups, "interleaved", m=2, v=2)
    groups.free()
    groups = build_groups(world, dp=2, tp=2)
    _train_tp(groups)
    groups.free()
    groups = build_groups(world, pp=2, tp=2, dp=1)
    _train_gpt(groups)
    groups.free()


def gpt_example(argv: list[str]) -> None:
    """Run ``examples/gpt_3d.py`` with ``argv``."""
    sys.argv = ["gpt_3d.py", *argv]
    gpt_3d.main()
