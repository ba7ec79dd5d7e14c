"""``weights=`` and ``save_pretrained`` of Hugging Face MoE models at expert parallelism, vs one process.

transformers 5 fuses a layer's experts in memory (``experts.gate_up_proj``,
``experts.down_proj``) but its ``save_pretrained`` writes one tensor per expert under
the checkpoint's names (Mixtral's ``block_sparse_moe.experts.<e>.w1.weight``, Qwen3-MoE's
and DeepSeek-V3's ``mlp.experts.<e>.gate_proj.weight``). Rank 0 writes a tiny model with
transformers' own ``save_pretrained``; every rank loads it with ``from_pretrained`` as the
one-process reference; ``parallelize(..., weights=dir)`` of a model of other initial
weights (on the meta device, or built and then overwritten) must hold exactly the
reference's tensors (persistent buffers too), give its logits and its first AdamW step's
loss; then shardwise's ``save_pretrained`` must write transformers' own keys, and
``from_pretrained`` of it must equal the trained one-process model.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch

import shardwise
from shardwise.adapters.torch.checkpoint.safetensors_torch import TorchSafetensorsFile as SafetensorsFile
from shardwise.core.errors import ConfigError
from shardwise.core.layout import ParallelLayout

from moe_ep import EPS, LR, PARAM_ATOL, SEQ, VOCAB, _close, _compare_whole, _hf_training, _whole, build

#: tensors the expert-parallel copy reads must be the checkpoint's exactly; logits within fp32 rounding
#: of a different reduction order (the all-to-all's)
LOGIT_RTOL, LOGIT_ATOL = 2e-5, 2e-6


def _keys(directory: Path) -> list[str]:
    import json

    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def _gap(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, one-process {tuple(want.shape)}"
    return f"by {float((got - want).abs().max()):.3g}"


def _hf_save(world: Any, family: str, where: Path, experts: int, sharded: bool = False) -> Any:
    """Rank 0 writes a tiny ``family`` model (seed 3) with transformers' save_pretrained (``sharded``: in files
    of 40 KB at most, with an index); every rank loads it."""
    from transformers import AutoModelForCausalLM

    if world.rank == 0:
        build(family, experts, seed=3).save_pretrained(str(where), **({"max_shard_size": "40KB"} if sharded else {}))
    world.barrier()
    keys = _keys(where)
    if sharded and not (where / "model.safetensors.index.json").is_file():
        raise AssertionError(f"{family}: save_pretrained wrote one file")
    if family != "gpt_oss" and not any(".experts.0." in k for k in keys):  # gpt-oss is stored fused
        raise AssertionError(f"{family}: transformers' save_pretrained wrote no per-expert keys: {keys[:12]}")
    ref = AutoModelForCausalLM.from_pretrained(str(where), attn_implementation="eager")
    ref.config.output_router_logits = build(family, experts).config.output_router_logits
    return ref, keys


def _only_own_experts(pm: Any, read: list[str], family: str, layout: ParallelLayout) -> None:
    """The per-expert checkpoint tensors this rank read are those of its own experts, each once."""
    own = {pm.tensors.placement(p).ranges()[0] for p in pm.parameters()
           if pm.tensors.placement(p).name.endswith("experts.gate_up_proj")}
    if len(own) != 1:
        raise AssertionError(f"{family}: this rank holds expert ranges {own}")
    (first, last), = own
    experts = [k for k in read if re.search(r"\.experts\.\d+\.", k)]
    if family == "gpt_oss":  # stored fused: the boxes of this rank's experts of each fused tensor
        return
    seen = {int(re.search(r"\.experts\.(\d+)\.", k).group(1)) for k in experts}
    if seen != set(range(first, last)) or len(experts) != len(set(experts)):
        raise AssertionError(f"{family} {layout.describe()}: this rank holds experts [{first}, {last}) but read "
                             f"per-expert tensors of experts {sorted(seen)} ({len(experts)} reads)")


def load_and_export(backend: str, directory: str, cases: list[list[Any]]) -> None:
    """Each case ``[family, experts, layout fields, "meta" | "built"]`` (built: the model built with other
    weights and buffers, the checkpoint in several files): weights= of transformers' save_pretrained
    equals from_pretrained (tensors, buffers, logits, first step's loss); shardwise's save_pretrained after
    the step writes transformers' keys, and from_pretrained of it equals the one-process trained model."""
    from transformers import AutoModelForCausalLM

    from shardwise.adapters.torch.parallel.hf_conversion import persistent_buffers
    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from shardwise.adapters.torch.parallel.weights import take

    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    for i, (family, experts, fields, how) in enumerate(cases):
        layout = ParallelLayout(**fields)
        where = Path(directory) / f"{family}-{i}-hf"
        ref, keys = _hf_save(world, family, where, experts, sharded=how == "built")
        if how == "meta":
            with torch.device("meta"):
                model = build(family, experts, seed=9)
        else:
            model = build(family, experts, seed=9)
            for name, buf in persistent_buffers(model).items():  # differ from the checkpoint's
                buf.add_(1.0)
        read: list[str] = []
        original = SafetensorsFile.read

        def recording(self: SafetensorsFile, name: str, box: tuple = ()) -> torch.Tensor:
            read.append(name)
            return original(self, name, box)
        SafetensorsFile.read = recording  # type: ignore[method-assign]
        try:
            pm = parallelize(model, torch.optim.AdamW, layout, weights=str(where), lr=LR, eps=EPS)
        finally:
            SafetensorsFile.read = original  # type: ignore[method-assign]
        _only_own_experts(pm, read, family, layout)
        full = dict(ref.named_parameters())
        checked = 0
        if layout.zero_stage == 3:  # parameters are flat shards: the whole tensors, gathered
            checked = _compare_whole(world, _whole(pm), ref, f"{family} {layout.describe()} weights=")
        for p in pm.parameters() if layout.zero_stage != 3 else ():
            placement = pm.tensors.placement(p)
            if not torch.equal(p.detach(), take(full[placement.name].detach(), placement)):
                raise AssertionError(f"{family} {layout.describe()} weights=: {placement.name} differs from "
                                     "from_pretrained's")
            checked += 1
        ref_buffers = persistent_buffers(ref)
        for name, buf in persistent_buffers(model).items():
            if not torch.equal(buf, ref_buffers[name]):
                raise AssertionError(f"{family} weights=: buffer {name} differs from from_pretrained's")
        gen = torch.Generator().manual_seed(11)
        ids = torch.randint(0, VOCAB, (4 * layout.dp, SEQ), generator=gen)
        mine = pm.shard_batch(ids)
        ref.eval()
        with torch.no_grad():  # routing is per token: the one-process logits of this rank's rows
            want_mine = ref(mine).logits
        got = pm.logits(mine)
        if got.shape != want_mine.shape or not torch.allclose(got, want_mine, rtol=LOGIT_RTOL, atol=LOGIT_ATOL):
            raise AssertionError(f"{family} {layout.describe()} logits differ from from_pretrained's: "
                                 f"{_gap(got, want_mine)}")
        ref.train()
        trained = copy.deepcopy(ref)
        want = _hf_training(trained, [ids], 0.0, 1, layout.dp)
        _close(torch.tensor(pm.train_step(mine)), torch.tensor(want[0]), f"{family} {layout.describe()} step 0")

        export = Path(directory) / f"{family}-{i}-shardwise"
        pm.save_pretrained(export)
        pm.groups.free()
        written = _keys(export)
        if written != keys:
            odd = sorted(set(written) ^ set(keys))[:8]
            raise AssertionError(f"{family}: shardwise's save_pretrained wrote keys {odd} where transformers' differ")
        loaded = AutoModelForCausalLM.from_pretrained(str(export), attn_implementation="eager")
        got_p, want_p = dict(loaded.named_parameters()), dict(trained.named_parameters())
        if set(got_p) != set(want_p):
            raise AssertionError(f"{family}: from_pretrained of the export has {sorted(set(got_p) ^ set(want_p))}")
        bad = [k for k, v in want_p.items() if not torch.allclose(got_p[k], v, rtol=2e-5, atol=PARAM_ATOL)]
        for name, buf in persistent_buffers(trained).items():
            if not torch.equal(persistent_buffers(loaded)[name], buf):
                bad.append(name)
        if bad:
            raise AssertionError(f"{family} {layout.describe()}: from_pretrained of the export differs: {bad[:8]}")
        world.barrier()
        if world.rank == 0:
            print(f"OK weights {family} experts{experts} {layout.describe()} ({how}): {len(keys)} "
                  f"checkpoint keys -> {checked} local tensors equal from_pretrained's, logits and step 0 loss "
                  f"{want[0]:.5f} equal; save_pretrained wrote transformers' {len(written)} keys and "
                  "from_pretrained of it equals the trained model", flush=True)


def refusals(backend: str, directory: str) -> None:
    """A checkpoint tensor transformers converts with an operation shardwise cannot read slice by slice, and
    a key of no tensor of the model, are refused on every rank alike."""
    from transformers.core_model_loading import Transpose, WeightConverter
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)

    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from shardwise.core.errors import CheckpointError

    world = shardwise.init(backend=backend).world
    where = Path(directory) / "mixtral-hf"
    _hf_save(world, "mixtral", where, 4)
    layout = ParallelLayout(dp=world.size, ep=2)
    # an unknown key: renamed by nothing, a tensor of no parameter
    if world.rank == 0:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(where / "model.safetensors"))
        tensors["model.layers.0.block_sparse_moe.experts.0.w9.weight"] = torch.zeros(2, 2)
        odd = Path(directory) / "mixtral-odd"
        odd.mkdir()
        save_file(tensors, str(odd / "model.safetensors"), metadata={"format": "pt"})
        (odd / "config.json").write_text((where / "config.json").read_text())
    world.barrier()
    try:
        parallelize(build("mixtral", 4), torch.optim.AdamW, layout, weights=str(Path(directory) / "mixtral-odd"))
    except CheckpointError as exc:
        if ("unexpected model.layers.0.block_sparse_moe.experts.0.w9.weight (read as "
                "model.layers.0.mlp.experts.0.w9.weight)") not in str(exc):
            raise
        if all(world.allgather_object(True)) and world.rank == 0:
            print(f"OK refused on every rank: {exc}", flush=True)
    else:
        raise AssertionError("a checkpoint key of no parameter was accepted")
    # a conversion shardwise does not read slice by slice (a transpose of the stacked experts)
    original = get_checkpoint_conversion_mapping("mixtral")
    odd_mapping = [t for t in original if type(t).__name__ == "WeightRenaming"]
    odd_mapping += [WeightConverter(source_patterns=[".experts.*.w1.weight", ".experts.*.w3.weight"],
                                    target_patterns=".experts.gate_up_proj",
                                    operations=[Transpose(0, 1)]),
                    [t for t in original if type(t).__name__ == "WeightConverter"][1]]
    register_checkpoint_conversion_mapping("mixtral", odd_mapping, overwrite=True)
    try:
        parallelize(build("mixtral", 4), torch.optim.AdamW, layout, weights=str(where))
    except ConfigError as exc:
        if "model.layers.0.mlp.experts.gate_up_proj from model.layers.0.block_sparse_moe.experts.0.w1.weight" \
                not in str(exc) or "Transpose" not in str(exc):
            raise
        if all(world.allgather_object(True)) and world.rank == 0:
            print(f"OK refused on every rank: {exc}", flush=True)
    else:
        raise AssertionError("an unsupported conversion was accepted")
    finally:
        register_checkpoint_conversion_mapping("mixtral", original, overwrite=True)
