"""``shardwise.checkpoint.save``/``load`` in one process: torch modules, optimizers, sharded tables and their
sparse optimizer round-trip; the handler registry; refusals that change nothing; ``shardwise checkpoint``'s
format registry on a shardwise-state checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise import checkpoint
from shardwise.checkpoint import door
from shardwise.core.errors import CheckpointError

torch = pytest.importorskip("torch")
nn = torch.nn


def test_the_door_imports_no_framework() -> None:
    code = ("import sys, shardwise.checkpoint, shardwise.checkpoint.door, shardwise.cli.checkpoint; "
            "bad = [m for m in ('torch', 'keras', 'tensorflow', 'jax') if m in sys.modules]; "
            "assert not bad, bad; assert shardwise.checkpoint.save is shardwise.checkpoint.door.save")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 2, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_model_and_its_optimizer_resume_exactly(tmp_path: Path) -> None:
    model, opt = _model(0), None
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.99))
    _train(model, opt, 3)
    path = checkpoint.save(tmp_path, 3, {"model": model, "opt": opt}, extra={"epoch": 2})
    assert path == tmp_path / "ckpt-3" and sorted(p.name for p in path.iterdir()) == \
        ["manifest.json", "rank-00000.safetensors"]
    meta = json.loads((path / "manifest.json").read_text())["metadata"]
    assert (meta["format"], meta["version"]) == ("shardwise-state", 1)
    assert {n: e["kind"] for n, e in meta["entries"].items()} == {"model": "torch.module", "opt": "torch.optimizer"}

    again = _model(1)
    again_opt = torch.optim.Adam(again.parameters(), lr=0.5)
    assert checkpoint.load(tmp_path, {"model": again, "opt": again_opt}) == {"epoch": 2, "step": 3}
    assert _state_equal(model.state_dict(), again.state_dict())  # BatchNorm's running stats and counter too
    assert again_opt.param_groups[0]["lr"] == 0.01 and again_opt.param_groups[0]["betas"] == (0.8, 0.99)
    _train(model, opt, 2, first=3)
    _train(again, again_opt, 2, first=3)
    assert _state_equal(model.state_dict(), again.state_dict())


def test_a_failed_load_changes_nothing(tmp_path: Path) -> None:
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 2)
    checkpoint.save(tmp_path, 2, {"model": model, "opt": opt})
    other = _model(1)
    adam = torch.optim.Adam(other.parameters())
    _train(other, adam, 1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="entry 'opt' holds SGD state, this optimizer is Adam"):
        checkpoint.load(tmp_path, {"model": other, "opt": adam})  # the model was staged first, never applied
    assert _state_equal(before, other.state_dict())
    wider = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(CheckpointError, match=r"shape differs .*0\.weight"):
        checkpoint.load(tmp_path, {"model": wider})
    with pytest.raises(CheckpointError, match="has no entry 'tables'; it holds 'model' \\(torch.module\\), 'opt'"):
        checkpoint.load(tmp_path, {"tables": other})
    with pytest.raises(CheckpointError, match="entry 'model' holds torch.module state, the object given for it "
                                              "is a Adam \\(torch.optimizer\\)"):
        checkpoint.load(tmp_path, {"model": adam})
    with pytest.raises(CheckpointError, match="no checkpoint handler takes a builtins.object"):
        checkpoint.save(tmp_path, 3, {"x": object()})


def test_another_format_or_a_newer_version_is_refused(tmp_path: Path) -> None:
    from shardwise.checkpoint.store import save_checkpoint

    model = _model(0)
    save_checkpoint(tmp_path / "a", 1, {"x.bin": b"0"}, metadata={"format": "shardwise-embeddings", "version": 1})
    with pytest.raises(CheckpointError, match="is not a shardwise-state checkpoint \\(format 'shardwise-embeddings'"):
        checkpoint.load(tmp_path / "a", {"model": model})
    save_checkpoint(tmp_path / "b", 1, {"x.bin": b"0"}, metadata={"format": "shardwise-state", "version": 2})
    with pytest.raises(CheckpointError, match="format version 2, newer than this shardwise reads"):
        checkpoint.load(tmp_path / "b", {"model": model})
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        checkpoint.load(tmp_path / "none", {"model": model})


def _tables(kind: str, seed: int):  # noqa: ANN202
    from shardwise.adapters.torch.embedding import (ShardedEmbeddingBagCollection, SparseOptimizer, TableConfig,
                                                    plan_tables)
    from shardwise.backends.local import LocalCommunicator

    tables = [TableConfig(name="a", num_embeddings=30, embedding_dim=4),
              TableConfig(name="b", num_embeddings=11, embedding_dim=6, pooling="mean")]
    comm = LocalCommunicator()
    ebc = ShardedEmbeddingBagCollection(tables, plan_tables(tables, 1, memory_per_rank=10**9), comm=comm, seed=seed)
    return ebc, SparseOptimizer(ebc, kind, lr=0.1)


def _lookup_step(ebc, opt, step: int) -> None:  # noqa: ANN001
    from shardwise.adapters.torch.embedding import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 3, (2 * 4,), generator=gen)
    n_a = int(lengths[:4].sum())
    values = torch.cat([torch.randint(0, 30, (n_a,), generator=gen),
                        torch.randint(0, 11, (int(lengths.sum()) - n_a,), generator=gen)])
    out = ebc(KeyedJaggedTensor.from_lengths(["a", "b"], values, lengths))
    (out["a"].sum() + out["b"].square().sum()).backward()
    opt.step()


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad", "sgd"])
def test_sharded_tables_and_their_sparse_optimizer_round_trip(tmp_path: Path, kind: str) -> None:
    ebc, opt = _tables(kind, 0)
    for step in range(3):
        _lookup_step(ebc, opt, step)
    checkpoint.save(tmp_path, 3, {"tables": ebc, "sparse": opt})
    again, again_opt = _tables(kind, 7)
    assert checkpoint.load(tmp_path, {"sparse": again_opt, "tables": again})["step"] == 3
    assert _state_equal(dict(ebc.named_buffers()), dict(again.named_buffers()))
    assert _state_equal(opt.state, again_opt.state)
    for step in range(3, 5):
        _lookup_step(ebc, opt, step)
        _lookup_step(again, again_opt, step)
    assert _state_equal(dict(ebc.named_buffers()), dict(again.named_buffers()))
    if kind != "sgd":
        _, sgd = _tables("sgd", 0)
        with pytest.raises(CheckpointError, match=f"entry 'sparse' holds {kind} optimizer state, this sparse "
                                                  "optimizer is sgd"):
            checkpoint.load(tmp_path, {"sparse": sgd})


def test_tables_inside_a_module_are_left_to_their_own_entry(tmp_path: Path) -> None:
    ebc, opt = _tables("adagrad", 0)
    model = nn.ModuleDict({"emb": ebc, "top": nn.Linear(3, 1)})
    pieces, meta = door.handler_for(model).save_pieces(model)
    assert sorted(p.key for p in pieces) == ["top.bias", "top.weight"] and sorted(meta["tensors"]) == \
        ["top.bias", "top.weight"]
    assert door.handler_for(ebc).kind == "torch.sharded_embeddings"  # the specific handler wins over nn.Module's


def test_a_handler_of_ones_own(tmp_path: Path) -> None:
    """A registered kind saves JSON metadata and pieces of its own, and loads them back through the door."""
    import numpy as np

    class Counter:
        def __init__(self, n: int) -> None:
            self.n, self.history = n, np.arange(n, dtype=np.float32)

    def save_pieces(c: Counter) -> tuple[list, dict]:
        from shardwise.adapters.torch.checkpoint.pieces import encode_placement
        from shardwise.core.placement import Placement

        shape = (c.n,)
        piece = door.Piece("history", shape, encode_placement(Placement("history", shape)), 0, c.n, "F32",
                           lambda: memoryview(c.history.tobytes()))
        return [piece], {"n": c.n}

    def load(c: Counter, view: door.EntryView):  # noqa: ANN202
        from shardwise.adapters.torch.checkpoint.pieces import entry_source

        n = view.meta["n"]
        history = entry_source(view).read_box("history", ()).numpy().copy()

        def apply() -> None:
            c.n, c.history = n, history
        return apply

    checkpoint.register_handler("test.counter", lambda obj: isinstance(obj, Counter), save_pieces, load)
    try:
        checkpoint.save(tmp_path, 1, {"c": Counter(5)})
        got = Counter(2)
        checkpoint.load(tmp_path, {"c": got})
        assert got.n == 5 and got.history.tolist() == [0, 1, 2, 3, 4]
    finally:
        door._HANDLERS.pop("test.counter")
    with pytest.raises(CheckpointError, match="no checkpoint handler takes a .*Counter; kinds known: .*torch.module"):
        checkpoint.load(tmp_path, {"c": Counter(2)})
    with pytest.raises(CheckpointError, match="no checkpoint handler for state of kind 'test.counter'"):
        door.handler_of_kind("test.counter")


def test_replicated_pieces_are_written_once_by_the_least_loaded_rank() -> None:
    every = [[("t", 10), ("a", 4)], [("t", 10), ("b", 20)], [("t", 10)]]
    chosen = door.assign_writers(every)
    assert chosen == {"t": 0, "a": 0, "b": 1}
    assert door.assign_writers([[("x", 1), ("y", 1)], [("x", 1), ("y", 1)]]) == {"x": 0, "y": 1}


def test_the_command_knows_the_format(tmp_path: Path, capsys) -> None:
    from shardwise import cli

    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 1)
    checkpoint.save(tmp_path / "ckpts", 4, {"model": model, "opt": opt}, extra={"epoch": 1})
    assert cli.main(["checkpoint", "info", str(tmp_path / "ckpts")]) == 0
    out = capsys.readouterr().out
    assert "a shardwise-state checkpoint (shardwise.checkpoint.save) (format 'shardwise-state', version 1)" in out
    assert "step 4, written by 1 rank(s)" in out and "  model: torch.module, 9 tensors, 208 bytes" in out, out
    assert "  opt: torch.optimizer, 6 tensors, 168 bytes" in out and 'extra: {"epoch": 1}' in out, out
    assert cli.main(["checkpoint", "consolidate", str(tmp_path / "ckpts"), str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert "is a checkpoint of format 'shardwise-state'" in err and "shardwise.checkpoint.load loads it" in err, err
    assert not (tmp_path / "m.pt").exists()

    from shardwise.checkpoint.store import save_checkpoint

    save_checkpoint(tmp_path / "odd", 1, {"x.bin": b"0"}, metadata={"format": "someone-else"})
    assert cli.main(["checkpoint", "info", str(tmp_path / "odd")]) == 2
    assert "is a checkpoint of format 'someone-else', which this shardwise does not know" in capsys.readouterr().err


def test_a_parallel_model_resumes_through_the_door(tmp_path: Path) -> None:
    """A ParallelModel (GPT-2, AdamW, one process) is one entry: weights, optimizer state, step count and
    generator come back, and training on equals training that never stopped."""
    pytest.importorskip("transformers")
    import shardwise
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardwise.torch import ParallelLayout, parallelize

    def build(seed: int):  # noqa: ANN202
        cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=48, n_positions=8, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = GPT2LMHeadModel(cfg)
        return parallelize(model, torch.optim.AdamW, ParallelLayout(), lr=1e-2)

    def state(pm) -> dict:  # noqa: ANN001
        out = {n: p.detach().clone() for n, p in pm.module.named_parameters()}
        for p, st in pm.optimizer.state.items():
            out.update({f"{pm.tensors.name(p)}/{k}": v.clone() for k, v in st.items()})
        return out

    shardwise.init(backend="local")
    try:
        pm = build(0)
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 48, (2, 8), generator=gen) for _ in range(4)]
        for ids in batches[:2]:
            pm.train_step(ids)
        path = checkpoint.save(tmp_path, 2, {"pm": pm})
        kinds = json.loads((path / "manifest.json").read_text())["metadata"]["entries"]
        assert kinds["pm"]["kind"] == "torch.parallel_model"
        rng = torch.get_rng_state()
        again = build(5)
        torch.manual_seed(123)
        assert checkpoint.load(tmp_path, {"pm": again}) == {"step": 2}
        assert torch.equal(torch.get_rng_state(), rng)
        assert _state_equal(state(pm), state(again))
        for ids in batches[2:]:
            pm.train_step(ids)
            again.train_step(ids)
        assert _state_equal(state(pm), state(again))
    finally:
        shardwise.shutdown()


class _ZeroNet(nn.Module):
    """Two trainable layers (stage-3 units), a frozen one and a buffer: the module's own state."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.frozen = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.frozen(self.b(torch.tanh(self.a(x))))


