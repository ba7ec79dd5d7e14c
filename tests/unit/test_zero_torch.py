"""ZeRO for torch in one process: errors, checkpoint refusal, consolidation CLI."""

import copy
import numpy as np
import pytest
import torch
from torch import nn

import shardwise
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.adapters.torch.checkpoint.zero import load_zero_checkpoint, save_zero_checkpoint
from shardwise.backends.local import LocalCommunicator
from shardwise.core.errors import CheckpointError, ConfigError


def test_bad_stage_and_offload():
    with pytest.raises(ConfigError, match="stage must be 1, 2 or 3, got 4"):
        ZeroOptimizer(nn.Linear(2, 2), stage=4, comm=LocalCommunicator())
    with pytest.raises(ConfigError, match="offload_optimizer must be 'none' or 'cpu'"):
        ZeroOptimizer(nn.Linear(2, 2), stage=1, comm=LocalCommunicator(), offload_optimizer="nvme")


def test_checkpoint_of_another_model_is_refused_with_keys(tmp_path):
    comm = LocalCommunicator()
    opt = ZeroOptimizer(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), stage=1, comm=comm, lr=0.1)
    save_zero_checkpoint(opt, tmp_path / "a")
    other = ZeroOptimizer(nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2), nn.Linear(2, 2)), stage=1, comm=comm)
    with pytest.raises(CheckpointError, match=r"missing from the ZeRO checkpoint \(2\): 2.bias, 2.weight.*"
                                              r"0.bias ZeRO checkpoint \(3,\) vs model \(5,\)"):
        load_zero_checkpoint(other, tmp_path / "a")


def test_truncated_shard_is_refused(tmp_path):
    comm = LocalCommunicator()
    opt = ZeroOptimizer(nn.Linear(4, 3), stage=2, comm=comm, lr=0.1)
    save_zero_checkpoint(opt, tmp_path / "a")
    shard = tmp_path / "a" / "zero-shard-00000-of-00001.npz"
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="missing or corrupt"):
        load_zero_checkpoint(opt, tmp_path / "a")
    with pytest.raises(CheckpointError, match="zero-meta.json is missing"):
        load_zero_checkpoint(opt, tmp_path)


def test_consolidate_cli(tmp_path):
    from shardwise import cli

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = ZeroOptimizer(model, stage=3, comm=LocalCommunicator(), lr=0.1)
    save_zero_checkpoint(opt, tmp_path / "ckpt")
    assert cli.main(["checkpoint", "consolidate", str(tmp_path / "ckpt"), str(tmp_path / "full.pt")]) == 0
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    for name, value in opt.full_parameters().items():
        assert torch.equal(full[name], value)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_stage1_gradients_live_in_the_unit_buffer(set_to_none):
    torch.manual_seed(0)
    model, ref = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)), nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    ref.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=1, comm=LocalCommunicator(), lr=0.1,
                        gradient_accumulation_steps=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (unit,) = opt.units
    for step in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad()
        if set_to_none:
            assert all(p.grad is None for p in model.parameters())
        for micro in range(2):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + micro))
            model(x).pow(2).mean().backward()
            (ref(x).pow(2).mean() / 2).backward()
            buffer = unit.grad_flat.untyped_storage().data_ptr()
            assert all(p.grad.untyped_storage().data_ptr() == buffer for p in model.parameters()), \
                "every .grad is a view of the unit's flat gradient buffer"
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [1, 2])
def test_units_stepped_one_at_a_time_equal_one_optimizer_step(stage):
    from shardwise.adapters.torch.zero.step import steps_per_unit

    torch.manual_seed(0)
    model, ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, comm=LocalCommunicator(), lr=0.05,
                        bucket_cap_bytes=256)
    assert len(opt.units) > 1 and steps_per_unit(opt.inner, opt.units)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(4):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert len(opt.inner.param_groups[0]["params"]) == len(opt.units), "the group gets all its shards back"


def test_optimizers_that_may_mix_parameters_step_whole():
    from shardwise.adapters.torch.zero.step import steps_per_unit

    class Custom(torch.optim.SGD):  # a user's subclass: its step might look across parameters
        pass

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = ZeroOptimizer(model, Custom, stage=1, comm=LocalCommunicator(), lr=0.1, bucket_cap_bytes=256)
    assert len(opt.units) > 1 and not steps_per_unit(opt.inner, opt.units)
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=1, comm=LocalCommunicator(), lr=0.1, bucket_cap_bytes=256)
    handle = opt.inner.register_step_post_hook(lambda *a: None)
    assert not steps_per_unit(opt.inner, opt.units), "step hooks must see one step"
    handle.remove()
    assert steps_per_unit(opt.inner, opt.units)


def test_overlap_publish_is_refused_at_stage_3():
    with pytest.raises(ConfigError, match="overlap_publish applies to stages 1 and 2"):
        ZeroOptimizer(nn.Linear(2, 2), stage=3, comm=LocalCommunicator(), overlap_publish=True)


