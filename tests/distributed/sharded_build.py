"""Models built on the meta device, Hugging Face weights in and out, and checkpoints that change layout.

Every scenario compares with one process: the same model built normally after the
same seed (``hf_parallel.build``) and trained on the whole global batch. Whole
tensors are compared on the rank that :class:`StageTensors` hands them to, so every
tensor of the model is checked by exactly one rank.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Callable

import torch

import shardwise
from hf_parallel import OPT_ARGS, OPTIMIZER, _batches, _close, _reference, build
from shardwise.adapters.torch.parallel.full_tensors import StageTensors
from shardwise.adapters.torch.parallel.parallelize import ParallelModel, parallelize
from shardwise.core.errors import CheckpointError
from shardwise.core.layout import ParallelLayout

RTOL, ATOL = 1e-5, 2e-6


def _meta(family: str, seed: int = 0) -> torch.nn.Module:
    with torch.device("meta"):
        return build(family, seed)


def _whole(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """The whole parameters this rank is handed (each parameter lands on exactly one rank of its stage)."""
    got: dict[str, torch.Tensor] = {}
    StageTensors(pm, optimizer=False, masters=False).stream(lambda e, t: got.__setitem__(e.key, t.clone()))
    return got


def _compare(got: dict[str, torch.Tensor], want: torch.nn.Module, what: str, exact: bool = False) -> int:
    ref = dict(want.named_parameters())
    for name, t in got.items():
        w = ref[name].detach()
        same = torch.equal(t, w) if exact else torch.allclose(t.float(), w.float(), rtol=RTOL, atol=ATOL)
        if not same:
            raise AssertionError(f"{what}: {name} differs by {float((t.float() - w.float()).abs().max()):.3g}")
    return len(got)


def _count(world: Any, n: int) -> int:
    return int(world.allreduce(torch.tensor([float(n)]), "sum")[0])


def meta_init(backend: str, cases: list[list[Any]]) -> None:
    """A meta-built model starts from the one-process initial weights and trains like one process."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    batches = _batches()
    for family, fields in cases:
        ref = build(family)
        after_ref = torch.rand(4)  # the generator after a normal build
        torch.manual_seed(0)
        pm = parallelize(_meta(family), OPTIMIZER, ParallelLayout(**fields), **OPT_ARGS)
        if not torch.equal(torch.rand(4), after_ref):
            raise AssertionError("the generator after parallelize differs from after a normal build")
        if any(p.is_meta for p in pm.module.parameters()) or any(b.is_meta for b in pm.module.buffers()):
            raise AssertionError("a parameter or buffer is still on the meta device")
        checked = _count(world, _compare(_whole(pm), ref, "initial weights", exact=True))
        if checked != len(dict(ref.named_parameters())):
            raise AssertionError(f"{checked} tensors checked, the model has {len(dict(ref.named_parameters()))}")
        want = _reference(ref, batches)
        for step, ids in enumerate(batches):
            _close(pm.train_step(pm.shard_batch(ids)), want[step], f"{family} {pm.layout.describe()} step {step}")
        _compare(_whole(pm), ref, "trained weights")
        pm.groups.free()
        if world.rank == 0:
            print(f"OK meta {family} {pm.layout.describe()}: {checked} tensors equal at init", flush=True)