def _zero(stage: int, seed: int, dtype: torch.dtype = torch.float32, lr: float = 0.05):  # noqa: ANN202
    from shardwise.adapters.torch.zero import ZeroOptimizer
    from shardwise.backends.local import LocalCommunicator

    model = _ZeroNet(seed).to(dtype)
    return model, ZeroOptimizer(model, torch.optim.Adam, stage=stage, comm=LocalCommunicator(), lr=lr)


def _zero_train(model: nn.Module, opt, steps: range) -> None:  # noqa: ANN001
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y).backward()
        opt.step()


def _zero_state(model: nn.Module, opt) -> dict:  # noqa: ANN001
    """Everything that a load sets, whole: parameters, masters, optimizer state, hyperparameters, module state."""
    full = opt.full_state_dict()
    out = {f"param/{k}": v for k, v in opt.full_parameters().items()}
    out.update({f"master/{k}": v for k, v in full["master"].items()})
    out.update({f"state/{k}/{s}": v for k, per in full["state"].items() for s, v in per.items()})
    out.update({f"module/{k}": v.clone() for k, v in model.state_dict().items() if f"param/{k}" not in out})
    out["lr"] = torch.tensor(full["param_groups"][0]["lr"])
    return out


def _zero_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in
                                        ((a[k], b[k]) for k in a))