class _LazyGather:
    """A gather whose result lands in ``out`` only when waited for, as a real one may."""

    def __init__(self, out, blocks) -> None:
        self.out, self.blocks, self.waited = out, blocks, False

    def done(self) -> bool:
        return self.waited

    def wait(self, timeout=None):
        if not self.waited:
            self.out.copy_(torch.from_numpy(np.concatenate(self.blocks)))
            self.waited = True
        return self.out


@pytest.mark.parametrize("stage", [1, 2])
def test_overlap_publish_waits_for_each_unit_before_its_forward(stage, tmp_path):
    from fake_group import FakeComm, run_group

    from shardwise.core.comm import CompletedHandle

    class LazyComm(FakeComm):
        def reduce_scatter_async(self, tensor, op="sum", *, name=None):
            block = super().reduce_scatter_async(tensor.detach().numpy(), op).wait()
            return CompletedHandle(torch.from_numpy(np.ascontiguousarray(block)))

        def allgather_into_async(self, out, tensor, *, name=None):
            return _LazyGather(out, self._meet("allgather", tensor.detach().numpy().copy()))

    torch.manual_seed(0)  # one model built here: the ranks' threads share torch's generator
    initial = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def train(comm, overlap):
        comm.__class__ = LazyComm  # run_group builds FakeComms
        net = copy.deepcopy(initial)
        opt = ZeroOptimizer(net, torch.optim.Adam, stage=stage, comm=comm, lr=0.05, bucket_cap_bytes=512,
                            overlap_publish=overlap)
        losses = []
        for step in range(4):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + comm.rank))
            opt.zero_grad()
            loss = net(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        pending = sum(u.publishing is not None for u in opt.units) if overlap else 0
        if overlap:  # a checkpoint waits for the gathers before it reads or rewrites the masters
            save_zero_checkpoint(opt, tmp_path / f"stage{stage}", step=4)
            assert all(u.publishing is None for u in opt.units)
        state = {k: v.clone() for k, v in net.state_dict().items()}  # waits for the last gathers
        return losses, pending, state, len(opt.units)

    for rank, ((plain_losses, _, plain_state, n_units), (losses, pending, state, _)) in enumerate(zip(
            run_group(2, lambda c: train(c, False)), run_group(2, lambda c: train(c, True)))):
        assert n_units > 1
        assert pending == n_units, f"rank {rank}: the last step's gathers should still be in flight"
        assert losses == plain_losses, f"rank {rank}"
        for name in plain_state:
            assert torch.equal(state[name], plain_state[name]), name


class _Checkpointed(nn.Module):
    """Three blocks, each run under non-reentrant activation checkpointing (recomputed in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("early_stop", [True, False])
def test_stage3_with_activation_checkpointing_matches_plain_training(early_stop):
    """A unit's forward recomputed in backward keeps its parameters until its gradients are taken.

    Without early stop the recomputation runs the unit's forward hooks to the end, the post-forward one included.
    """
    from torch.utils.checkpoint import set_checkpoint_early_stop

    torch.manual_seed(0)
    model, ref = _Checkpointed(), _Checkpointed()
    ref.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model, torch.optim.Adam, stage=3, comm=LocalCommunicator(), lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            with set_checkpoint_early_stop(early_stop):
                m(x).pow(2).mean().backward()
            o.step()
    assert all(not u.gathered for u in opt.units), "every unit is freed again after backward"
    for unit in opt.units:
        unit.gather()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_expert_params_get_units_of_their_own_over_expert_comm(stage, tmp_path):
    """Expert parameters (expert parallelism) are partitioned over ``expert_comm`` in units of their own
    (stage 3: their owning module's), their reduced gradients scaled by ``expert_grad_scale``; a frozen
    parameter is in no unit; what cannot hold experts (a full state dict, resharding, the standalone
    ZeRO checkpoint) refuses them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    model[0].bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    dp, edp = LocalCommunicator(), LocalCommunicator()
    experts = list(model[1][0].parameters())
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=stage, comm=dp, expert_params=experts, expert_comm=edp,
                        expert_grad_scale=0.5, lr=1.0)
    expert_units = [u for u in opt.units if u.comm is edp]
    assert [p for u in expert_units for p in u.params] == experts
    assert all(u.grad_scale == 0.5 for u in expert_units)
    assert all(u.comm is dp and u.grad_scale == 1.0 for u in opt.units if u not in expert_units)
    assert all(p is not model[0].bias for u in opt.units for p in u.params)
    if stage == 3:
        assert [u.module for u in expert_units] == [model[1][0]]
    x = torch.randn(5, 4)
    model(x).sum().backward()
    opt.step()
    ref(x).sum().backward()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.grad is not None:
                p -= p.grad * (0.5 if name.startswith("1.0.") else 1.0)
    want = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    got = opt.full_parameters()
    assert set(got) == set(want)
    for name, value in got.items():
        assert torch.allclose(value, want[name], atol=1e-6), name
    for call in (opt.full_state_dict, lambda: opt.reshard(dp), lambda: save_zero_checkpoint(opt, tmp_path / "z")):
        with pytest.raises(ConfigError, match="with expert_params is not supported"):
            call()


def test_expert_params_need_expert_comm():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="expert_params need expert_comm="):
        ZeroOptimizer(model, stage=1, comm=LocalCommunicator(), expert_params=list(model[1].parameters()))