def hf_weights(backend: str, directory: str, cases: list[list[Any]]) -> None:
    """A ``save_pretrained`` directory loads into each layout (slices only) and trains as from_pretrained does."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    batches = _batches()
    for family, fields in cases:
        path = Path(directory) / family
        if world.rank == 0 and not path.exists():
            build(family, seed=7).save_pretrained(str(path), max_shard_size="20KB")  # a sharded index
        world.barrier()
        ref = AutoModelForCausalLM.from_pretrained(str(path))
        meta = _meta(family)
        state = torch.get_rng_state()
        pm = parallelize(meta, OPTIMIZER, ParallelLayout(**fields), weights=str(path), **OPT_ARGS)
        if not torch.equal(torch.get_rng_state(), state):
            raise AssertionError("loading weights moved the generator")
        checked = _count(world, _compare(_whole(pm), ref, "loaded weights", exact=True))
        want = _reference(ref, batches[:2])
        for step, ids in enumerate(batches[:2]):
            _close(pm.train_step(pm.shard_batch(ids)), want[step], f"{family} {pm.layout.describe()} step {step}")
        out = Path(directory) / f"export-{family}-{world.size}"
        pm.save_pretrained(out)
        if world.rank == 0:
            exported = AutoModelForCausalLM.from_pretrained(str(out))
            ids = batches[0]
            with torch.no_grad():
                got, wanted = exported(ids).logits, ref(ids).logits
            if not torch.allclose(got, wanted, rtol=RTOL, atol=1e-5):
                raise AssertionError(f"exported logits differ by {float((got - wanted).abs().max()):.3g}")
            print(f"OK weights {family} {pm.layout.describe()}: {checked} tensors loaded, exported logits equal",
                  flush=True)
        pm.groups.free()


def _train_from(pm: ParallelModel, batches: list[torch.Tensor], start: int, stop: int, want: list[float]) -> None:
    for step in range(start, stop):
        got = pm.train_step(pm.shard_batch(batches[step]))
        if abs(got - want[step]) > RTOL * abs(want[step]):
            raise AssertionError(f"{pm.layout.describe()} step {step}: loss {got!r}, uninterrupted one-process "
                                 f"run {want[step]!r} (rtol {abs(got - want[step]) / abs(want[step]):.2g})")


#: The optimizers of the resume scenario: SGD with momentum (its losses and parameters are compared
#: with one process at rtol 1e-5; see hf_parallel on why not Adam) and AdamW (compared bit for bit
#: with the same layout trained without interruption: Adam's division by sqrt(v) turns the rounding
#: differences between layouts into parameter differences above 1e-5 where gradients are near zero).
OPTIMIZERS = {"sgd": (OPTIMIZER, OPT_ARGS), "adamw": (torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.1})}


def _one_process(family: str, optimizer: str, batches: list[torch.Tensor]) -> tuple[torch.nn.Module, list[float]]:
    model = build(family)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, losses


def resume(backend: str, directory: str, family: str, fields: dict, start: int, stop: int, save: bool,
           kill: bool, optimizer: str = "sgd") -> None:
    """Load the newest checkpoint (if ``start``), train steps ``[start, stop)``, compare with an
    uninterrupted run, then save (and SIGKILL every rank, as a crash right after a save would)."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    batches = _batches(seed=3) + _batches(seed=4)
    cls, kwargs = OPTIMIZERS[optimizer]
    trained, want = _one_process(family, optimizer, batches[:stop])

    def fresh() -> ParallelModel:
        torch.manual_seed(0)
        return parallelize(_meta(family), cls, ParallelLayout(**fields), **kwargs)

    pm = fresh()
    if start:
        extra = pm.load_checkpoint(directory)
        if extra["step"] != start or extra["next_batch"] != start:
            raise AssertionError(f"checkpoint at step {extra['step']} (batch {extra['next_batch']}), expected {start}")
    if optimizer == "sgd":
        _train_from(pm, batches, start, stop, want)
        checked = _count(world, _compare(_whole(pm), trained, f"parameters after step {stop - 1}"))
    else:
        for step in range(start, stop):
            pm.train_step(pm.shard_batch(batches[step]))
        uninterrupted = fresh()
        for step in range(stop):
            uninterrupted.train_step(uninterrupted.shard_batch(batches[step]))
        mine, theirs = _whole(pm), _whole(uninterrupted)
        different = [k for k in mine if not torch.equal(mine[k], theirs[k])]
        if different:
            raise AssertionError(f"resumed {optimizer} training differs from uninterrupted: {different[:4]}")
        checked = _count(world, len(mine))
        uninterrupted.groups.free()
    if save:
        pm.save_checkpoint(directory, stop, extra={"next_batch": stop}, keep=2)
    if world.rank == 0:
        print(f"OK resume {optimizer} {family} {pm.layout.describe()} on {world.size} ranks: steps {start}-{stop - 1} "
              f"and {checked} parameters equal to an uninterrupted run", flush=True)
    if kill:
        world.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    pm.groups.free()