@pytest.mark.parametrize("saved, loaded, dtype", [(1, 3, torch.float32), (3, 2, torch.float32),
                                                  (2, 2, torch.float32), (3, 1, torch.bfloat16)])
def test_a_zero_optimizer_resumes_at_another_stage_bit_for_bit(tmp_path: Path, saved: int, loaded: int,
                                                               dtype: torch.dtype) -> None:
    model, opt = _zero(saved, 0, dtype)
    _zero_train(model, opt, range(3))
    checkpoint.save(tmp_path, 3, {"model": model, "opt": opt})
    want = _zero_state(model, opt)
    entries = checkpoint.load_checkpoint(tmp_path / "ckpt-3", verify=False).metadata["entries"]
    assert entries["opt"]["kind"] == "torch.zero_optimizer" and entries["opt"]["meta"]["stage"] == saved
    other, opt2 = _zero(loaded, 7, dtype, lr=0.5)
    before = _zero_state(other, opt2)
    assert not _zero_equal(before, want)
    assert checkpoint.load(tmp_path, {"model": other, "opt": opt2}) == {"step": 3}
    assert _zero_equal(_zero_state(other, opt2), want)
    _zero_train(model, opt, range(3, 5))
    _zero_train(other, opt2, range(3, 5))
    got, after = _zero_state(other, opt2), _zero_state(model, opt)
    if saved == loaded:  # the same steps: the same bits
        assert _zero_equal(got, after)
    else:  # another stage computes the gradients another way (fused weight gradients, other buckets)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        bad = [k for k in got if not torch.allclose(got[k].float(), after[k].float(), rtol=tol, atol=tol * 1e-2)]
        assert got.keys() == after.keys() and not bad, bad


