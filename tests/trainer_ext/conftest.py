"""Fixtures for the Trainer integration tests: a tiny Nemotron-H, a word-level tokenizer, tiny datasets."""

from __future__ import annotations

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM, TrainingArguments


def make_model(seed: int = 0, strong: bool = False) -> NemotronHForCausalLM:
    """Nemotron-H, hidden 64 / vocab 256, mamba-attention-mamba-mlp, fp32."""
    cfg = NemotronHConfig(
        vocab_size=256, hidden_size=64, layers_block_type=["mamba", "attention", "mamba", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
        pad_token_id=0, bos_token_id=None, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg)
    if strong:  # mixers visible next to the residual stream
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mixer." in name and p.dim() >= 2 and ("proj" in name or "conv1d" in name):
                    p.normal_(0.0, 0.5 if "conv1d" in name else 0.3)
    return model


def make_tokenizer(padding_side: str = "right"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, 256)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    tok.padding_side = padding_side
    return tok


def make_examples(n: int = 8, lengths: tuple[int, ...] = (5, 8, 3, 7), seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 256, (lengths[i % len(lengths)],), generator=g).tolist()} for i in range(n)]


def training_args(tmp_path, **kw) -> TrainingArguments:
    base = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2,
        "max_steps": 3, "logging_steps": 1, "report_to": [], "save_strategy": "no", "use_cpu": True,
        "disable_tqdm": True, "learning_rate": 1e-3, "dataloader_num_workers": 0,
    }  # fmt: skip
    base.update(kw)
    return TrainingArguments(**base)


@pytest.fixture
def tokenizer():
    return make_tokenizer()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and 2 threads per xdist worker on 2 cores thrash."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
