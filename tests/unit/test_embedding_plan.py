"""The embedding-table plan (pure Python) and the torch pieces that need no second process."""

import re

import pytest

from shardwise.core.embedding_plan import ShardingType, TableConfig, balanced_rows, plan_tables
from shardwise.core.errors import ConfigError

TABLES = [TableConfig(name="big", num_embeddings=1_000_000, embedding_dim=16),
          TableConfig(name="hot", num_embeddings=50_000, embedding_dim=16, ids_per_sample=40),
          TableConfig(name="tiny", num_embeddings=100, embedding_dim=16),
          TableConfig(name="small", num_embeddings=1_000, embedding_dim=16, feature_names=("s1", "s2"))]


def _covers(placement) -> bool:
    """Every (row, column) of the table is held by exactly one shard (by every rank, in rank order, where
    the table is replicated)."""
    t = placement.table
    if placement.replicated:
        return [(s.rank, s.row_start, s.row_end, s.col_start, s.col_end) for s in placement.shards] == \
            [(r, 0, t.num_embeddings, 0, t.embedding_dim) for r in range(len(placement.shards))]
    cells = sum(s.rows * s.cols for s in placement.shards)
    boxes = {(s.row_start, s.row_end, s.col_start, s.col_end) for s in placement.shards}
    return cells == t.num_embeddings * t.embedding_dim and len(boxes) == len(placement.shards)


