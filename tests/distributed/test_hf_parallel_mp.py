"""``shardwise.torch.parallelize`` on Hugging Face GPT-2 and Llama, 2 and 4 real ranks, vs one process."""


import pytest

from example_results import example_result
from mpi_harness import run_mpi

pytest.importorskip("transformers")
pytestmark = pytest.mark.mpi

TWO_RANKS = [
    ["gpt2", {"dp": 2}],
    ["gpt2", {"dp": 2, "zero_stage": 3}],
    ["gpt2", {"pp": 2, "micro_batches": 2}],
    ["gpt2", {"tp": 2}],
    ["llama", {"tp": 2, "activation_checkpointing": True}],
    ["llama", {"pp": 2, "micro_batches": 4, "schedule": "gpipe"}],
    ["llama", {"dp": 2, "zero_stage": 1, "gradient_accumulation_steps": 2}],
]

FOUR_RANKS = [
    ["gpt2", {"dp": 2, "pp": 2, "micro_batches": 2}],
    ["gpt2", {"dp": 4, "zero_stage": 3}],
    ["gpt2", {"dp": 2, "tp": 2, "zero_stage": 2}],
    ["llama", {"tp": 2, "pp": 2, "micro_batches": 2, "gradient_clipping": 0.05}],
    ["gpt2", {"pp": 2, "dp": 2, "micro_batches": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"}],
]

#: ZeRO 1 and 2 under both pipeline schedules (a tied GPT-2 embedding on the first and last stage),
#: and global-norm clipping with ZeRO across tensor and pipeline parallelism.
ZERO_COMBINED = [
    ["gpt2", {"dp": 2, "pp": 2, "micro_batches": 2, "zero_stage": 1}],
    ["llama", {"dp": 2, "pp": 2, "micro_batches": 2, "zero_stage": 2}],
    ["gpt2", {"dp": 2, "pp": 2, "micro_batches": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b",
              "zero_stage": 2, "gradient_clipping": 0.05}],
    ["llama", {"dp": 2, "pp": 2, "micro_batches": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b",
               "zero_stage": 1, "gradient_accumulation_steps": 2}],
    ["llama", {"dp": 2, "tp": 2, "zero_stage": 1, "gradient_clipping": 0.05}],
]


def _ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("OK ")]


def test_two_ranks_match_one_process() -> None:
    # torch.distributed (gloo) here, mpi on 4 ranks: both backends carry every kind of traffic
    result = run_mpi(2, "hf_parallel:layouts", backend="torch", cases=TWO_RANKS, timeout=300, shared=True)
    assert len(_ok_lines(result.output)) == len(TWO_RANKS), result.output[-3000:]


def test_four_ranks_match_one_process() -> None:
    result = run_mpi(4, "hf_parallel:layouts", backend="mpi", cases=FOUR_RANKS, timeout=360, shared=True)
    assert len(_ok_lines(result.output)) == len(FOUR_RANKS), result.output[-3000:]


def test_zero_with_pipelines_and_clipping_with_tensor_parallelism_match_one_process() -> None:
    result = run_mpi(4, "hf_parallel:layouts", backend="mpi", cases=ZERO_COMBINED, timeout=360, shared=True)
    assert len(_ok_lines(result.output)) == len(ZERO_COMBINED), result.output[-3000:]


#: The token table and LM head split by vocabulary: tied (GPT-2) and untied (Llama), a vocabulary of 97
#: that 2 and 4 do not divide, with pipelines, ZeRO and clipping.
VOCAB_PARALLEL = [
    ["gpt2:97", {"tp": 4, "vocab_parallel": True}],
    ["llama-mha", {"tp": 4, "vocab_parallel": True}],
    ["llama:97", {"tp": 2, "pp": 2, "micro_batches": 2, "vocab_parallel": True}],
    ["gpt2", {"tp": 2, "pp": 2, "micro_batches": 2, "vocab_parallel": True, "gradient_clipping": 0.05}],
    ["llama", {"dp": 2, "tp": 2, "zero_stage": 1, "vocab_parallel": True}],
    ["gpt2:97", {"dp": 2, "tp": 2, "zero_stage": 3, "vocab_parallel": True}],
]


def test_vocab_parallel_layouts_match_one_process() -> None:
    result = run_mpi(4, "hf_parallel:layouts", backend="mpi", cases=VOCAB_PARALLEL, timeout=360, shared=True)
    assert len(_ok_lines(result.output)) == len(VOCAB_PARALLEL), result.output[-3000:]


#: Mistral and Qwen2 (biased q/k/v) share Llama's rule table.
OTHER_FAMILIES = [
    ["mistral", {"dp": 2, "tp": 2}],
    ["qwen2", {"dp": 2, "tp": 2, "zero_stage": 1}],
    ["mistral", {"dp": 2, "pp": 2, "micro_batches": 2}],
    ["qwen2", {"pp": 2, "tp": 2, "micro_batches": 2, "vocab_parallel": True}],
]


def test_mistral_and_qwen2_match_one_process() -> None:
    result = run_mpi(4, "hf_parallel:layouts", backend="mpi", cases=OTHER_FAMILIES, timeout=300, shared=True)
    assert len(_ok_lines(result.output)) == len(OTHER_FAMILIES), result.output[-3000:]


#: Sequence parallelism, with and without activation checkpointing, ZeRO, pipelines and vocabulary splits.
SEQUENCE_PARALLEL = [
    ["gpt2", {"dp": 2, "tp": 2, "sequence_parallel": True}],
    ["llama", {"dp": 2, "tp": 2, "sequence_parallel": True, "activation_checkpointing": True, "zero_stage": 2}],
    ["gpt2", {"tp": 2, "pp": 2, "micro_batches": 2, "sequence_parallel": True, "vocab_parallel": True}],
    ["llama-mha", {"tp": 4, "sequence_parallel": True, "gradient_clipping": 0.05}],
    ["gpt2", {"dp": 2, "tp": 2, "zero_stage": 3, "sequence_parallel": True, "activation_checkpointing": True}],
]
SEQUENCE_PARALLEL_TP2 = [
    ["gpt2", {"tp": 2, "sequence_parallel": True}],
    ["llama", {"tp": 2, "sequence_parallel": True, "activation_checkpointing": True}],
]


def test_sequence_parallel_layouts_match_one_process() -> None:
    result = run_mpi(2, "hf_parallel:layouts", backend="torch", cases=SEQUENCE_PARALLEL_TP2, timeout=240, shared=True)
    assert len(_ok_lines(result.output)) == len(SEQUENCE_PARALLEL_TP2), result.output[-3000:]
    result = run_mpi(4, "hf_parallel:layouts", backend="mpi", cases=SEQUENCE_PARALLEL, timeout=360, shared=True)
    assert len(_ok_lines(result.output)) == len(SEQUENCE_PARALLEL), result.output[-3000:]


MIXED_PRECISION = [
    ["gpt2", {"dp": 2, "precision": "bf16"}],
    ["gpt2", {"pp": 2, "micro_batches": 2, "precision": "fp16"}],
    ["llama", {"tp": 2, "precision": "fp16", "gradient_clipping": 0.05}],
    ["gpt2", {"dp": 2, "zero_stage": 1, "precision": "fp16"}],
]


def test_bf16_and_fp16_with_loss_scaling_track_fp32_and_skip_overflows_on_every_rank() -> None:
    # fp16 cases force an inf into one rank's gradient at step 10: every rank must skip that step
    result = run_mpi(2, "hf_parallel:mixed_precision", backend="mpi", cases=MIXED_PRECISION, timeout=300, shared=True)
    assert len(_ok_lines(result.output)) == len(MIXED_PRECISION), result.output[-3000:]


def test_zero_1_with_a_pipeline_holds_half_of_each_stages_optimizer_state() -> None:
    result = run_mpi(4, "hf_parallel:zero_pipeline_state", backend="mpi", timeout=180, shared=True)
    assert "OK zero-1 pp2" in result.output, result.output[-3000:]


def test_deepspeed_json_trains_as_explicit_layout() -> None:
    result = run_mpi(2, "hf_parallel:deepspeed_config", backend="mpi", timeout=240, shared=True)
    assert "OK deepspeed dp=2" in result.output, result.output[-3000:]


def test_deepspeed_json_pipeline_and_tensor_parallel_sections_train_as_tp2_pp2() -> None:
    result = run_mpi(4, "hf_parallel:deepspeed_config", backend="mpi", mesh=True, timeout=300, shared=True)
    assert "OK deepspeed dp=1 tp=2 pp=2 zero=0 micro_batches=2 1f1b checkpointing vocab_parallel clip=0.05" \
        in result.output, result.output[-3000:]


def test_wrong_world_size_is_refused_on_every_rank() -> None:
    result = run_mpi(2, "hf_parallel:bad_layout", backend="mpi", timeout=120, shared=True)
    assert "OK refused: layout dp=3 x tp=1 x pp=1 needs 3 ranks, but the job has 2" in result.output


@pytest.mark.parametrize("np_, argv", [
    (2, ["--layout", "auto"]),
    (4, ["--model", "llama", "--pp", "2", "--tp", "2", "--micro-batches", "2", "--checkpointing"]),
])
def test_example_trains(np_: int, argv: list) -> None:
    result = run_mpi(np_, "hf_parallel:example", argv=argv + ["--steps", "15", "--layers", "2", "--hidden", "64",
                                                             "--seq-len", "64"], timeout=240, shared=True)
    found = example_result(result.output, "hf_causal_lm")
    layout, losses = found["layout"], found["losses"]
    assert found["ranks"] == np_ and layout["dp"] * layout["tp"] * layout["pp"] == np_, found
    if "--tp" in argv:
        assert (layout["tp"], layout["pp"], layout["dp"]) == (2, 2, 1), found
    assert found["first_step"] == 1 and found["steps"] == 15 and list(losses) == [str(s) for s in range(1, 16)]
    assert found["loss"] == losses["15"], found
    assert losses["15"] < losses["5"] - 0.3, found  # the loss logged at step 15 against the one at step 5


def test_bf16_with_fp32_masters_tracks_fp32_training() -> None:
    result = run_mpi(2, "hf_parallel:bf16", backend="mpi", timeout=120, shared=True)
    assert "OK bf16" in result.output, result.output[-3000:]


def test_any_module_under_zero() -> None:
    # no split rules needed for data parallelism and ZeRO: a plain module and a model with no plan (OPT)
    result = run_mpi(2, "hf_parallel:any_module", backend="torch", stages=[1, 2, 3], timeout=240)
    assert len(_ok_lines(result.output)) == 4, result.output[-3000:]
