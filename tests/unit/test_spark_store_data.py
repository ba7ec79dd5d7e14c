"""shardwise.spark's store paths and each rank's row groups, without Spark (pyarrow writes the Parquet)."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.core.errors import ConfigError
from shardwise.spark.data import ColumnSpec, epoch_order, read_rank, row_groups, steps_per_epoch
from shardwise.spark.store import FsspecStore, LocalStore, Store

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


class FakeComm:
    """allgather_object over ranks whose values are given up front."""

    def __init__(self, values: list) -> None:
        self.values = values

    def allgather_object(self, obj):
        return [type(obj)(v) for v in self.values] if not isinstance(obj, tuple) else self.values


@pytest.mark.timeout(30)
def test_store_create_picks_by_scheme(tmp_path) -> None:
    assert isinstance(Store.create(str(tmp_path)), LocalStore)
    local = Store.create("file://" + str(tmp_path))
    assert isinstance(local, LocalStore) and local.prefix_path == str(tmp_path)
    assert local.get_checkpoint_path("r1") == f"{tmp_path}/runs/r1/checkpoint"
    assert local.get_train_data_path("r1") == f"{tmp_path}/intermediate_train_data.r1"
    assert local.spark_path(local.get_val_data_path()) == f"file://{tmp_path}/intermediate_val_data"
    remote = Store.create("memory://bucket/prefix")
    assert isinstance(remote, FsspecStore) and remote.get_logs_path("r") == "memory://bucket/prefix/runs/r/logs"
    with pytest.raises(ConfigError, match="non-empty prefix"):
        Store.create("")


@pytest.mark.timeout(30)
def test_fsspec_store_round_trip() -> None:
    pytest.importorskip("fsspec")
    store = FsspecStore("memory://sw-test")
    store.write(store.get_run_path("a") + "/x.bin", b"abc")
    assert store.read("memory://sw-test/runs/a/x.bin") == b"abc"
    with store.local_dir(store.get_checkpoint_path("a")) as d:
        with open(f"{d}/w.bin", "wb") as f:
            f.write(b"w")
    files = store.list_files(store.get_run_path("a"))
    assert [f.rsplit("/runs/", 1)[1] for f in files] == ["a/checkpoint/w.bin", "a/x.bin"], files
    assert [store.read(f) for f in files] == [b"w", b"abc"]


@pytest.mark.timeout(30)
def test_ranks_take_row_groups_round_robin_in_file_order(tmp_path) -> None:
    store = LocalStore(str(tmp_path))
    folder = tmp_path / "data"
    folder.mkdir()
    # two files of 3 row groups (4 rows each); written in reverse name order to check the sort
    for name, base in (("part-1.parquet", 12), ("part-0.parquet", 0)):
        ids = np.arange(base, base + 12)
        table = pa.table({"x": pa.array([[float(i), -float(i)] for i in ids], pa.list_(pa.float32())),
                          "y": pa.array(ids, pa.int64())})
        pq.write_table(table, folder / name, row_group_size=4)
    (folder / "_SUCCESS").write_text("")
    groups = row_groups(store, str(folder))
    assert [(g[0].rsplit("/", 1)[1], g[1], g[2]) for g in groups] == \
        [("part-0.parquet", i, 4) for i in range(3)] + [("part-1.parquet", i, 4) for i in range(3)]
    cols = [ColumnSpec("x", (2,), "float32"), ColumnSpec("y", (), "int64")]
    r0 = read_rank(store, str(folder), 0, 2, cols)
    r1 = read_rank(store, str(folder), 1, 2, cols)
    # groups g0, g2, g4 -> rows 0-3, 8-11, 16-19; g1, g3, g5 -> rows 4-7, 12-15, 20-23
    assert r0["y"].tolist() == [*range(0, 4), *range(8, 12), *range(16, 20)]
    assert r1["y"].tolist() == [*range(4, 8), *range(12, 16), *range(20, 24)]
    assert r0["x"].shape == (12, 2) and r0["x"].dtype == np.float32 and r0["x"].flags.writeable
    np.testing.assert_array_equal(r1["x"][:, 1], -r1["y"].astype(np.float32))
    empty = read_rank(store, str(folder), 7, 8, cols)
    assert empty["x"].shape == (0, 2)


@pytest.mark.timeout(30)
def test_epoch_order_and_agreed_steps() -> None:
    assert epoch_order(5, 3, 1, shuffle=False, seed=0).tolist() == [0, 1, 2, 3, 4]
    a = epoch_order(50, 0, 1, shuffle=True, seed=7)
    assert sorted(a.tolist()) == list(range(50))
    assert a.tolist() == epoch_order(50, 0, 1, shuffle=True, seed=7).tolist()
    assert a.tolist() != epoch_order(50, 1, 1, shuffle=True, seed=7).tolist()
    assert a.tolist() != epoch_order(50, 0, 0, shuffle=True, seed=7).tolist()
    assert steps_per_epoch(100, 10, FakeComm([10, 7])) == 7
    with pytest.raises(ConfigError, match="fewer rows than one batch"):
        steps_per_epoch(100, 10, FakeComm([0, 10]))