def test_balanced_rows_give_the_remainder_to_the_lowest_blocks() -> None:
    assert balanced_rows(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert balanced_rows(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_plan_places_every_table_within_the_budget_and_explains_it() -> None:
    plan = plan_tables(TABLES, 4, global_batch=512, optimizer="adagrad")
    assert all(_covers(p) for p in plan.placements)
    assert max(plan.memory_per_rank) <= plan.memory_budget
    # the 1M-row table (122 MiB with Adagrad state) cannot sit on one rank of a 1.25x-even budget
    assert plan.placement("big").sharding is not ShardingType.TABLE_WISE
    # a tiny table stays whole: splitting it costs more per-shard work than its lookups
    assert plan.placement("tiny").sharding is ShardingType.TABLE_WISE
    # the table with 40 ids per sample spreads its lookups
    assert len(plan.placement("hot").shards) > 1
    text = plan.explain()
    for name in ("big", "hot", "tiny", "small"):
        assert f"  {name}: " in text
    assert "over budget: table_wise needs" in text and "memory per rank" in text
    assert sum(len(plan.shards_of(r)) for r in range(4)) == sum(len(p.shards) for p in plan.placements)


def test_table_row_wise_stays_in_one_node_and_constraints_force_a_type() -> None:
    plan = plan_tables(TABLES, 8, local_size=4, memory_per_rank=10**10,
                       constraints={"big": "table_row_wise", "hot": "column_wise", "tiny": "row_wise"})
    ranks = {s.rank for s in plan.placement("big").shards}
    assert len(ranks) == 4 and len({r // 4 for r in ranks}) == 1
    assert plan.placement("hot").sharding is ShardingType.COLUMN_WISE
    assert all(s.row_start == 0 and s.row_end == 50_000 for s in plan.placement("hot").shards)
    assert plan.placement("tiny").sharding is ShardingType.ROW_WISE
    assert all(_covers(p) for p in plan.placements)
    assert "forced by constraints" in plan.placement("big").reason


def _cost(placement) -> float:
    """The modelled ms/step the plan's reason gives for ``placement``."""
    return float(re.search(r"([\d.]+) ms/step", placement.reason).group(1))


def test_data_parallel_replicates_a_table_on_every_rank_in_rank_order() -> None:
    small = TableConfig(name="small", num_embeddings=1_000, embedding_dim=16, feature_names=("s1", "s2"))
    plan = plan_tables([small], 4, optimizer="adagrad", memory_per_rank=10**6,
                       constraints={"small": ShardingType.DATA_PARALLEL})
    p = plan.placement("small")
    assert p.sharding is ShardingType.DATA_PARALLEL and p.replicated and _covers(p)
    assert [plan.shards_of(r) for r in range(4)] == [[s] for s in p.shards]  # shard i on rank i
    # the whole table and its Adagrad state on every rank; a ring all-reduce of the dense gradient
    assert plan.memory_per_rank == (1_000 * 16 * 4 * 2,) * 4
    assert p.comm_bytes == 2 * 3 / 4 * 1_000 * 16 * 4
    text = plan.explain()
    assert "small: 1,000 x 16" in text and "-> data_parallel on rank(s) [0, 1, 2, 3]: forced by constraints; " \
        "replicated on all 4 ranks, no all-to-all" in text and "all-reduce its dense gradient" in text


def test_the_planner_replicates_small_tables_where_that_is_cheapest_and_the_budget_allows() -> None:
    tables = [TableConfig(name="large", num_embeddings=200_000, embedding_dim=64),
              TableConfig(name="country", num_embeddings=2_000, embedding_dim=64, feature_names=("home", "visit"))]
    kw = dict(global_batch=8192, memory_per_rank=40 * 2**20)
    plan = plan_tables(tables, 4, **kw)
    assert plan.placement("country").sharding is ShardingType.DATA_PARALLEL and _covers(plan.placement("country"))
    assert plan.placement("large").sharding is not ShardingType.DATA_PARALLEL  # its gradient outweighs its lookups
    assert "country: 2,000 x 64" in plan.explain() and "data_parallel on rank(s) [0, 1, 2, 3]" in plan.explain()
    # the cheapest of every type, each forced alone, and of all of them allowed by a list
    alone = {k: plan_tables(tables[1:], 4, constraints={"country": k}, **kw).placement("country")
             for k in ShardingType}
    assert min(alone, key=lambda k: (_cost(alone[k]), list(ShardingType).index(k))) is ShardingType.DATA_PARALLEL
    assert plan_tables(tables[1:], 4, constraints={"country": list(ShardingType)}, **kw).placement(
        "country").sharding is ShardingType.DATA_PARALLEL
    # never where the budget forbids the whole table on every rank, nor where the runtime cannot run it
    tight = plan_tables(tables, 4, global_batch=8192, memory_per_rank=int(12.5 * 2**20))  # 12.2 MiB of large
    assert not any(p.replicated for p in tight.placements) and "data_parallel needs" in tight.explain()
    runs = [k for k in ShardingType if k is not ShardingType.DATA_PARALLEL]
    assert not any(p.replicated for p in plan_tables(tables, 4, sharding_types=runs, **kw).placements)
    # one rank: replicating is table-wise, which comes first on the tie
    assert plan_tables(tables, 1, global_batch=8192).placement("country").sharding is ShardingType.TABLE_WISE


def test_table_row_wise_runs_on_one_node_as_row_wise_which_wins_the_tie() -> None:
    plan = plan_tables(TABLES, 4, memory_per_rank=10**9, constraints={"hot": "table_row_wise"})
    hot = plan.placement("hot")
    assert plan.local_size == 4 and hot.sharding is ShardingType.TABLE_ROW_WISE and _covers(hot)
    assert [(s.rank, s.row_start, s.row_end) for s in hot.shards] == [(r, a, b) for r, (a, b) in
                                                                     enumerate(balanced_rows(50_000, 4))]
    rw = plan_tables(TABLES, 4, memory_per_rank=10**9, constraints={"hot": "row_wise"}).placement("hot")
    either = plan_tables(TABLES, 4, memory_per_rank=10**9,
                         constraints={"hot": ("table_row_wise", "row_wise")}).placement("hot")
    assert _cost(rw) == _cost(hot) and either.sharding is ShardingType.ROW_WISE and either.shards == rw.shards
    assert "the cheapest of row_wise or table_row_wise allowed by constraints" in either.reason
    for world, local in ((4, 1), (1, None)):  # a node of one rank has no row-wise within it
        with pytest.raises(ConfigError, match="cannot be placed table_row_wise on .* a node of 2 ranks or more"):
            plan_tables(TABLES, world, local_size=local, memory_per_rank=10**9, constraints={"big": "table_row_wise"})


def test_a_forced_type_the_budget_refuses_says_the_budget_is_the_problem() -> None:
    big = TableConfig(name="big", num_embeddings=1_000_000, embedding_dim=16)  # 61 MiB
    budget = r", budget 10\.0 MiB per rank: the memory budget, not the sharding type, is the problem: " \
             r"raise memory_per_rank or add ranks"
    with pytest.raises(ConfigError, match=r"table 'big' forced column_wise needs 15\.3 MiB on rank 0 \(15\.3 MiB "
                                          r"of this table, 0\.0 MiB already placed there\)" + budget):
        plan_tables([big], 4, memory_per_rank=10 * 2**20, constraints={"big": "column_wise"})
    with pytest.raises(ConfigError, match=r"table 'big' constrained to table_wise or table_row_wise: table_wise "
                                          r"needs 61\.0 MiB on rank 0 .*\(table_row_wise cannot exist on 4 ranks "
                                          r"with 1 per node\)" + budget):
        plan_tables([big], 4, local_size=1, memory_per_rank=10 * 2**20,
                    constraints={"big": ["table_row_wise", "table_wise"]})
    # a type that cannot exist at this world size is a different message, whatever the budget
    odd = TableConfig(name="odd", num_embeddings=10, embedding_dim=15)
    with pytest.raises(ConfigError, match="cannot be placed column_wise on 4 ranks") as refused:
        plan_tables([odd], 4, memory_per_rank=10**9, constraints={"odd": "column_wise"})
    assert "budget" not in str(refused.value)
    # the type fits once the budget allows it
    assert plan_tables([big], 4, memory_per_rank=16 * 2**20,
                       constraints={"big": "column_wise"}).placement("big").sharding is ShardingType.COLUMN_WISE


def test_constraints_take_a_type_or_a_list_of_allowed_types() -> None:
    kinds = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE)
    alone = [plan_tables(TABLES, 4, memory_per_rank=10**9, constraints={"hot": k}).placement("hot") for k in kinds]
    for allowed in (list(kinds), tuple(reversed(kinds)), ["column_wise", "table_wise"]):
        got = plan_tables(TABLES, 4, memory_per_rank=10**9, constraints={"hot": allowed}).placement("hot")
        cheapest = min(alone, key=_cost)
        assert got.sharding is cheapest.sharding and got.shards == cheapest.shards
    assert all(plan_tables(TABLES, 4, constraints={"hot": k}, memory_per_rank=10**9).placement("hot").sharding is k
               for k in kinds)
    for bad, message in (([], "non-empty list"), (["row_wise", "diagonal"], "sharding must be one of"),
                         ({"row_wise": 1}, "non-empty list")):
        with pytest.raises(ConfigError, match=message):
            plan_tables(TABLES, 4, constraints={"hot": bad})
    with pytest.raises(ConfigError, match=r"table 'hot' is constrained to row_wise, but this runtime runs only "
                                          r"table_wise or column_wise \(sharding_types\)"):
        plan_tables(TABLES, 4, constraints={"hot": "row_wise"}, sharding_types=kinds)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "world_size must be an integer >= 1"),
    (dict(world_size=4, local_size=3), "local_size must divide world_size 4"),
    (dict(world_size=4, optimizer="adam"), "optimizer must be one of"),
    (dict(world_size=4, constraints={"nope": "row_wise"}), "constraint for unknown table 'nope'"),
    (dict(world_size=4, constraints={"big": "diagonal"}), "sharding must be one of"),
    (dict(world_size=4, memory_per_rank=1000), "table 'big' .* fits no placement in"),
])
def test_bad_plans_are_refused_with_the_reason(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_tables(TABLES, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="", num_embeddings=1, embedding_dim=1), "non-empty name"),
    (dict(name="t", num_embeddings=0, embedding_dim=1), "num_embeddings must be an integer >= 1"),
    (dict(name="t", num_embeddings=1, embedding_dim=1, pooling="max"), "pooling must be 'sum' or 'mean'"),
    (dict(name="t", num_embeddings=1, embedding_dim=1, feature_names=("a", "a")), "distinct"),
])
def test_bad_tables_are_refused(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        TableConfig(**kwargs)


def test_duplicate_features_across_tables_are_refused() -> None:
    a = TableConfig(name="a", num_embeddings=5, embedding_dim=2, feature_names=("f",))
    b = TableConfig(name="b", num_embeddings=5, embedding_dim=2, feature_names=("f",))
    with pytest.raises(ConfigError, match="must be unique"):
        plan_tables([a, b], 2)


def test_shards_draw_the_values_of_the_whole_table() -> None:
    torch = pytest.importorskip("torch")
    from shardwise.adapters.torch.embedding import full_table, init_rows

    table = TableConfig(name="t", num_embeddings=10_000, embedding_dim=6)
    whole = full_table(table, seed=3)
    assert whole.abs().max() <= (1 / 10_000) ** 0.5
    assert torch.equal(init_rows(table, 3, (4000, 8500), (2, 5)), whole[4000:8500, 2:5])
    assert not torch.equal(full_table(table, seed=4), whole)


def test_keyed_jagged_tensor_checks_its_shape() -> None:
    torch = pytest.importorskip("torch")
    from shardwise.adapters.torch.embedding import KeyedJaggedTensor
    from shardwise.core.errors import ShapeMismatchError

    kjt = KeyedJaggedTensor.from_offsets(["a", "b"], torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 1, 3, 4]))
    assert kjt.batch_size == 2
    values, lengths, weights = kjt.feature("b")
    assert values.tolist() == [2, 3, 4] and lengths.tolist() == [2, 1] and weights is None
    with pytest.raises(ShapeMismatchError, match="add up to the 3 values"):
        KeyedJaggedTensor.from_lengths(["a"], torch.tensor([1, 2, 3]), torch.tensor([1, 1]))
    with pytest.raises(ShapeMismatchError, match="feature 'c' is not in this batch"):
        kjt.feature("c")


