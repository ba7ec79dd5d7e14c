"""TorchRec models in and out: its ``EmbeddingBagConfig``, ``KeyedJaggedTensor`` and
``EmbeddingBagCollection`` state_dict, for :class:`~.collection.ShardedEmbeddingBagCollection`.

A TorchRec model moves to shardwise with :func:`as_table_configs` (its tables),
:func:`load_torchrec_state_dict` (its unsharded ``EmbeddingBagCollection``'s weights) and
:func:`as_kjt` (its batches), and back with :func:`torchrec_state_dict`, which an
``EmbeddingBagCollection`` of the same tables loads with ``load_state_dict(strict=True)``.
torchrec is never imported here unless asked for a torchrec object (:func:`torchrec_table_configs`):
its objects are recognised by their class's module, so shardwise works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

import torch

from ....core.embedding_plan import TableConfig
from ....core.errors import ConfigError, ShapeMismatchError
from .jagged import KeyedJaggedTensor
from .tables_io import check_full_tables, full_tables, load_full_tables

if TYPE_CHECKING:  # pragma: no cover
    from .collection import ShardedEmbeddingBagCollection

__all__ = ["as_table_configs", "as_kjt", "load_torchrec_state_dict", "torchrec_state_dict",
           "torchrec_table_configs", "is_torchrec"]

_POOLING = {"SUM": "sum", "MEAN": "mean"}
#: EmbeddingBagConfig fields shardwise cannot express, and the value each must have.
_UNSUPPORTED = {"need_pos": False, "num_embeddings_post_pruning": None, "total_num_buckets": None,
                "use_virtual_table": False, "virtual_table_eviction_policy": None}
_SUFFIX = ".weight"


def _torchrec_classes(obj: Any) -> list[str]:
    """Names of the torchrec classes ``obj`` is an instance of (none for other objects)."""
    return [c.__name__ for c in type(obj).__mro__ if c.__module__.split(".")[0] == "torchrec"]


def is_torchrec(obj: Any, name: str) -> bool:
    """Whether ``obj`` is an instance of torchrec's class ``name`` (or of a subclass), without importing torchrec."""
    return name in _torchrec_classes(obj)


def _enum_name(value: Any) -> str:
    return str(getattr(value, "name", value))


def _from_torchrec(config: Any, weighted: Optional[bool]) -> TableConfig:
    name = getattr(config, "name", "")
    pooling = _enum_name(config.pooling)
    if pooling not in _POOLING:
        raise ConfigError(f"table {name!r}: pooling {pooling} cannot be expressed; shardwise's tables pool bags by "
                          "SUM or MEAN (an unpooled table is an EmbeddingCollection's, not an EmbeddingBagCollection's)")
    data_type = _enum_name(config.data_type)
    if data_type != "FP32":
        raise ConfigError(f"table {name!r}: data_type {data_type} cannot be expressed; shardwise's tables are "
                          "FP32 (train in FP32 and quantize the exported tables)")
    input_dim = getattr(config, "input_dim", None)
    if input_dim is not None and input_dim != config.num_embeddings:
        raise ConfigError(f"table {name!r}: input_dim {input_dim} (other than num_embeddings "
                          f"{config.num_embeddings}) cannot be expressed")
    for field, plain in _UNSUPPORTED.items():
        value = getattr(config, field, plain)
        if value != plain:
            raise ConfigError(f"table {name!r}: {field}={value!r} cannot be expressed (shardwise needs "
                              f"{field}={plain!r})")
    return TableConfig(name=name, num_embeddings=config.num_embeddings, embedding_dim=config.embedding_dim,
                       feature_names=tuple(config.feature_names), pooling=_POOLING[pooling], weighted=weighted)


def as_table_configs(tables: Any, *, weighted: Optional[bool] = None) -> list[TableConfig]:
    """shardwise :class:`TableConfig` s for ``tables``: ours pass through; torchrec ``EmbeddingBagConfig`` s
    (or a torchrec ``EmbeddingBagCollection``, for its configs) are converted: name, num_embeddings,
    embedding_dim, feature_names (none: one named like the table, as TorchRec does) and pooling SUM/MEAN.
    ``weighted`` becomes each converted table's :attr:`TableConfig.weighted` (TorchRec's ``is_weighted``
    of the collection they belong to; an ``EmbeddingBagCollection`` gives its own), so the tables of a
    weighted and an unweighted TorchRec collection can share one shardwise collection and one batch.

    What shardwise cannot express is a :class:`ConfigError` naming the table and the field: pooling NONE,
    a data_type other than FP32, position weights (need_pos), pruning, buckets, virtual tables. Initial
    values (weight_init_min/max, init_fn) are not carried over: load the weights
    (:func:`load_torchrec_state_dict`). The planner's ``ids_per_sample`` keeps its default.
    """
    if is_torchrec(tables, "EmbeddingBagCollectionInterface"):
        if weighted is not None and weighted != tables.is_weighted():
            raise ConfigError(f"weighted={weighted} for an EmbeddingBagCollection with is_weighted "
                              f"{tables.is_weighted()}")
        tables, weighted = tables.embedding_bag_configs(), tables.is_weighted()
    out = []
    for t in tables:
        if isinstance(t, TableConfig):
            out.append(t)
        elif is_torchrec(t, "EmbeddingBagConfig"):
            out.append(_from_torchrec(t, weighted))
        elif _torchrec_classes(t):
            raise ConfigError(f"table {getattr(t, 'name', '?')!r}: a torchrec {type(t).__name__} is not a pooled "
                              "table; shardwise takes EmbeddingBagConfig (an EmbeddingBagCollection's tables)")
        else:
            raise ConfigError(f"expected a TableConfig or a torchrec EmbeddingBagConfig, got {type(t).__name__}")
    return out


