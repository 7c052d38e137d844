"""examples/train_packed.py: single process, and two processes (DDP, FSDP2 over gloo) against one process."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from .conftest import free_port, run_script, train_packed

# small but real: 4 packed rows of <= 128 tokens per step, 120 stdlib docstrings
SMALL = (
    "--max-length",
    "128",
    "--max-docs",
    "120",
    "--logging-steps",
    "1",
    "--seed",
    "0",
)


def test_train_packed_loss_goes_down(tmp_path):
    log = train_packed(tmp_path, "--max-steps", "4", "--batch-size", "4", *SMALL)
    losses = [h["loss"] for h in log["log_history"] if "loss" in h]
    assert log["world_size"] == 1 and log["steps"] == 4 and len(losses) == 4
    assert all(math.isfinite(x) for x in losses)
    # random init starts near ln(vocab) = ln(259) ~ 5.56; lr 2e-3 Adam brings it well down within 4 steps
    assert abs(losses[0] - math.log(259)) < 0.3
    assert losses[-1] < losses[0] - 0.3
    assert log["real_tokens"] > 0 and log["real_tokens_per_s"] > 0
    # the guard callback ran on every step and saw packed rows of a wrapped model: no padding, and more
    # documents than rows (BFD fills short docstrings into the gaps next to long ones)
    seen = [h for h in log["log_history"] if "safepad/sequences_per_batch" in h]
    assert len(seen) == 4
    assert sum(h["safepad/sequences_per_batch"] for h in seen) > 4 * 4
    assert all(h["safepad/pad_fraction"] == 0 for h in seen)


def test_train_packed_mamba2_keeps_boundaries(tmp_path):
    """Mamba2ForCausalLM.forward takes no position_ids: the example must keep the boundary columns itself.

    With Trainer's default remove_unused_columns, seq_lengths and position_ids would both be dropped and
    each packed row would collate as a single sequence (sequences per batch == rows per batch).
    """
    # rows of 512 tokens hold 2.6 docstrings on average (SMALL's 128-token rows hold about one)
    flags = ("--max-length", "512", "--max-docs", "120", "--logging-steps", "1", "--seed", "0")
    log = train_packed(tmp_path, "--family", "mamba2", "--max-steps", "2", "--batch-size", "4", *flags)
    seen = [h["safepad/sequences_per_batch"] for h in log["log_history"] if "safepad/sequences_per_batch" in h]
    # a step of 4 rows with the boundaries lost holds 4 + 1 sequences (the rows and the collator's pad tail)
    # (measured: 5 and 5 with remove_unused_columns=True, 7 and 9 with the boundaries kept)
    assert len(seen) == 2 and all(n > 4 + 1 for n in seen), seen
    assert all(math.isfinite(h["loss"]) for h in log["log_history"] if "loss" in h)


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    """2 processes x 2 packed rows (DDP, gloo) give the same per-step losses as 1 process x 4 rows.

    Why the two runs see the same data: accelerate seeds the RandomSampler identically in both runs and
    shards the permutation by batches (rank r takes batch 2k + r at step k), so at every step the two ranks
    hold exactly the 4 packed rows that the single process holds. The collator concatenates a process's
    rows into one ``[1, T]`` row, so the rows are laid out differently (2 rows per process vs 4), and the
    per-step loss is the same only if (a) no state crosses a sequence boundary (safepad.wrap: the loss of
    each document does not depend on its neighbours) and (b) the Trainer normalises by the number of label
    tokens gathered over both ranks (``average_tokens_across_devices``, on by default) so that the DDP
    gradient average equals the single-process gradient. Steps after the first also check that the
    all-reduced gradients and the optimizer updates agree.

    Tolerance ``rtol=5e-6``: the runs differ only in float32 summation order (two partial sums plus a gloo
    all-reduce vs one sum over ~500 label tokens per step; SSD chunk boundaries at other offsets), measured
    at ~1e-7 relative over 4 steps. Failure modes sit well above it. Measured on these exact runs with the
    model left unwrapped and only the restarting ``position_ids`` kept (the state leaks across documents,
    as in stock transformers), the two runs differ by 1.7e-4 relative at step 1 and 2.5e-3 at steps 2-4.
    With ``average_tokens_across_devices=False`` (DDP averages per-rank means) they differ by 3e-5 to 9e-5
    at steps 2-4, and more when the ranks hold more unequal token counts.
    """
    steps = ("--max-steps", "4")
    single = train_packed(tmp_path / "one", *steps, "--batch-size", "4", *SMALL)
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
    ]  # fmt: skip
    # an empty HF_HOME: no accelerate default_config.yaml of the machine (FSDP, fp16, ...) can change the launch
    hf_home = tmp_path / "hf_home"
    hf_home.mkdir()
    multi = train_packed(
        tmp_path / "two", *steps, "--batch-size", "2", *SMALL,
        launcher=launcher, timeout=150.0, env={"HF_HOME": str(hf_home)},
    )  # fmt: skip
    assert multi["world_size"] == 2 and single["world_size"] == 1
    assert multi["steps"] == single["steps"] == 4
    # all-reduced over both ranks: equal only if both ranks trained on their half of every global batch
    assert multi["real_tokens"] == single["real_tokens"]
    one = [h["loss"] for h in single["log_history"] if "loss" in h]
    two = [h["loss"] for h in multi["log_history"] if "loss" in h]
    assert len(one) == len(two) == 4
    assert one[-1] < one[0]  # it trained
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert b == pytest.approx(a, rel=5e-6, abs=0), f"step {step}: 1 process {a!r} vs 2 processes {b!r}"


# accelerate 1.15 (accelerate/state.py, AcceleratorState.__init__) turns a launch into DistributedType.FSDP only
# inside its branch for MULTI_GPU / MULTI_XPU / MULTI_NPU / MULTI_MLU / MULTI_SDAA / MULTI_MUSA / MULTI_HPU /
# MULTI_NEURON; a CPU launch (TrainingArguments(use_cpu=True), gloo) is MULTI_CPU and never reaches it.
ACCELERATE_FSDP_ON_CPU = (
    "accelerate cannot run FSDP on CPU: AcceleratorState (accelerate/state.py) selects DistributedType.FSDP only "
    "for MULTI_GPU/XPU/NPU/MLU/SDAA/MUSA/HPU/NEURON; a CPU launch is MULTI_CPU. Measured with accelerate 1.15.0 "
    "here: `accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 ... examples/train_packed.py` ran as "
    "MULTI_CPU with no FSDP unit and no sharded parameter, i.e. plain DDP over gloo. FSDP2 itself runs on CPU: "
    "test_fsdp2_block_sharding_matches_one_process checks it with torch's fully_shard; this accelerate run is "
    "benchmarks/gpu_check/fsdp2.py::check_fsdp2_accelerate on a GPU machine"
)
FSDP2_FLAGS = (
    "--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap", "NemotronHBlock", "--fsdp_reshard_after_forward", "true",
    "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
)  # fmt: skip


@pytest.mark.slow
def test_fsdp2_through_accelerate_matches_one_process(tmp_path):
    """The docs' FSDP2 recipe (block-level units) through accelerate + Trainer: same losses as one process.

    Needs an accelerator (see ACCELERATE_FSDP_ON_CPU); with one GPU the FSDP2 world has one rank, with more, two.
    """
    import torch

    if not torch.cuda.is_available():
        pytest.skip(ACCELERATE_FSDP_ON_CPU)
    nproc = min(2, torch.cuda.device_count())
    steps = ("--max-steps", "4", "--device", "auto")
    hf_home = tmp_path / "hf_home"
    hf_home.mkdir()
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch", *FSDP2_FLAGS,
        "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
    ]  # fmt: skip
    multi = train_packed(
        tmp_path / "fsdp", *steps, "--batch-size", str(4 // nproc), *SMALL,
        launcher=launcher, timeout=300.0, env={"HF_HOME": str(hf_home)},
    )  # fmt: skip
    assert multi["distributed_type"] == "FSDP" and multi["fsdp_version"] == 2, multi["distributed_type"]
    assert "NemotronHBlock" in multi["fsdp_units"] and multi["sharded_params"] > 0
    assert multi["wrapped_mixers"] == 2  # sharding kept safepad's mixers
    single = train_packed(tmp_path / "one", *steps, "--batch-size", "4", *SMALL, timeout=300.0)
    one = [h["loss"] for h in single["log_history"] if "loss" in h]
    two = [h["loss"] for h in multi["log_history"] if "loss" in h]
    assert len(one) == len(two) == 4 and one[-1] < one[0]
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert b == pytest.approx(a, rel=5e-6, abs=0), f"step {step}: 1 process {a!r} vs FSDP2 {b!r}"


def _fsdp2_driver(out, *flags, nproc=None):
    driver = [sys.executable, str(Path(__file__).with_name("fsdp2_driver.py"))]
    if nproc is not None:
        driver[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                       "--master_addr", "127.0.0.1", "--master_port", str(free_port())]  # fmt: skip
    run_script([*driver, "--out", str(out), *flags], timeout=150.0)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_fsdp2_block_sharding_matches_one_process(tmp_path):
    """FSDP2 (torch fully_shard over gloo, each NemotronHBlock a unit, then the root) on the wrapped Nemotron-H:
    2 processes x 2 packed rows give the per-step losses of 1 process x 4 rows (tests/examples/fsdp2_driver.py
    reproduces Trainer's step: global label count, gradients averaged over ranks, Adam).

    Tolerance: the DDP test's ``rtol=5e-6`` (float32 summation order; measured 1.1e-7 at step 4, 0 before).
    Measured on these runs with the model left unwrapped (position_ids only, the state leaks across
    documents): 2.7e-4 relative at step 1, 5.1e-3 to 5.6e-3 at steps 2-4.
    """
    single = _fsdp2_driver(tmp_path / "one.json")
    multi = _fsdp2_driver(tmp_path / "two.json", nproc=2)
    assert single["world_size"] == 1 and multi["world_size"] == 2
    assert multi["fsdp_units"] == ["NemotronHBlock", "NemotronHForCausalLM"] and multi["sharded_params"] > 0
    assert multi["wrapped_mixers"] == single["wrapped_mixers"] == 2
    one, two = single["losses"], multi["losses"]
    assert len(one) == len(two) == 4 and one[-1] < one[0]
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert b == pytest.approx(a, rel=5e-6, abs=0), f"step {step}: 1 process {a!r} vs FSDP2 {b!r}"