def _held_equal(pm: ParallelModel, source: Any, what: str) -> int:
    """Every whole tensor of ``pm`` (parameters, fp32 masters, optimizer state) that the checkpoint holds
    equals it bit for bit; returns how many this rank compared."""
    held: dict[str, torch.Tensor] = {}
    StageTensors(pm).stream(lambda e, t: held.__setitem__(e.key, t.clone()))
    compared = [k for k in held if k in source.files]
    wrong = [k for k in compared if not torch.equal(source.read_whole(k), held[k])]
    if wrong or not compared and held:
        raise AssertionError(f"{what}: {len(wrong)} of {len(compared)} tensors differ from the checkpoint, "
                             f"e.g. {wrong[:4]}")
    return len(compared)


def save_layouts(backend: str, directory: str, cases: list[list[Any]]) -> None:
    """A checkpoint of each layout holds its whole tensors bit for bit; another layout loads them bit
    for bit and (in fp32) trains on as one process would."""
    from shardwise.adapters.torch.checkpoint.pieces import PiecesSource
    from shardwise.checkpoint.store import load_checkpoint

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    batches = _batches(seed=3)
    for i, (family, saved_as, loaded_as) in enumerate(cases):
        _, want = _one_process(family, "sgd", batches[:3])
        torch.manual_seed(0)
        pm = parallelize(_meta(family), OPTIMIZER, ParallelLayout(**saved_as), **OPT_ARGS)
        for step in range(2):
            pm.train_step(pm.shard_batch(batches[step]))
        path = pm.save_checkpoint(Path(directory) / f"case-{i}", 2)
        source = PiecesSource.from_metadata(load_checkpoint(path).metadata, path)
        saved = _count(world, _held_equal(pm, source, f"{pm.layout.describe()} saved"))
        pm.groups.free()
        other = parallelize(_meta(family, seed=1), OPTIMIZER, ParallelLayout(**loaded_as), **OPT_ARGS)
        other.load_checkpoint(path)
        loaded = _count(world, _held_equal(other, source, f"{other.layout.describe()} loaded"))
        source.close()
        if other.layout.precision == "fp32":
            _train_from(other, batches, 2, 3, want)
        if world.rank == 0:
            print(f"OK save {family} {ParallelLayout(**saved_as).describe()} -> {other.layout.describe()}: {saved} "
                  f"tensors saved and {loaded} loaded bit for bit" +
                  (", step 2 as one process" if other.layout.precision == "fp32" else ""), flush=True)
        other.groups.free()