def test_under_zero3_the_module_entry_leaves_the_parameters_to_the_optimizer(tmp_path: Path) -> None:
    model, opt = _zero(3, 0)
    _zero_train(model, opt, range(2))
    checkpoint.save(tmp_path, 2, {"model": model, "opt": opt})
    meta = checkpoint.load_checkpoint(tmp_path / "ckpt-2", verify=False).metadata
    module = meta["entries"]["model"]["meta"]
    assert module["zero3"] == ["a.bias", "a.weight", "b.bias", "b.weight"]
    assert sorted(module["tensors"]) == ["frozen.bias", "frozen.weight", "seen"]
    assert sorted(k for k in meta["tensors"] if k.startswith("opt/") and "/" not in k[4:]) == [
        "opt/a.bias", "opt/a.weight", "opt/b.bias", "opt/b.weight"]
    # a model without a ZeroOptimizer cannot take the module entry alone: its weights are in the optimizer's
    plain = _ZeroNet(5)
    kept = {k: v.clone() for k, v in plain.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"entry 'model' was saved with parameters a ZeRO-3 ZeroOptimizer "
                                              r"partitioned \(a.bias, a.weight, b.bias, b.weight\).*"
                                              r"load\(path, \{'model': model, 'opt': zero_opt\}\)"):
        checkpoint.load(tmp_path, {"model": plain})
    assert all(torch.equal(kept[k], v) for k, v in plain.state_dict().items())
    # saved at stage 1 (the module entry holds every weight), a stage-3 model takes the optimizer's
    model1, opt1 = _zero(1, 0)
    _zero_train(model1, opt1, range(2))
    checkpoint.save(tmp_path / "s1", 2, {"model": model1, "opt": opt1})
    assert checkpoint.load_checkpoint(tmp_path / "s1" / "ckpt-2", verify=False).metadata[
        "entries"]["model"]["meta"]["zero3"] == []
    model3, opt3 = _zero(3, 9)
    checkpoint.load(tmp_path / "s1", {"model": model3, "opt": opt3})
    assert _zero_equal(_zero_state(model3, opt3), _zero_state(model1, opt1))


