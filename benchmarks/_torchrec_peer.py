"""TorchRec's ``DistributedModelParallel`` as the peer of ``benchmarks/embeddings.py``.

The model is the benchmark's: one ``EmbeddingBagCollection`` (a table per feature, sum pooling)
whose pooled rows, beside the dense features, feed a small MLP. TorchRec shards the tables with
its own ``EmbeddingShardingPlanner`` on a CPU ``Topology`` (or with every table forced to one
sharding type through ``ParameterConstraints``), its fused CPU kernel (FBGEMM's
``SplitTableBatchedEmbeddingBagsCodegen``) steps the rows looked up inside the backward (exact
SGD through ``fused_params``), and the MLP is data parallel (DMP wraps it in DDP).

Also here: the same plan in shardwise's terms (:func:`shardwise_plan`, from TorchRec's
``ShardingPlan``: sharding type, ranks, row and column ranges of every shard), shardwise's
initial table values written into TorchRec's shards (:func:`load_initial_values`), and the bytes
the lookups' collectives of a step send (:class:`CollectiveBytes`, counted the same way for both
libraries: both call ``torch.distributed`` on the same gloo group).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

#: The sharding types ``--force`` offers on both sides (TorchRec runs only some on the CPU: see
#: :func:`cpu_unsupported`); TorchRec's table_column_wise and grid_shard have no shardwise counterpart.
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
EBC_PATH = "ebc"  # where the model keeps its EmbeddingBagCollection: the module path of TorchRec's plan


def quiet() -> None:
    """Silence TorchRec's advice to production users (topology factory, storage reservation, DDP flags)."""
    import logging
    import warnings

    for name in ("torchrec", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)


def torchrec_version() -> str:
    """``torchrec x, fbgemm-gpu y`` (installed versions), for the benchmark's header."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("torchrec", "fbgemm-gpu-cpu"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


class SparseDense(nn.Module):
    """The benchmark's model in TorchRec's form: ``mlp(cat(dense, pooled rows of every feature))``."""

    def __init__(self, ebc: nn.Module, mlp: nn.Module, features: Sequence[str]) -> None:
        super().__init__()
        self.ebc, self.mlp, self.features = ebc, mlp, list(features)

    def pooled(self, kjt: Any) -> dict[str, torch.Tensor]:
        """``{feature: [batch, dim]}`` of the (sharded) collection."""
        return self.ebc(kjt).to_dict()

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        pooled = self.pooled(kjt)
        return self.mlp(torch.cat([dense] + [pooled[f] for f in self.features], dim=1))


def torchrec_kjt(kjt: Any) -> Any:
    """shardwise's ``KeyedJaggedTensor`` as TorchRec's (the same layout: feature-major lengths and values)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(keys=list(kjt.keys), values=kjt.values, lengths=kjt.lengths,
                                               weights=kjt.weights)


def constraints(tables: Sequence[Any], force: Optional[str], world: int) -> Optional[dict[str, Any]]:
    """TorchRec ``ParameterConstraints`` forcing every table to ``force`` (None: the planner's own choice).

    Column-wise shards may be as narrow as ``dim / world`` (TorchRec's default lower bound,
    ``min_partition``, is wider than 64-wide tables split over 2 or more ranks).
    """
    if force is None:
        return None
    from torchrec.distributed.planner.types import ParameterConstraints

    return {t.name: ParameterConstraints(sharding_types=[force], pooling_factors=[t.ids_per_sample],
                                         min_partition=max(4, t.embedding_dim // world) if force == "column_wise"
                                         else None)
            for t in tables}


def _sharder(lr: float) -> Any:
    """TorchRec's sharder of ``EmbeddingBagCollection``: fused kernel, exact SGD inside the backward."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr})


def model(tables: Sequence[Any], mlp: nn.Module) -> SparseDense:
    """The model with its ``EmbeddingBagCollection`` on the meta device (DMP allocates only the shards)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings,
                                  feature_names=list(t.feature_names),
                                  pooling=PoolingType.SUM if t.pooling == "sum" else PoolingType.MEAN)
               for t in tables]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    return SparseDense(ebc, mlp, [f for t in tables for f in t.feature_names])


#: types whose TorchRec plan :func:`plan` can write by hand when its planner will not offer them on the CPU
BY_HAND = ("table_wise", "row_wise", "column_wise")


def cpu_unsupported(force: Optional[str], by_hand: bool = False) -> Optional[str]:
    """Why TorchRec cannot run every table ``force`` on the CPU, or None where it can (or ``force`` is None).

    Its ``EmbeddingBagCollectionSharder`` offers row_wise, table_row_wise and grid_shard only on
    CUDA (and MTIA) devices; its planner then refuses a table constrained to them. ``by_hand``: a
    plan written by hand (:func:`plan`) is accepted for the types of :data:`BY_HAND`.
    """
    offered = _sharder(0.01).sharding_types("cpu")
    if force is None or force in offered or (by_hand and force in BY_HAND):
        return None
    return (f"{torchrec_version()} does not shard {force} on the CPU: its EmbeddingBagCollectionSharder "
            f"offers {', '.join(offered)} there ({force} only on CUDA)"
            + ("; --torchrec-by-hand writes plans of " + ", ".join(BY_HAND) if force not in BY_HAND else ""))