def kill_mid_save(backend: str, directory: str) -> None:
    """Save step 1, then die by SIGKILL while rank 1 writes step 2's file."""
    from shardwise.checkpoint import safetensors_stream

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    batches = _batches(seed=3)
    torch.manual_seed(0)
    pm = parallelize(_meta("gpt2"), OPTIMIZER, ParallelLayout(dp=world.size, zero_stage=3), **OPT_ARGS)
    pm.train_step(pm.shard_batch(batches[0]))
    pm.save_checkpoint(directory, 1, extra={"next_batch": 1})
    pm.train_step(pm.shard_batch(batches[1]))
    write: Callable = safetensors_stream.SafetensorsWriter.write
    count = [0]

    def dying_write(self: Any, name: str, data: Any) -> None:
        write(self, name, data)
        count[0] += 1
        if world.rank == 1 and count[0] == 3:
            self.f.flush()
            print("killing rank 1 mid-save", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    safetensors_stream.SafetensorsWriter.write = dying_write
    pm.save_checkpoint(directory, 2, extra={"next_batch": 2})
    raise AssertionError("the save survived the kill")


def bad_inputs(backend: str, directory: str) -> None:
    """Weights or checkpoints of another model, truncated files, a newer format: one clear error on every rank."""
    import json

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    root = Path(directory)
    other = root / "other-model"
    if world.rank == 0:
        GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=48, n_head=4, vocab_size=96, n_positions=16)).save_pretrained(
            str(other))
        build("gpt2", seed=7).save_pretrained(str(root / "good"))
        cut = root / "truncated"
        cut.mkdir(exist_ok=True)
        data = (root / "good" / "model.safetensors").read_bytes()
        (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
        (cut / "config.json").write_bytes((root / "good" / "config.json").read_bytes())
    world.barrier()
    layout = ParallelLayout(dp=world.size, zero_stage=3)

    def refused(what: str, call: Callable[[], Any], needle: str) -> None:
        try:
            call()
        except CheckpointError as exc:
            if needle not in str(exc):
                raise AssertionError(f"{what}: the error does not say {needle!r}: {exc}") from None
            if world.rank == 0:
                print(f"OK refused {what}: {exc}", flush=True)
            return
        raise AssertionError(f"{what} was accepted")

    refused("weights of another model",
            lambda: parallelize(_meta("gpt2"), OPTIMIZER, layout, weights=str(other), **OPT_ARGS), "transformer.wte")
    refused("a truncated weights file",
            lambda: parallelize(_meta("gpt2"), OPTIMIZER, layout, weights=str(root / "truncated"), **OPT_ARGS),
            "model.safetensors")
    torch.manual_seed(0)
    pm = parallelize(_meta("gpt2"), OPTIMIZER, layout, **OPT_ARGS)
    pm.train_step(pm.shard_batch(_batches()[0]))
    saved = pm.save_checkpoint(root / "ckpts", 1)
    before = {k: v.clone() for k, v in _whole(pm).items()}
    world.barrier()
    if world.rank == 0:
        newer = root / "newer" / "ckpt-1"
        newer.mkdir(parents=True)
        for f in saved.iterdir():
            (newer / f.name).write_bytes(f.read_bytes())
        manifest = json.loads((newer / "manifest.json").read_text())
        manifest["metadata"]["version"] = 99
        (newer / "manifest.json").write_text(json.dumps(manifest))
        short = root / "short" / "ckpt-1"
        short.mkdir(parents=True)
        for f in saved.iterdir():
            (short / f.name).write_bytes(f.read_bytes())
        data = (short / "rank-00001.safetensors").read_bytes()
        (short / "rank-00001.safetensors").write_bytes(data[: len(data) - 100])
        flipped = root / "flipped" / "ckpt-1"
        flipped.mkdir(parents=True)
        for f in saved.iterdir():
            (flipped / f.name).write_bytes(f.read_bytes())
        data = bytearray((flipped / "rank-00001.safetensors").read_bytes())
        middle = len(data) // 2
        data[middle: middle + 64] = bytes(b ^ 0xFF for b in data[middle: middle + 64])  # same size
        (flipped / "rank-00001.safetensors").write_bytes(bytes(data))
    world.barrier()
    refused("a checkpoint from a newer format", lambda: pm.load_checkpoint(root / "newer"), "version 99")
    refused("a truncated checkpoint file", lambda: pm.load_checkpoint(root / "short"), "rank-00001.safetensors")
    # Only rank 1 reads the damaged blocks (its own shards); every rank must still refuse the load.
    refused("64 bytes flipped inside a checkpoint file", lambda: pm.load_checkpoint(root / "flipped"),
            "rank-00001.safetensors: damaged: block ")
    llama = parallelize(_meta("llama"), OPTIMIZER, layout, **OPT_ARGS)
    refused("a checkpoint of another model", lambda: llama.load_checkpoint(saved), "model.embed_tokens.weight")
    after = _whole(pm)
    if any(not torch.equal(before[k], after[k]) for k in before):
        raise AssertionError("a refused load changed the model")
    if world.rank == 0:
        print("OK nothing changed by the refused loads", flush=True)