def test_a_zero_optimizer_of_another_model_or_class_is_refused(tmp_path: Path) -> None:
    from shardwise.adapters.torch.zero import ZeroOptimizer
    from shardwise.backends.local import LocalCommunicator

    model, opt = _zero(2, 0)
    _zero_train(model, opt, range(1))
    checkpoint.save(tmp_path, 1, {"opt": opt})
    sgd = ZeroOptimizer(_ZeroNet(1), torch.optim.SGD, stage=2, comm=LocalCommunicator(), lr=0.1)
    with pytest.raises(CheckpointError, match="entry 'opt' holds Adam state, this ZeroOptimizer wraps SGD"):
        checkpoint.load(tmp_path, {"opt": sgd})
    wider = ZeroOptimizer(nn.Sequential(nn.Linear(4, 7)), torch.optim.Adam, stage=2, comm=LocalCommunicator())
    with pytest.raises(CheckpointError, match="checkpoint entry 'opt'"):
        checkpoint.load(tmp_path, {"opt": wider})


def test_a_save_that_cannot_describe_its_state_writes_nothing(tmp_path: Path) -> None:
    model = nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(CheckpointError, match="failed on rank 0; nothing was written. Rank 0: CheckpointError: "
                                              "tensor 'weight' is torch.complex64"):
        checkpoint.save(tmp_path, 1, {"model": model})
    assert not (tmp_path / "ckpt-1").exists()
