"""Sharded Keras checkpoints on real processes: save on N ranks, resume on M ranks and another backend.

Optimizer kinds: Adam plain, in a DistributedOptimizer (``dp``) or a ZeroOptimizer (``zero1``-``zero3``).

The reference is one-process Keras on the global batch (every rank computes it
locally): a run saved after ``SAVED`` epochs and resumed for ``MORE`` must end
where the uninterrupted one-process run of ``SAVED + MORE`` epochs ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from keras_dp import _data, _iterations, _rank_rows, _same_on_all_ranks, _setup

GLOBAL_BATCH, STEPS, SAVED, MORE = 16, 4, 2, 2
RTOL, ATOL = 1e-5, 1e-6


def _model(seed: int = 5, width: int = 16):
    """401 parameters (odd: every world size pads its ZeRO shards), initialised from numpy so that
    every backend starts from the same values (Keras's initializers draw from each backend's RNG)."""
    import keras

    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(width, activation="tanh"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(scale=0.4, size=w.shape).astype("float32") for w in model.get_weights()])
    return model


def _optimizer(kind: str):
    """``kind``: ``plain``, ``dp``, ``zero1``, ``zero2``, ``zero3``, ``sgd`` (plain SGD with momentum)."""
    import keras

    from shardwise.keras import DistributedOptimizer, ZeroOptimizer

    if kind == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    adam = keras.optimizers.Adam(0.01)
    if kind == "plain":
        return adam
    if kind == "dp":
        return DistributedOptimizer(adam)
    return ZeroOptimizer(adam, stage=int(kind[-1]))


def _compiled(kind: str, seed: int = 5, width: int = 16):
    model = _model(seed, width)
    model.compile(optimizer=_optimizer(kind), loss="mse")
    return model


def _global_data():
    return _data(STEPS * GLOBAL_BATCH, seed=31)


def _my_rows(comm):
    return _rank_rows(STEPS, comm.size, comm.rank, GLOBAL_BATCH // comm.size)


def _reference(epochs: int):
    """One process, plain Adam, global batch: the run every sharded one must match."""
    x, y = _global_data()
    model = _compiled("plain")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model


def _close(want, got, what: str) -> None:
    for i, (a, b) in enumerate(zip(want.get_weights(), got.get_weights())):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL, err_msg=f"{what}: weight {i}")


def save(directory: str, kinds: list[str]) -> None:
    """Train ``SAVED`` epochs with each optimizer ``kind``, a ShardedCheckpoint into ``directory/<kind>``."""
    import keras

    import shardwise.keras as hvd

    comm = _setup()
    x, y = _global_data()
    rows = _my_rows(comm)
    for kind in kinds:
        model = _compiled(kind)
        saver = hvd.callbacks.ShardedCheckpoint(os.path.join(directory, kind), keep=1)
        model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // comm.size, epochs=SAVED, shuffle=False, verbose=0,
                  callbacks=[saver])
        assert len(saver.saved) == SAVED, saver.saved
        kept = sorted(p.name for p in Path(directory, kind).iterdir())
        assert kept == [f"ckpt-{SAVED * STEPS}"], f"keep=1 left {kept}"
        files = sorted(p.name for p in Path(saver.saved[-1]).iterdir() if p.suffix == ".safetensors")
        assert files == [f"rank-{r:05d}.safetensors" for r in range(comm.size)], files
        _same_on_all_ranks(comm, model.get_weights(), kind)
        if comm.rank == 0:
            manifest = json.loads((Path(saver.saved[-1]) / "manifest.json").read_text())["metadata"]
            assert manifest["format"] == "shardwise-state" and manifest["entries"]["model"]["kind"] == "keras.model"
            meta = manifest["entries"]["model"]["meta"]
            assert meta["backend"] == keras.backend.backend() and meta["optimizer"]["stage"] == \
                (int(kind[-1]) if kind.startswith("zero") else 0), meta["optimizer"]
            print(f"saved {kind} on {comm.size} {keras.backend.backend()} ranks: {saver.saved[-1]}")


def resume(directory: str, plan: list[list[str]]) -> None:
    """For each ``[saved kind, resuming kind]``: load, check against the reference, train ``MORE`` epochs."""
    import keras

    import shardwise.keras as hvd

    comm = _setup()
    x, y = _global_data()
    rows = _my_rows(comm)
    at_save, at_end = _reference(SAVED), _reference(SAVED + MORE)
    for n, (saved, kind) in enumerate(plan):
        what = f"{saved} -> {kind} on {comm.size} {keras.backend.backend()} ranks"
        model = _compiled(kind, seed=100 + comm.rank)  # other initial values on every rank: all must be loaded
        if n % 2:  # built before loading (as after a fit), else load builds it as fit would
            model.optimizer.build(model.trainable_variables)
        info = hvd.load_checkpoint(model, os.path.join(directory, saved))
        assert (info.step, info.epoch, info.batch) == (SAVED * STEPS, SAVED, 0), (what, info)
        assert _iterations(model.optimizer) == SAVED * STEPS, what
        _close(at_save, model, f"{what}, loaded")
        model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // comm.size, epochs=SAVED + MORE,
                  initial_epoch=info.epoch, shuffle=False, verbose=0)
        _close(at_end, model, f"{what}, resumed")
        _same_on_all_ranks(comm, model.get_weights(), what)
        assert _iterations(model.optimizer) == (SAVED + MORE) * STEPS, what
        if comm.rank == 0:
            print(f"resumed {what}: equal to the uninterrupted run")


_LOAD_PLAIN = """
import json, sys
import numpy as np
import keras
model = keras.saving.load_model(sys.argv[1])
assert not any(m == "shardwise" or m.startswith("shardwise.") for m in sys.modules), "shardwise was imported"
x = np.load(sys.argv[2])
state = {f"s{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.optimizer.variables)}
np.savez(sys.argv[3], predictions=model.predict(x, verbose=0), **state)
print(json.dumps({"optimizer": type(model.optimizer).__name__, "iterations": int(model.optimizer.iterations)}))
"""


def lifecycle(directory: str, kind: str) -> None:
    """Consolidate -> plain .keras in a process without shardwise; hvd.load_model; refusals."""
    import keras

    import shardwise.keras as hvd
    from shardwise import CheckpointError

    comm = _setup()
    x, y = _global_data()
    rows = _my_rows(comm)
    model = _compiled(kind)
    model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // comm.size, epochs=SAVED, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.ShardedCheckpoint(directory, save_freq=3)])  # every 3 batches
    steps = sorted(int(p.name.split("-")[1]) for p in Path(directory).iterdir())
    assert steps == [3, 6], steps  # the 8th batch is not a multiple of 3
    last = hvd.save_checkpoint(model, directory, epoch=SAVED)
    reference = _reference(SAVED)
    probe = x[:8]
    expected = model.predict(probe, verbose=0)  # every rank: at stage 3 predict gathers each layer

    # One call consolidates; a process that never imports shardwise loads it and predicts the same.
    if comm.rank == 0:
        out = Path(directory).parent / "consolidated.keras"
        hvd.consolidate_checkpoint(directory, out)
        np.save(Path(directory).parent / "probe.npy", probe)
        result = Path(directory).parent / "plain.npz"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
        env["PYTHONPATH"] = ""
        run = subprocess.run([sys.executable, "-c", _LOAD_PLAIN, str(out), str(Path(directory).parent / "probe.npy"),
                              str(result)], capture_output=True, text=True, env=env, timeout=120,
                             cwd=str(Path(directory).parent))
        assert run.returncode == 0, run.stderr[-3000:]
        info = json.loads(run.stdout.strip().splitlines()[-1])
        assert info == {"optimizer": "Adam", "iterations": SAVED * STEPS}, info
        plain = np.load(result)
        np.testing.assert_allclose(plain["predictions"], expected, rtol=1e-6, atol=1e-7)
        ref_state = {f"s{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(reference.optimizer.variables)}
        assert sorted(k for k in plain.files if k != "predictions") == sorted(ref_state), plain.files
        for key, value in ref_state.items():  # iterations, learning rate, Adam's m and v gathered from the shards
            np.testing.assert_allclose(plain[key], value, rtol=RTOL, atol=ATOL, err_msg=key)
        print(f"consolidated {last} -> {out}: plain Keras loads it, same predictions and Adam state")
    comm.barrier()

    # hvd.load_model of a checkpoint directory: the ZeroOptimizer comes back, sharded over these ranks.
    loaded = hvd.load_model(directory)
    assert type(loaded.optimizer).__name__ == "ZeroOptimizer" and loaded.optimizer.stage == int(kind[-1])
    np.testing.assert_allclose(loaded.predict(probe, verbose=0), expected, rtol=1e-6)
    loaded.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // comm.size, epochs=SAVED + MORE, initial_epoch=SAVED,
               shuffle=False, verbose=0)
    _close(_reference(SAVED + MORE), loaded, "hvd.load_model, resumed")

    # A model of another shape, or an optimizer with other slots, is refused before anything is assigned.
    wider = _compiled(kind, width=12)
    before = wider.get_weights()
    for target, needle in [(wider, "(6, 12)"), (_compiled("sgd"), "has slots ['momentum', 'velocity']")]:
        try:
            hvd.load_checkpoint(target, directory)
        except CheckpointError as exc:
            assert needle in str(exc), exc
            if comm.rank == 0:
                print(f"refused: {exc}")
        else:
            raise AssertionError(f"loading into a mismatched model ({needle}) was not refused")
    for a, b in zip(before, wider.get_weights()):
        np.testing.assert_array_equal(a, b)
    weights_only = _compiled("sgd")
    hvd.load_checkpoint(weights_only, directory, include_optimizer=False)
    _close(reference, weights_only, "include_optimizer=False")
    assert _iterations(weights_only.optimizer) == 0


def crash_mid_save(directory: str) -> None:
    """Save once, then let rank 1 die while writing its file of the next save (the job ends here)."""
    import shardwise.keras as hvd
    from shardwise.checkpoint.safetensors_stream import SafetensorsWriter

    comm = _setup()
    x, y = _global_data()
    rows = _my_rows(comm)
    model = _compiled("zero1")
    model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // comm.size, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.ShardedCheckpoint(directory)])
    model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // comm.size, epochs=2, initial_epoch=1, shuffle=False,
              verbose=0)
    if comm.rank == 1:
        def dies_mid_write(writer, name, data):
            writer.f.write(bytes(memoryview(data))[: max(1, memoryview(data).nbytes // 2)])
            writer.f.flush()
            print("rank 1: crashing in the middle of its checkpoint file", flush=True)
            os._exit(17)

        SafetensorsWriter.write = dies_mid_write
    hvd.save_checkpoint(model, directory, epoch=2)
    raise AssertionError("the save should not have returned: rank 1 died in it")


def after_crash(directory: str) -> None:
    """The interrupted save's directory is skipped; the one before it loads and equals the reference."""
    import shardwise.keras as hvd
    from shardwise import CheckpointError

    comm = _setup()
    done, torn = Path(directory) / f"ckpt-{STEPS}", Path(directory) / f"ckpt-{2 * STEPS}"
    assert torn.is_dir() and not (torn / "manifest.json").exists(), sorted(p.name for p in torn.iterdir())
    model = _compiled("zero2", seed=100 + comm.rank)
    info = hvd.load_checkpoint(model, directory)
    assert info.path == done and info.epoch == 1, info
    _close(_reference(1), model, "the checkpoint before the crash")
    try:
        hvd.load_checkpoint(model, torn)
    except CheckpointError as exc:
        assert "incomplete" in str(exc), exc
    else:
        raise AssertionError("the interrupted checkpoint was loaded")


def one_rank_fails(directory: str, kind: str) -> None:
    """A load whose read fails on rank 1 only (a disk error on its file) raises the same CheckpointError
    on every rank, naming rank 1, and changes no weight or optimizer variable anywhere; the same
    checkpoint then loads."""
    import keras

    import shardwise.keras as hvd
    from shardwise import CheckpointError
    from shardwise.checkpoint.safetensors_read import SafetensorsFile

    comm = _setup()
    x, y = _global_data()
    rows = _my_rows(comm)
    model = _compiled(kind)
    model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // comm.size, epochs=1, shuffle=False, verbose=0)
    saved = hvd.save_checkpoint(model, directory, epoch=1)
    at_save = model.get_weights()
    model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // comm.size, epochs=2, initial_epoch=1, shuffle=False,
              verbose=0)

    def state() -> list:
        return model.get_weights() + [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]

    before = state()
    opened = SafetensorsFile.__init__
    if comm.rank == 1:
        def disk_error(file, path, *args, **kwargs):
            if Path(path).name.startswith("rank-00001"):
                raise OSError(5, f"Input/output error reading {Path(path).name}")
            opened(file, path, *args, **kwargs)

        SafetensorsFile.__init__ = disk_error
    try:
        hvd.load_checkpoint(model, saved)
        said = None
    except CheckpointError as exc:
        said = str(exc)
    SafetensorsFile.__init__ = opened
    every = comm.allgather_object(said)
    assert all(m is not None for m in every), f"some rank loaded without error: {every}"
    assert len(set(every)) == 1, f"the ranks raised different errors: {every}"
    assert "rank 1" in every[0], every[0]
    for i, (a, b) in enumerate(zip(before, state())):
        np.testing.assert_array_equal(a, b, err_msg=f"variable {i} changed by the refused load")
    hvd.load_checkpoint(model, saved)
    for i, (a, b) in enumerate(zip(at_save, model.get_weights())):
        np.testing.assert_array_equal(a, b, err_msg=f"weight {i} after loading the checkpoint")
    if comm.rank == 0:
        print(f"OK keras {kind}: a read error on rank 1 refused alike on every rank, nothing changed: {every[0]}",
              flush=True)