def plan(tables: Sequence[Any], mlp: nn.Module, lr: float, batch: int, force: Optional[str] = None,
         local_size: Optional[int] = None, by_hand: bool = False) -> Any:
    """TorchRec's ``ShardingPlan`` of the tables over the default group, by its own planner on a CPU
    ``Topology`` (every table ``force`` where given). Collective: rank 0 plans and broadcasts it.
    ``batch`` is the samples per rank.

    ``by_hand``, where the planner does not offer ``force`` on the CPU: the plan TorchRec's
    ``construct_module_sharding_plan`` writes for every table ``force`` with the fused kernel
    (the same on every rank), which DMP then runs on the CPU although its sharder does not list it.
    """
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    world = dist.get_world_size()
    if by_hand and force in BY_HAND and force not in _sharder(lr).sharding_types("cpu"):
        from torchrec.distributed import sharding_plan as generators
        from torchrec.distributed.types import ShardingPlan

        module_plan = generators.construct_module_sharding_plan(
            model(tables, mlp).ebc, per_param_sharding={t.name: getattr(generators, force)(compute_kernel="fused")
                                                        for t in tables},
            local_size=local_size or world, world_size=world, device_type="cpu", sharder=_sharder(lr))
        return ShardingPlan({EBC_PATH: module_plan})
    topology = Topology(world_size=world, compute_device="cpu", local_world_size=local_size or world)
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch,
                                       constraints=constraints(tables, force, world), debug=False)
    return planner.collective_plan(model(tables, mlp), [_sharder(lr)], dist.group.WORLD)