def test_initial_values_need_no_framework_and_match_torchs() -> None:
    """The numpy generator is counter-based: any block alone, the same values the torch tables start from."""
    import numpy as np

    from shardwise.core.table_init import full_table, init_rows

    table = TableConfig(name="t", num_embeddings=9_000, embedding_dim=4)
    whole = full_table(table, seed=5)
    assert whole.dtype == np.float32 and whole.shape == (9_000, 4)
    assert np.abs(whole).max() <= (1 / 9_000) ** 0.5 and np.abs(whole).min() > 0
    assert np.array_equal(init_rows(table, 5, (8_191, 8_999), (1, 3)), whole[8_191:8_999, 1:3])
    other = TableConfig(name="u", num_embeddings=9_000, embedding_dim=4)
    assert not np.array_equal(full_table(other, seed=5), whole)  # the table's name is in the key
    torch = pytest.importorskip("torch")
    from shardwise.adapters.torch.embedding import full_table as torch_full_table

    assert torch.equal(torch_full_table(table, seed=5), torch.from_numpy(whole))


def test_the_id_exchange_carries_each_owners_ids_lengths_and_weights() -> None:
    """Two senders pack for two owners of a row-wise table (rows 0-5 on rank 0, 6-9 on rank 1); the
    packets concatenated as an all-to-all delivers them parse back to each owner's relative ids."""
    import numpy as np

    from shardwise.core.embedding_lookup import (BAD_ID, OK, check_sources, feature_ids, pack_ids, parse_ids,
                                                 split_weights)
    from shardwise.core.embedding_plan import LookupSlot, TableShard
    from shardwise.core.errors import ShapeMismatchError

    table = TableConfig(name="t", num_embeddings=10, embedding_dim=2, feature_names=("f",))
    to = [[LookupSlot("f", table, TableShard("t", 0, 0, 6, 0, 2), "t__shard0")],
          [LookupSlot("f", table, TableShard("t", 1, 6, 10, 0, 2), "t__shard1")]]
    sent = {0: feature_ids([1, 7, 9, 2], [3, 1], np.array([.5, 1., 2., 3.], np.float32)),  # bags [1 7 9] [2]
            1: feature_ids([8, 0], [0, 2])}                                                   # bags [] [8 0]
    packed = {r: pack_ids(to, 2, OK, {"f": ids}) for r, ids in sent.items()}
    for owner, first in ((0, 0), (1, 6)):
        got = np.concatenate([packed[r][0][owner] for r in (0, 1)])
        sources = parse_ids(got, 2, to[owner])
        check_sources(sources, "")
        mine = [ids[(ids >= first) & (ids < first + (6 if owner == 0 else 4))] - first
                for ids in (sent[0].values, sent[1].values)]
        assert [s.ids[0].tolist() for s in sources] == [m.tolist() for m in mine]
        assert [s.lengths[0].sum() for s in sources] == [len(m) for m in mine]
        assert [s.has_weights for s in sources] == [True, False]
        weights = split_weights(np.concatenate([packed[r][1][owner] for r in (0, 1)]), sources)
        assert weights[0][0].tolist() == ([.5, 3.] if owner == 0 else [1., 2.]) and weights[1][0].size == 0
    assert sources[1].sample(0).tolist() == [1]  # rank 1's id 8 belongs to its second sample
    # the unweighted sender first: the weighted one's weights are still its own
    got = np.concatenate([packed[r][0][0] for r in (1, 0)])
    sources = parse_ids(got, 2, to[0])
    weights = split_weights(np.concatenate([packed[r][1][0] for r in (1, 0)]), sources)
    assert weights[0][0].size == 0 and weights[1][0].tolist() == [.5, 3.]
    bad = pack_ids(to, 2, BAD_ID, {})[0]
    with pytest.raises(ShapeMismatchError, match=r"bad input on rank\(s\) \[1\]; here: id 12"):
        check_sources(parse_ids(np.concatenate([packed[0][0][1], bad[1]]), 2, to[1]), "id 12")