class _NoTorch:
    """An import hook under which importing torch fails (as if it were not installed), while
    ``importlib.util.find_spec`` still answers (the backend table asks it)."""

    def find_spec(self, name: str, path=None, target=None):
        import importlib.util

        return importlib.util.spec_from_loader(name, self) if name.split(".")[0] == "torch" else None

    def create_module(self, spec):
        raise ImportError(f"{spec.name} is blocked in this scenario: the Keras checkpoint must not need it")

    def exec_module(self, module) -> None:
        raise ImportError(f"{module.__name__} is blocked in this scenario")


def no_torch_and_legacy(directory: str) -> None:
    """JAX ranks on which torch cannot be imported: a ZeRO-2 checkpoint of the one format loads at ZeRO-3 and
    in a DistributedOptimizer (hvd.load_checkpoint) and through shardwise.checkpoint.load, and resumes to the
    uninterrupted run; the same state in the earlier .npz format (the old writer) still loads, resumes,
    comes back through hvd.load_model and consolidates; torch is never imported."""
    sys.meta_path.insert(0, _NoTorch())
    assert "torch" not in sys.modules, "torch was imported before the scenario began"
    import keras

    import shardwise.checkpoint as ckpt
    import shardwise.keras as hvd
    from shardwise.adapters.keras.checkpoint import save_legacy_checkpoint

    comm = _setup()
    assert keras.backend.backend() == "jax"
    x, y = _global_data()
    rows = _my_rows(comm)
    model = _compiled("zero2")
    model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // comm.size, epochs=SAVED, shuffle=False, verbose=0)
    new = hvd.save_checkpoint(model, os.path.join(directory, "new"), epoch=SAVED)
    old = save_legacy_checkpoint(model, os.path.join(directory, "old"), epoch=SAVED)
    assert sorted(p.name for p in new.iterdir()) == ["manifest.json"] + [f"rank-{r:05d}.safetensors"
                                                                         for r in range(comm.size)]
    assert sorted(p.name for p in old.iterdir()) == ["manifest.json"] + [f"rank-{r:05d}-of-{comm.size:05d}.npz"
                                                                         for r in range(comm.size)]
    at_save, at_end = _reference(SAVED), _reference(SAVED + MORE)
    probe = x[:8]
    expected = model.predict(probe, verbose=0)
    for source in (new, old):
        for kind in ("zero3", "dp"):
            what = f"{source.parent.name} checkpoint -> {kind} on {comm.size} jax ranks without torch"
            target = _compiled(kind, seed=100 + comm.rank)
            info = hvd.load_checkpoint(target, source)
            assert (info.step, info.epoch, info.batch) == (SAVED * STEPS, SAVED, 0), (what, info)
            _close(at_save, target, f"{what}, loaded")
            target.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // comm.size, epochs=SAVED + MORE,
                       initial_epoch=info.epoch, shuffle=False, verbose=0)
            _close(at_end, target, f"{what}, resumed")
            if comm.rank == 0:
                print(f"resumed {what}: equal to the uninterrupted run")
    # The door itself takes a Keras model (no position recorded: "step" only).
    door_target = _compiled("zero3", seed=200 + comm.rank)
    assert ckpt.load(new, {"model": door_target}) == {"step": SAVED * STEPS}
    _close(at_save, door_target, "shardwise.checkpoint.load of the new checkpoint")
    loaded = hvd.load_model(old)
    assert type(loaded.optimizer).__name__ == "ZeroOptimizer" and loaded.optimizer.stage == 2
    np.testing.assert_allclose(loaded.predict(probe, verbose=0), expected, rtol=1e-6)
    if comm.rank == 0:
        for source in (new, old):
            out = Path(directory) / f"{source.parent.name}.keras"
            hvd.consolidate_checkpoint(source, out)
            plain = keras.saving.load_model(out)
            np.testing.assert_allclose(plain.predict(probe, verbose=0), expected, rtol=1e-6, atol=1e-7)
            assert int(plain.optimizer.iterations) == SAVED * STEPS
            print(f"consolidated the {source.parent.name} checkpoint: same predictions")
    comm.barrier()
    assert "torch" not in sys.modules, "torch was imported"
    if comm.rank == 0:
        print("OK no torch: the one format and the old one load on jax", flush=True)