def build(tables: Sequence[Any], mlp: nn.Module, lr: float, sharding_plan: Any, seed: Optional[int] = 0) -> nn.Module:
    """The model in TorchRec's ``DistributedModelParallel`` by ``sharding_plan``, its tables started from
    shardwise's initial values of ``seed`` (None: TorchRec's own)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    dmp = DistributedModelParallel(model(tables, mlp), env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=sharding_plan, sharders=[_sharder(lr)])
    if seed is not None:
        load_initial_values(dmp, tables, seed)
    return dmp


def local_shards(dmp: nn.Module) -> Iterator[tuple[str, tuple[int, int], tuple[int, int], torch.Tensor]]:
    """``(table, (row start, row end), (col start, col end), values)`` of every table shard this rank holds;
    the values are TorchRec's own storage (its fused kernel's weights), writable in place."""
    prefix = f"{EBC_PATH}.embedding_bags."
    for key, value in dmp.module.state_dict().items():
        if not key.startswith(prefix) or not key.endswith(".weight"):
            continue
        table = key[len(prefix):-len(".weight")]
        if not hasattr(value, "local_shards"):  # data_parallel: the whole table, a plain tensor on every rank
            yield table, (0, value.shape[0]), (0, value.shape[1]), value
            continue
        for shard in value.local_shards():
            (r0, c0), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            yield table, (r0, r0 + rows), (c0, c0 + cols), shard.tensor


@torch.no_grad()
def load_initial_values(dmp: nn.Module, tables: Sequence[Any], seed: int) -> None:
    """Write shardwise's initial values of ``seed`` (``init_rows``: those of ``ShardedEmbeddingBagCollection``
    with the same seed, whatever its plan) into every TorchRec shard of this rank."""
    from shardwise.adapters.torch.embedding import init_rows

    by_name = {t.name: t for t in tables}
    for table, rows, cols, values in local_shards(dmp):
        values.copy_(init_rows(by_name[table], seed, rows, cols))


def placements(sharding_plan: Any) -> dict[str, tuple[str, str, list[tuple[int, int, int, int, int]]]]:
    """Per table: ``(sharding type, compute kernel, [(rank, row start, row end, col start, col end), ...])``."""
    out = {}
    for table, ps in sharding_plan.get_plan_for_module(EBC_PATH).items():
        shards = []
        for md in (ps.sharding_spec.shards if ps.sharding_spec is not None else []):
            (r0, c0), (rows, cols) = md.shard_offsets, md.shard_sizes
            shards.append((md.placement.rank(), r0, r0 + rows, c0, c0 + cols))
        out[table] = (ps.sharding_type, ps.compute_kernel, shards)
    return out


def describe(sharding_plan: Any) -> str:
    """One line per sharding type: the tables TorchRec put that way and on which ranks."""
    groups: dict[tuple[str, str], list[str]] = {}
    for table, (kind, kernel, shards) in placements(sharding_plan).items():
        ranks = "/".join(str(s[0]) for s in shards)
        groups.setdefault((kind, kernel), []).append(f"{table}@{ranks}")
    return "; ".join(f"{kind} ({kernel} kernel): {len(names)} table(s) {' '.join(names)}"
                     for (kind, kernel), names in groups.items())


def shardwise_plan(sharding_plan: Any, tables: Sequence[Any], world: int, local_size: Optional[int] = None) -> Any:
    """TorchRec's placement of every table as a shardwise ``EmbeddingPlan``: the same sharding type, ranks
    and row and column ranges, shard for shard. ``ValueError`` for a type shardwise does not have."""
    from shardwise.core.embedding_plan import EmbeddingPlan, ShardingType, TablePlacement, TableShard

    by_name = {t.name: t for t in tables}
    got = placements(sharding_plan)
    memory = [0] * world
    out = []
    for t in tables:
        kind, kernel, shards = got[t.name]
        if kind == "data_parallel":  # a whole copy on every rank; TorchRec's plan lists no shards
            shards = [(rank, 0, t.num_embeddings, 0, t.embedding_dim) for rank in range(world)]
        elif kind not in SHARDING_TYPES or not shards:
            raise ValueError(f"table {t.name!r}: TorchRec's {kind} has no shardwise counterpart")
        made = tuple(TableShard(t.name, rank, r0, r1, c0, c1) for rank, r0, r1, c0, c1 in shards)
        for s in made:
            memory[s.rank] += s.rows * s.cols * 4
        out.append(TablePlacement(by_name[t.name], ShardingType(kind), made,
                                  reason=f"TorchRec's plan ({kernel} kernel)"))
    return EmbeddingPlan(world_size=world, local_size=local_size or world, placements=tuple(out), optimizer="sgd",
                         memory_budget=max(memory), memory_per_rank=tuple(memory))


class CollectiveBytes:
    """Counts what this rank's ``torch.distributed`` lookup collectives hand to the other ranks while active.

    Both libraries reach gloo through ``torch.distributed``'s Python functions (shardwise's torch
    backend and TorchRec's eager paths alike), looked up on the module at call time, so wrapping
    them for the span of one step counts every byte either one sends for its lookups: split sizes,
    ids, pooled rows and their gradients. All-to-alls count what goes to the other ranks (the part
    a rank keeps for itself left out); TorchRec's row-wise output goes by reduce-scatter forward and
    all-gather backward, counted as direct sends too (a reduce-scatter hands every other rank its
    block, an all-gather this rank's tensor). All-reduces are not counted: DDP's, for the MLP, run in
    C++ and would escape the count on one side only.
    """

    def __init__(self) -> None:
        self.bytes = self.calls = 0

    def _add(self, elements: int, tensor: torch.Tensor) -> None:
        self.bytes += elements * tensor.element_size()
        self.calls += 1

    def _all_to_all_single(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                    input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            if input_split_sizes:
                own = input_split_sizes[rank] * (input.numel() // max(1, input.shape[0]) if input.dim() else 1)
            else:
                own = input.numel() // world
            self._add(input.numel() - own, input)
            return inner(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        return wrapped

    def _lists(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """``all_to_all(outputs, inputs)`` and ``reduce_scatter(output, inputs)``: every input but this rank's."""
        def wrapped(output: Any, input_list: list, *args: Any, **kwargs: Any) -> Any:
            rank = dist.get_rank(kwargs.get("group"))
            self._add(sum(t.numel() for i, t in enumerate(input_list) if i != rank), input_list[0])
            return inner(output, input_list, *args, **kwargs)

        return wrapped

    def _reduce_scatter_tensor(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._add(input.numel() - output.numel(), input)
            return inner(output, input, *args, **kwargs)

        return wrapped

    def _all_gather(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """``all_gather(outputs, input)``, ``all_gather_into_tensor(output, input)``: the input to every other rank."""
        def wrapped(output: Any, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._add((dist.get_world_size(kwargs.get("group")) - 1) * input.numel(), input)
            return inner(output, input, *args, **kwargs)

        return wrapped

    @contextlib.contextmanager
    def counting(self) -> Iterator["CollectiveBytes"]:
        """Count the collectives started inside the block."""
        wrappers = {"all_to_all_single": self._all_to_all_single, "all_to_all": self._lists,
                    "reduce_scatter": self._lists, "reduce_scatter_tensor": self._reduce_scatter_tensor,
                    "all_gather": self._all_gather, "all_gather_into_tensor": self._all_gather}
        saved = {name: getattr(dist, name) for name in wrappers}
        for name, wrap in wrappers.items():
            setattr(dist, name, wrap(saved[name]))
        try:
            yield self
        finally:
            for name, inner in saved.items():
                setattr(dist, name, inner)
