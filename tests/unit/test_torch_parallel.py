"""Single-process checks of the torch pipeline / tensor / layer parallel adapter (group of size 1)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from shardwise.adapters.torch.parallel import (ColumnParallelLinear, PipelineExecutor, RowParallelLinear,  # noqa: E402
                                               VocabParallelEmbedding, build_groups, pipeline_from_sequential,
                                               split_sequential, split_sequential_chunks, stage_ranges,
                                               vocab_parallel_cross_entropy)
from shardwise.backends.local import LocalCommunicator  # noqa: E402
from shardwise.core.errors import ConfigError, MeshError  # noqa: E402
from shardwise.core.pipeline import build_schedule  # noqa: E402


@pytest.fixture()
def comm() -> LocalCommunicator:
    return LocalCommunicator()


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def test_split_sequential_keeps_names_and_balances() -> None:
    model = _mlp()
    ranges = stage_ranges(model, 3)
    assert [len(r) for r in ranges] and ranges[0].start == 0 and ranges[-1].stop == 5
    stages = [split_sequential(model, 3, s) for s in range(3)]
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    assert stages[0][0] is model[0]  # shared, not copied
    chunks = split_sequential_chunks(model, 2, 1, virtual_stages=2)
    assert [list(c._modules) for c in chunks] == [list(split_sequential(model, 4, s)._modules) for s in (1, 3)]


def test_split_sequential_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match="3 layer costs"):
        split_sequential(_mlp(), 2, 0, costs=[1, 2, 3])
    with pytest.raises(ConfigError, match="stage 2"):
        split_sequential(_mlp(), 2, 2)
    with pytest.raises(ConfigError, match="nn.Sequential"):
        stage_ranges(nn.Linear(2, 2), 1)


@pytest.mark.parametrize("schedule,m,v", [("gpipe", 1, 1), ("1f1b", 4, 1), ("interleaved", 2, 3)])
def test_single_rank_pipeline_matches_full_batch(comm: LocalCommunicator, schedule: str, m: int, v: int) -> None:
    model, ref = _mlp(), _mlp()
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    pipe = pipeline_from_sequential(model, comm, F.mse_loss, schedule=schedule, num_microbatches=m,
                                    virtual_stages=v, checkpoint=True)
    loss = pipe.step(x, y)
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad)
    torch.testing.assert_close(pipe.predict(x), ref(x).detach())


def test_pipeline_config_errors(comm: LocalCommunicator) -> None:
    model = _mlp()
    with pytest.raises(ConfigError, match="virtual_stages=2"):
        PipelineExecutor([model], build_schedule("interleaved", 1, 2, 2), comm, F.mse_loss)
    with pytest.raises(ConfigError, match="2 stages"):
        PipelineExecutor(model, build_schedule("gpipe", 2, 2), comm, F.mse_loss)
    with pytest.raises(ConfigError, match="needs a loss_fn"):
        PipelineExecutor(model, build_schedule("gpipe", 1, 2), comm)
    pipe = PipelineExecutor(model, build_schedule("1f1b", 1, 3), comm, F.mse_loss)
    with pytest.raises(ConfigError, match=r"batch size \(8,\) is not divisible by num_microbatches=3"):
        pipe.step(torch.randn(8, 4), torch.randn(8, 3))
    with pytest.raises(ConfigError, match="needs inputs"):
        pipe.step(None, torch.randn(9, 3))


def test_tensor_parallel_layers_of_one_rank_equal_plain_layers(comm: LocalCommunicator) -> None:
    lin = nn.Linear(6, 4)
    x = torch.randn(3, 6)
    for layer in (ColumnParallelLinear.from_full(lin.weight, lin.bias, comm, gather_output=True),
                  RowParallelLinear.from_full(lin.weight, lin.bias, comm, input_is_parallel=False)):
        torch.testing.assert_close(layer(x), lin(x))
    torch.manual_seed(3)
    plain = nn.Linear(5, 7)
    torch.manual_seed(3)
    col = ColumnParallelLinear(5, 7, comm)
    assert torch.equal(col.weight, plain.weight) and torch.equal(col.bias, plain.bias)
    torch.manual_seed(4)
    emb = nn.Embedding(9, 3)
    torch.manual_seed(4)
    par = VocabParallelEmbedding(9, 3, comm)
    ids = torch.randint(0, 9, (2, 5))
    torch.testing.assert_close(par(ids), emb(ids))
    with pytest.raises(ConfigError, match=r"full weight has shape \(4, 6\), expected \(7, 5\)"):
        col.load_full(lin.weight, None)


def test_vocab_parallel_cross_entropy_masks_padding(comm: LocalCommunicator) -> None:
    logits = torch.randn(4, 5, 7, requires_grad=True)
    target = torch.randint(0, 7, (4, 5))
    padded = torch.cat([logits, torch.full((4, 5, 3), 9.0)], dim=-1)
    loss = vocab_parallel_cross_entropy(padded, target, comm, vocab_size=7).mean()
    ref = F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1))
    torch.testing.assert_close(loss, ref)
    got, = torch.autograd.grad(loss, logits)
    want, = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(got, want)
    with pytest.raises(ConfigError, match="does not match"):
        vocab_parallel_cross_entropy(padded, target[0], comm)


def test_build_groups_on_one_rank(comm: LocalCommunicator) -> None:
    groups = build_groups(comm)
    assert (groups.dp.size, groups.pp.size, groups.tp.size) == (1, 1, 1)
    assert groups.is_first_stage and groups.is_last_stage
    with pytest.raises(MeshError):
        build_groups(comm, pp=2)


def test_two_rank_pipeline_posts_receives_before_computing() -> None:
    """The next receive is posted before the preceding compute, so its message lands during compute."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from fake_group import run_group

    x, y = torch.randn(8, 4), torch.randn(8, 3)
    ref = _mlp()
    F.mse_loss(ref(x), y).backward()

    class Posting:
        """A fake rank that passes torch tensors as numpy views and logs when receives are posted."""

        def __init__(self, inner, log):
            self.inner, self.log = inner, log

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def send_async(self, t, dest, tag=0):
            return self.inner.send_async(t.detach().numpy(), dest, tag)

        def recv_async(self, t, source, tag=0):
            self.log.append(("post", tag))
            return self.inner.recv_async(t.numpy(), source, tag)

        def recv(self, t, source, tag=0):
            return self.recv_async(t, source, tag).wait()

        def duplicate(self):
            return Posting(self.inner.duplicate(), self.log)

    models = [_mlp(), _mlp()]  # built here: the global RNG is not thread-safe to seed per rank

    def body(fake):
        log: list = []
        model = models[fake.rank]
        pipe = pipeline_from_sequential(model, Posting(fake, log), F.mse_loss, schedule="1f1b",
                                        num_microbatches=4, activation_shape=(2, 8))
        for c in pipe.chunks:
            c.register_forward_hook(lambda *_: log.append(("forward",)))
        pipe.step(x, y)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return log, grads

    results = run_group(2, body)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    (_, grads0), (log1, grads1) = results
    ref_grads = dict(ref.named_parameters())
    for name, g in {**grads0, **grads1}.items():
        torch.testing.assert_close(g, ref_grads[name].grad)
    # Rank 1 receives four activations: the one for micro-batch k + 1 is posted before forward k runs.
    forwards = [i for i, e in enumerate(log1) if e[0] == "forward"]
    posts = [i for i, e in enumerate(log1) if e[0] == "post"]
    assert all(sum(p < f for p in posts) >= k + 2 for k, f in enumerate(forwards[:3])), log1
