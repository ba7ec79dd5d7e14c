"""``torch.compile`` (inductor) with DP, DDP, ZeRO 1/2/3 and ``parallelize`` on 2 ranks equals eager one-process training.

``whole`` compiles the model (``torch.compile(model)``, ``fullgraph`` with ``fullgraph=True``),
``blocks`` each block in place (``block.compile()``), ``titan`` replaces each block by
``torch.compile(block, fullgraph=True)`` as torchtitan does, ``late`` compiles the blocks after a
first eager step, ``step`` compiles the whole train step (zero_grad, forward, backward,
optimizer step), so gradient hooks and the optimizer run from inside a compiled frame. The
ranks stay up between cases (a shared job): each case recompiles its graphs, which inductor's on-disk cache makes cheap after the first.
"""

import pytest

from mpi_harness import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("wrapper, how", [("optimizer", "whole"), ("optimizer", "titan"), ("ddp", "whole"),
                                          ("ddp", "blocks"), ("optimizer", "step"), ("ddp", "step")])
def test_data_parallel_compiled_equals_eager(wrapper, how):
    run_mpi(2, "compile_scenarios:data_parallel", backend="mpi", wrapper=wrapper, how=how, timeout=300,
            shared=True)


@pytest.mark.parametrize("backend, stage, how, fuse", [
    ("mpi", 1, "whole", True),
    ("mpi", 2, "whole", True),      # the fusion turns itself off: one warning
    ("mpi", 2, "fullgraph", True),  # ... without breaking the graph
    ("mpi", 2, "blocks", False),    # fusion off by the caller: no warning
    ("mpi", 2, "eager", True),      # not compiled: the fusion stays on, no warning
    ("mpi", 3, "blocks", True),
    ("mpi", 3, "titan", True),
    ("mpi", 3, "late", True),       # blocks compiled after an eager step: off from then on, one warning
    ("mpi", 3, "whole", False),
    ("torch", 3, "whole", True),
    ("mpi", 1, "step", True),       # the whole train step compiled: hooks fire inside a compiled frame
    ("mpi", 2, "step", True),
    ("mpi", 3, "step", True),
])
def test_zero_compiled_equals_eager(backend, stage, how, fuse):
    run_mpi(2, "compile_scenarios:zero", backend=backend, stage=stage, how=how, fuse=fuse, timeout=300, shared=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_given_the_compiled_model(stage):
    run_mpi(2, "compile_scenarios:zero", backend="mpi", stage=stage, how="whole", fuse=True, wrap_compiled=True,
            timeout=300, shared=True)


@pytest.mark.parametrize("layout, seq_lens", [
    ({"dp": 2, "zero_stage": 0}, ()),
    ({"dp": 2, "zero_stage": 3}, ()),
    ({"tp": 2}, (16, 8, 12, 16)),  # recompiled with dynamic shapes
    ({"tp": 2, "sequence_parallel": True, "vocab_parallel": True}, ()),
    ({"pp": 2, "micro_batches": 4, "schedule": "interleaved_1f1b", "virtual_stages": 2}, ()),
])
def test_parallelize_gpt2_compiled_blocks(layout, seq_lens):
    run_mpi(2, "compile_scenarios:parallel_gpt2", backend="mpi", layout=layout, seq_lens=seq_lens, timeout=300,
            shared=True)


def test_collectives_and_sync_batchnorm_in_compiled_code():
    run_mpi(2, "compile_scenarios:collectives_in_compiled_code", backend="mpi", timeout=300, shared=True)
