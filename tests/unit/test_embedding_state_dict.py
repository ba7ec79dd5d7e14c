"""A model holding sharded tables saves and loads its state_dict (this rank's shards, by name) as torch does."""

import pytest
import torch

from shardwise.backends.local import LocalCommunicator
from shardwise.torch.embedding import ShardedEmbeddingBagCollection, TableConfig

pytestmark = pytest.mark.timeout(120)


def _model() -> torch.nn.Module:
    world = LocalCommunicator()  # not shardwise.init(): the unit tests after this one expect no context
    tables = [TableConfig(name="a", num_embeddings=10, embedding_dim=4),
              TableConfig(name="b", num_embeddings=7, embedding_dim=2)]
    return torch.nn.Sequential(ShardedEmbeddingBagCollection(tables, comm=world, seed=3), torch.nn.Linear(2, 2))


def test_the_shards_round_trip_through_a_strict_load_state_dict() -> None:
    model = _model()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert {"0.a__shard0", "0.b__shard0", "1.weight", "1.bias"} <= set(saved)
    model[0].shard("a__shard0").zero_()
    assert str(model.load_state_dict(saved, strict=True)) == "<All keys matched successfully>"
    assert torch.equal(model[0].shard("a__shard0"), saved["0.a__shard0"])
    assert torch.equal(getattr(model[0], "a__shard0"), saved["0.a__shard0"])  # the name reads the shard too


def test_a_strict_load_names_missing_and_unknown_shards() -> None:
    model = _model()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match='Unexpected key.*"0.zzz"'):
        model.load_state_dict({**saved, "0.zzz": torch.zeros(1)}, strict=True)
    del saved["0.b__shard0"]
    with pytest.raises(RuntimeError, match='Missing key.*"0.b__shard0"'):
        model.load_state_dict(saved, strict=True)
