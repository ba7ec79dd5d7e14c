"""ElasticSampler: after a reset mid-epoch the new world shares exactly the samples not yet seen."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shardwise.adapters.torch.elastic import ElasticSampler, TorchState  # noqa: E402


def epoch_batches(sampler: ElasticSampler, world: int, batch: int, steps: int) -> list[int]:
    """Indices that ``world`` ranks process in ``steps`` steps of ``batch`` each, recorded in the sampler."""
    shards = []
    for r in range(world):
        sampler.split(world, r)
        shards.append(list(iter(sampler)))
    sampler.split(world, 0)
    seen = []
    for step in range(steps):
        for shard in shards:
            seen += shard[step * batch:(step + 1) * batch]
        sampler.record_batch(step, batch)
    return seen


def test_a_resized_world_continues_the_epoch_without_repeats_or_gaps() -> None:
    sampler = ElasticSampler(range(100), shuffle=True, seed=3)
    seen = epoch_batches(sampler, world=3, batch=4, steps=5)        # 60 samples on 3 ranks
    state = sampler.state_dict()
    resumed = ElasticSampler(range(100), shuffle=True, seed=3)
    resumed.load_state_dict(state)
    seen += epoch_batches(resumed, world=2, batch=4, steps=5)       # the remaining 40 on 2 ranks
    assert sorted(seen) == list(range(100))


def test_the_last_batch_is_padded_and_set_epoch_reshuffles() -> None:
    sampler = ElasticSampler(range(10), shuffle=True, seed=0)
    sampler.split(3, 1)
    assert len(sampler) == 4 and sampler.total_size == 12
    first = list(sampler.remaining_indices)
    sampler.set_epoch(1)
    assert sampler.processed_num == 0 and list(sampler.remaining_indices) != first
    assert sorted(sampler.remaining_indices) == list(range(10))


def test_torch_state_commit_and_restore_without_a_job() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(range(8), shuffle=False)
    state = TorchState(model, opt, sampler=sampler, epoch=1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sampler.record_batch(0, 2)
    state.save()
    committed = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sampler.record_batch(1, 2)
    state.epoch = 9
    state.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), committed))
    assert sampler.processed_num == 2 and state.epoch == 1
    assert opt.state_dict()["state"]  # momentum buffers came back too
    with pytest.raises(ValueError, match="cannot replace"):
        state.model = "not a module"
