"""The entry point's contract in one process (a gloo group of 1): what it refuses, and how.

Every refusal is a ``ValueError`` (``UnsupportedSequenceParallelError`` for the model-level ones) raised
before anything trains on zero-restarted states.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import safepad
from safepad.distributed import SequenceParallel, UnsupportedSequenceParallelError, sequence_parallel
from safepad.testing.tiny import tiny_model

from .sp_worker import PACKED, _batch


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(UnsupportedSequenceParallelError, match="torch.distributed initialised"):
        sequence_parallel(safepad.wrap(tiny_model("mamba2")))


def test_unwrapped_model_raises(group):
    with pytest.raises(UnsupportedSequenceParallelError, match=r"safepad.wrap\(model\) first"):
        sequence_parallel(tiny_model("nemotron_h"))


def test_unsupported_mixer_kind_raises(group):
    model = safepad.wrap(tiny_model("mamba2"))
    mixer = model.backbone.layers[0].mixer
    mixer._safepad_spec = dataclasses.replace(mixer._safepad_spec, kind="rwkv7")
    with pytest.raises(UnsupportedSequenceParallelError, match=r"mixer kind\(s\) \['rwkv7'\]"):
        sequence_parallel(model)


def test_op_without_exchange_raises():
    from safepad.parallel.ops import sp_op
    from safepad.ops.conv import causal_conv1d_step

    with pytest.raises(ValueError, match="no rank exchange"):
        sp_op(causal_conv1d_step, object())


@pytest.mark.parametrize(
    "what",
    [pytest.param("sliding", id="sliding"), pytest.param("router", id="router"),
     pytest.param("indexed", id="qwen4_exp_text-indexed-no-ple")],
)
def test_unsupported_configs_raise(group, what):
    if what == "indexed":  # without PLE layers only the indexed attention is left to refuse (it crashed in the call)
        model = safepad.wrap(tiny_model("qwen4_exp_text", ple_layer_ids=[]))
        with pytest.raises(UnsupportedSequenceParallelError, match="indexed"):
            sequence_parallel(model)
        return
    model = safepad.wrap(tiny_model("qwen3_next"))
    if what == "sliding":
        model.config.layer_types = ["linear_attention", "sliding_attention"]
        match = "only full causal attention"
    else:
        model.config.output_router_logits = True
        match = "router auxiliary loss"
    with pytest.raises(UnsupportedSequenceParallelError, match=match):
        sequence_parallel(model)


def test_attention_that_bypasses_the_interface_raises(group):
    model = safepad.wrap(tiny_model("nemotron_h"))
    sp = sequence_parallel(model)
    try:
        model.config._attn_implementation = "sdpa"  # attention no longer goes through the SP function
        ids, pos, _, labels = _batch(PACKED, model.config.vocab_size, seed=1)
        with pytest.raises(UnsupportedSequenceParallelError, match="ran without the sequence-parallel attention"):
            model(input_ids=ids, position_ids=pos, labels=labels)
    finally:
        sp.remove()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("padding", id="padding-mask"),
        pytest.param("cache", id="use_cache"),
        pytest.param("odd_length", id="length-not-divisible"),
        pytest.param("short", id="shard-shorter-than-halo"),
        pytest.param("unknown_column", id="unknown-per-token-kwarg"),
        pytest.param("tuple_output", id="return_dict-False"),
        pytest.param("short_labels", id="labels-wrong-length"),
        pytest.param("shard_positions", id="position_ids-of-a-shard"),
        pytest.param("bad_seq_idx", id="seq_idx-decreasing"),
        pytest.param("disagree", id="seq_idx-and-position_ids-disagree"),
    ],
)
def test_bad_calls_raise(group, bad):
    model = safepad.wrap(tiny_model("nemotron_h"))
    sp = sequence_parallel(model)
    try:
        ids, pos, _, labels = _batch(PACKED, model.config.vocab_size, seed=1)
        kw = {"input_ids": ids, "position_ids": pos, "labels": labels}
        if bad == "padding":
            mask = torch.ones_like(ids)
            mask[0, -3:] = 0
            kw = {"input_ids": ids, "attention_mask": mask}
            match = "padding masks"
        elif bad == "cache":
            kw = {"input_ids": ids, "use_cache": True}
            match = "use_cache=False"
        elif bad == "odd_length":
            sp.world = 5  # as if the group had 5 ranks: 96 tokens do not split
            sp.check_batch = False  # the agreement all-gather needs a real group of 5
            match = "multiple of 5"
        elif bad == "short":
            kw = {"input_ids": ids[:, :2]}
            match = "halo of 3"
        elif bad == "unknown_column":
            kw["token_weights"] = torch.ones(ids.shape)
            match = "token_weights"
        elif bad == "tuple_output":
            kw["return_dict"] = False
            match = "return_dict=True"
        elif bad == "short_labels":
            kw["labels"] = labels[:, :-1]
            match = "labels must have the full rows"
        elif bad == "shard_positions":
            kw["position_ids"] = pos[:, :48]
            match = "position_ids must cover the full rows"
        elif bad == "bad_seq_idx":
            kw = {"input_ids": ids, "seq_idx": torch.arange(96, 0, -1).expand(2, 96).int()}
            match = "seq_idx decreases"
        else:
            seq = torch.zeros(2, 96, dtype=torch.int32)
            seq[:, 50:] = 1  # a boundary at 50, while position_ids restart elsewhere
            kw["seq_idx"] = seq
            match = "disagree"
        with pytest.raises(ValueError, match=match):
            model(**kw)
    finally:
        sp.world = 1
        sp.remove()


def test_one_rank_equals_unsharded_and_remove_restores(group):
    ref = safepad.wrap(tiny_model("nemotron_h"))
    model = safepad.wrap(tiny_model("nemotron_h"))
    impl = model.config._attn_implementation
    ids, pos, _, labels = _batch(PACKED, ref.config.vocab_size, seed=1)
    out_ref = ref(input_ids=ids, position_ids=pos, labels=labels)
    sp = sequence_parallel(model)
    assert isinstance(sp, SequenceParallel)
    out = model(input_ids=ids, position_ids=pos, labels=labels)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    sp.remove()
    assert model.config._attn_implementation == impl
    again = model(input_ids=ids, position_ids=pos, labels=labels)  # plain wrapped model again
    torch.testing.assert_close(again.loss, out_ref.loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("both", id="group-and-sp_size"),
        pytest.param("sp_size", id="sp_size-not-dividing"),
        pytest.param("prepared", id="after-train"),
        pytest.param("n_gpu", id="DataParallel"),
        pytest.param("cp_size", id="ParallelismConfig-cp"),
    ],
)
def test_prepare_trainer_refusals(group, bad):
    import types

    from safepad.distributed import prepare_trainer

    model = safepad.wrap(tiny_model("mamba2"))
    trainer = types.SimpleNamespace(model=model, model_wrapped=model, args=types.SimpleNamespace(n_gpu=1),
                                    accelerator=types.SimpleNamespace(parallelism_config=None))
    hooks = len(model._forward_pre_hooks)  # safepad.wrap's own
    kw: dict = {}
    if bad == "both":
        kw, match = {"group": group, "sp_size": 1}, "either group= or sp_size="
    elif bad == "sp_size":
        kw, match = {"sp_size": 3}, "must divide the world size 1"
    elif bad == "prepared":
        trainer.model_wrapped, match = torch.nn.Module(), r"before trainer.train\(\)"
    elif bad == "n_gpu":
        trainer.args.n_gpu, match = 2, "one device per process"
    else:
        trainer.accelerator.parallelism_config = types.SimpleNamespace(cp_size=2, sp_size=1, tp_size=1)
        match = "shard the sequence a second time"
    with pytest.raises(ValueError, match=match):
        prepare_trainer(trainer, **kw)
    assert len(model._forward_pre_hooks) == hooks and model.config._attn_implementation != "safepad_sp"


@pytest.mark.parametrize("op", ["conv", "ssd", "delta", "selective"])
def test_sp_ops_validate_like_the_ops(op):
    """The sequence-parallel ops take the single-device op's own arguments and raise its own errors, before any
    exchange (no process group needed): a wrong shape, an unknown argument, and a refused initial state."""
    from safepad.parallel import ops as spo

    x4 = torch.randn(1, 8, 2, 4)
    calls = {
        "conv": (spo.sp_causal_conv1d, (torch.randn(1, 8), torch.randn(3, 4)), {},
                 r"x must have shape \[batch, seqlen, dim\]", torch.zeros(1, 3, 3)),
        "ssd": (spo.sp_ssd_scan, (x4[..., 0], torch.randn(1, 8, 2), -torch.ones(2), torch.randn(1, 8, 1, 4),
                                  torch.randn(1, 8, 1, 4)), {}, r"x must have shape \[batch, seqlen, H, P\]",
                torch.zeros(1, 2, 4, 4)),
        "delta": (spo.sp_chunk_gated_delta_rule, (x4, x4, x4, torch.randn(1, 8, 2), torch.rand(1, 7, 2)), {},
                  "beta", torch.zeros(1, 2, 4, 4)),
        "selective": (spo.sp_selective_scan, (torch.randn(1, 8), torch.randn(1, 8, 4), -torch.ones(4, 3),
                                              torch.randn(1, 8, 3), torch.randn(1, 8, 3)), {},
                      "u must be a tensor of shape", torch.zeros(1, 4, 3)),
    }
    fn, args, kw, match, state = calls[op]
    with pytest.raises(ValueError, match=match):
        fn(*args, sp=object(), **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunk_sise'"):
        fn(*args, sp=object(), chunk_sise=4)
    with pytest.raises(ValueError, match="does not take initial_state"):
        fn(*args, sp=object(), initial_state=state)


def _word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def test_prepare_trainer_refuses_trl_sft_trainer(group, tmp_path):
    """TRL's SFTTrainer computes its loss in a fused LM head from the full rows' labels, which the SP hook replaces by
    the shard's: it crashed at ``labels[:, 1:]`` at step 1. prepare_trainer refuses it, and so does a direct
    ``fused_lm_head=True`` call of a sequence-parallel model; nothing is left hooked."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from safepad.distributed import prepare_trainer

    model = safepad.wrap(tiny_model("nemotron_h"))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in (40, 30, 26)]
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, padding_free=True, max_length=None, dataset_num_proc=None, bf16=False,
        pad_to_multiple_of=32,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=_word_tokenizer(vocab))
    hooks = len(model._forward_pre_hooks)
    with pytest.raises(UnsupportedSequenceParallelError, match="does not support TRL's SFTTrainer"):
        prepare_trainer(trainer, sp_size=1)
    assert len(model._forward_pre_hooks) == hooks and model.config._attn_implementation != "safepad_sp"
    sp = sequence_parallel(model)  # TRL's patched forward under the SP hooks directly
    try:
        ids, pos, _, labels = _batch(PACKED, vocab, seed=1)
        with pytest.raises(UnsupportedSequenceParallelError, match="fused_lm_head=True"):
            model(input_ids=ids, position_ids=pos, labels=labels, fused_lm_head=True)
    finally:
        sp.remove()
