"""Where ``parallelize`` materializes a model: the default-device resolution, without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.adapters.torch.parallel.materialize import (ModelTensors, materialize_buffers, move_materialized,
                                                           resolve_build_device)
from shardwise.core.errors import ConfigError


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def _meta() -> nn.Module:
    with torch.device("meta"):
        return _model()


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA runtime that reports device 3 as this rank's bound device (no tensor is allocated on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


def test_meta_model_defaults_to_the_bound_cuda_device(cuda: None) -> None:
    assert resolve_build_device(_meta()) == torch.device("cuda", 3)


def test_meta_model_without_cuda_defaults_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_build_device(_meta()) == torch.device("cpu")


def test_a_materialized_model_stays_where_it_is_even_with_cuda(cuda: None) -> None:
    assert resolve_build_device(_model()) == torch.device("cpu")


def test_explicit_device_wins_and_bare_cuda_means_the_bound_one(cuda: None) -> None:
    assert resolve_build_device(_meta(), "cpu") == torch.device("cpu")
    assert resolve_build_device(_meta(), torch.device("cpu")) == torch.device("cpu")
    assert resolve_build_device(_meta(), "cuda") == torch.device("cuda", 3)
    assert resolve_build_device(_meta(), "cuda:1") == torch.device("cuda", 1)


def test_meta_is_not_a_build_device() -> None:
    with pytest.raises(ConfigError, match="real device"):
        resolve_build_device(_meta(), "meta")


def test_a_materialized_model_on_another_device_is_refused(cuda: None) -> None:
    with pytest.raises(ConfigError, match="move the model"):
        resolve_build_device(_model(), "cuda:0")
    assert resolve_build_device(_model(), "cpu") == torch.device("cpu")


class _Source:
    """Every parameter's piece is its canonical name's length, as a full tensor of that value."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes

    def local(self, placement, dtype: torch.dtype) -> torch.Tensor:  # noqa: ANN001
        return torch.full(placement.local_shape, float(len(placement.name)), dtype=dtype)


def test_fill_and_materializer_put_meta_parameters_on_the_device() -> None:
    model = _meta()
    tensors = ModelTensors(model, "cpu")
    fill = tensors.materializer(_Source(tensors.expected))
    assert fill.device == torch.device("cpu")
    fill(list(model.named_parameters()))
    for name, p in model.named_parameters():
        assert p.device == torch.device("cpu") and not p.is_meta
        assert torch.equal(p.detach(), torch.full(p.shape, float(len(name))))


def test_buffers_and_leftover_tensors_go_to_the_device() -> None:
    class Record:
        def full(self, name: str) -> torch.Tensor:
            return {"1.running_mean": torch.arange(4.0), "1.running_var": torch.ones(4),
                    "1.num_batches_tracked": torch.tensor(0)}[name]

    model = _meta()
    model[0].weight = nn.Parameter(torch.zeros(4, 3))  # a parameter that is not meta
    materialize_buffers(model, Record(), torch.device("cpu"))
    move_materialized(model, "cpu")
    assert all(b.device == torch.device("cpu") for b in model.buffers())
    assert torch.equal(model[1].running_mean, torch.arange(4.0))
    assert model[1].num_batches_tracked.dtype == torch.int64
    assert model[0].weight.device == torch.device("cpu") and model[0].bias.is_meta


def test_a_gradient_hook_on_a_meta_parameter_fires_after_it_is_materialized() -> None:
    """Tensor parallelism registers gradient sums over tp as hooks at split time, before a meta model
    has memory: they must survive the swap (issue 53: a meta Qwen3 at tp2 lost its q_norm sums)."""
    from shardwise.adapters.torch.parallel.materialize import _swap_in

    param = torch.nn.Parameter(torch.zeros(3, device="meta"))
    param.register_hook(lambda grad: grad * 2)
    _swap_in(param, torch.ones(3))
    (param * 1).sum().backward()
    assert param.device.type == "cpu"
    assert torch.equal(param.grad, torch.full((3,), 2.0))
