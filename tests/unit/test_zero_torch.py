"""ZeRO for torch in one process: errors, checkpoint refusal, consolidation CLI."""

import numpy as np
import pytest
import torch
from torch import nn

import shardwise
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.checkpoint.zero_torch import load_zero_checkpoint, save_zero_checkpoint
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