def as_kjt(kjt: Any) -> KeyedJaggedTensor:
    """shardwise's :class:`KeyedJaggedTensor` for ``kjt``: ours passes through; torchrec's is converted
    exactly (keys, values, lengths, weights or none; its stride is the batch size).

    A torchrec batch with a stride per feature (variable batch per feature) is refused with a
    :class:`ShapeMismatchError`: every feature of a shardwise batch has the same samples.
    """
    if isinstance(kjt, KeyedJaggedTensor):
        return kjt
    if not is_torchrec(kjt, "KeyedJaggedTensor"):
        raise ShapeMismatchError(f"expected a KeyedJaggedTensor (shardwise's or torchrec's), got {type(kjt).__name__}")
    keys = list(kjt.keys())
    if kjt.variable_stride_per_key():
        raise ShapeMismatchError(f"a torchrec KeyedJaggedTensor with a variable stride per key (batch sizes "
                                 f"{kjt.stride_per_key()} for keys {keys}) cannot be expressed: every feature of a "
                                 "shardwise batch has the same samples; pad the features to one batch size")
    lengths = kjt.lengths()
    stride = kjt.stride()
    if lengths.numel() != len(keys) * stride:
        raise ShapeMismatchError(f"torchrec KeyedJaggedTensor: {lengths.numel()} lengths for {len(keys)} keys "
                                 f"of stride {stride} (expected {len(keys) * stride})")
    return KeyedJaggedTensor.from_lengths(keys, kjt.values(), lengths, kjt.weights_or_none())


def _torchrec_tables(collection: "ShardedEmbeddingBagCollection", state_dict: Mapping[str, Any],
                     prefix: str) -> dict[str, Any]:
    """``{table: weight}`` of the ``<prefix><table>.weight`` keys; other keys are not looked at."""
    tables = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix):]
        if not rest.endswith(_SUFFIX) or "." in rest[:-len(_SUFFIX)]:
            raise ConfigError(f"state_dict key {key!r} under {prefix!r} is not {prefix}<table>{_SUFFIX}")
        if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise ConfigError(f"{key!r} is a {type(value).__name__}: load an unsharded EmbeddingBagCollection's "
                              "state_dict (whole tables)")
        tables[rest[:-len(_SUFFIX)]] = value
    return tables


def load_torchrec_state_dict(collection: "ShardedEmbeddingBagCollection", state_dict: Mapping[str, Any],
                             prefix: str = "embedding_bags.") -> None:
    """Load an unsharded TorchRec ``EmbeddingBagCollection.state_dict()`` (``<prefix><table>.weight``, whole
    tables) into ``collection``: each rank copies its own shards; no communication.

    Keys outside ``prefix`` are ignored, so a whole model's state_dict loads with the EBC's prefix
    (e.g. ``"sparse.ebc.embedding_bags."``). A table of the collection missing, one that it lacks, or one of
    another shape is a :class:`ConfigError` / :class:`ShapeMismatchError` naming its key, before anything
    is copied. Pending row gradients are dropped.
    """
    tables = _torchrec_tables(collection, state_dict, prefix)
    tables = check_full_tables(collection, tables, label=lambda name: repr(f"{prefix}{name}{_SUFFIX}"))
    load_full_tables(collection, tables)


def torchrec_state_dict(collection: "ShardedEmbeddingBagCollection", prefix: str = "embedding_bags.",
                        dst: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Collective (every rank calls it): the collection's tables whole, keyed as a TorchRec
    ``EmbeddingBagCollection``'s state_dict (``<prefix><table>.weight``), which one of the same tables loads
    with ``load_state_dict(strict=True)``. ``dst=None``: on every rank; ``dst=r``: on rank ``r``, ``{}``
    elsewhere (see :func:`~.tables_io.full_tables`)."""
    return {f"{prefix}{name}{_SUFFIX}": t for name, t in full_tables(collection, dst).items()}


def torchrec_table_configs(tables: Iterable[TableConfig]) -> list[Any]:
    """TorchRec ``EmbeddingBagConfig`` s of shardwise tables (e.g. ``collection.tables.values()``), to build
    the ``EmbeddingBagCollection`` that loads :func:`torchrec_state_dict`. Imports torchrec."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    return [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                               feature_names=list(t.feature_names), pooling=PoolingType[t.pooling.upper()])
            for t in as_table_configs(tables)]
