"""Every fenced ``python`` block of README.md, every docs/*.md page and collators/README.md runs, so the docs cannot rot.

Each block runs in a fresh namespace with the names the prose assumes (``model``, ``tokenized``, ``ds``, ``args``,
``input_ids``, ``mask``, ...) bound to tiny offline objects, and with these substitutions (nothing else changes):

* ``AutoModelForCausalLM.from_pretrained(anything)`` returns a tiny Nemotron-H (no download);
* ``TrainingArguments`` / ``SFTConfig`` keep every argument the snippet gives but run 1 step on CPU in a temporary
  ``output_dir`` without saving, reporting or bf16 (a ``...`` placeholder argument is ignored);
* TRL's tokenizer lookup (``AutoProcessor.from_pretrained``) returns a tiny word-level tokenizer.

A block that cannot run on CPU without downloads is marked in the markdown with ``<!-- snippet: skip REASON -->``
on the line before its fence, and is reported as skipped with that reason.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from pathlib import Path

import datasets
import pytest
import torch

from safepad.collators import pack_dataset

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "collators/README.md")
_SKIP = re.compile(r"<!--\s*snippet:\s*skip\s*(.*?)\s*-->")


def _blocks(rel: str | Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip_reason)`` of every fenced python block of ``rel`` (relative to the repository root)."""
    lines = (ROOT / rel).read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            skip = _SKIP.search(lines[j]) if j >= 0 else None
            end = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == "```")
            out.append((i + 1, "\n".join(lines[i + 1 : end]), skip.group(1) or "marked skip" if skip else None))
            i = end
        i += 1
    return out


SNIPPETS = [
    pytest.param(rel, line, code, skip, id=f"{rel}:{line}") for rel in DOCS for line, code, skip in _blocks(rel)
]


def test_the_quick_starts_have_snippets():
    """README's quick starts, the training and inference pages and the collator README each hold executed code."""
    assert {"README.md", "docs/training.md", "docs/inference.md", "collators/README.md"} <= {p.values[0] for p in SNIPPETS}


def test_skip_marker(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("<!-- snippet: skip needs a GPU -->\n```python\nimport cuda_thing\n```\n\n```python\nx = 1\n```\n")
    assert _blocks(md) == [(2, "import cuda_thing", "needs a GPU"), (6, "x = 1", None)]


def _tiny_lm():
    from safepad.testing.tiny import tiny_model

    return tiny_model("nemotron_h")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, 256)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def _cpu_args(cls, tmp_path):
    def make(*args, **kwargs):
        args = [a for a in args if a is not Ellipsis]
        if args:
            kwargs.setdefault("output_dir", args.pop(0))
        if args:
            raise TypeError(f"{cls.__name__}: unexpected positional arguments {args}")
        kwargs.update(output_dir=str(tmp_path / "out"), max_steps=1, use_cpu=True, report_to=[], save_strategy="no",
                      bf16=False, fp16=False, disable_tqdm=True, dataloader_num_workers=0, logging_steps=1)  # fmt: skip
        return cls(**kwargs)

    return make


def _namespace() -> dict:
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4, 8, 6)]
    ids = torch.randint(3, 250, (2, 6), generator=g)
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    nxt = torch.randint(3, 250, (2, 3), generator=g)
    return {
        "model": _tiny_lm(),
        "tokenized": datasets.Dataset.from_dict({"input_ids": docs}),
        "packed": pack_dataset(datasets.Dataset.from_dict({"input_ids": docs}), max_length=32),
        "ds": datasets.Dataset.from_dict({"input_ids": docs}),
        "input_ids": ids.masked_fill(left == 0, 0),
        "mask": left,
        "next_chunk": nxt,
        "mask2": torch.cat([left, torch.ones_like(nxt)], 1),
        "batch": {"input_ids": ids.masked_fill(left == 0, 0), "attention_mask": left, "max_new_tokens": 3},
        "right_padded_mask": right,
    }


@pytest.mark.parametrize("rel, line, code, skip", SNIPPETS)
def test_snippet_runs(rel, line, code, skip, tmp_path, monkeypatch):
    if skip is not None:
        pytest.skip(f"{rel}:{line}: {skip}")
    # Resolve the lazy names first: that can put another module object into sys.modules["transformers"], and
    # `from transformers import ...` in a snippet reads whatever sys.modules holds, so patch that one.
    lazy = {
        "transformers": ("Trainer", "TrainingArguments", "AutoModelForCausalLM"),
        "trl": ("SFTTrainer", "SFTConfig"),
    }
    for name, attrs in lazy.items():
        for attr in attrs:
            getattr(importlib.import_module(name), attr)
    transformers, trl = sys.modules["transformers"], sys.modules["trl"]
    sft = importlib.import_module("trl.trainer.sft_trainer")
    import safepad

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(lambda *a, **k: _tiny_lm()))
    monkeypatch.setattr(transformers, "TrainingArguments", _cpu_args(transformers.TrainingArguments, tmp_path))
    monkeypatch.setattr(trl, "SFTConfig", _cpu_args(trl.SFTConfig, tmp_path))
    monkeypatch.setattr(sft.AutoProcessor, "from_pretrained", staticmethod(lambda *a, **k: _tokenizer()))
    monkeypatch.chdir(tmp_path)
    namespace = _namespace()
    # what the prose around a block has imported or built already
    namespace.update(
        safepad=safepad,
        Trainer=transformers.Trainer,
        TrainingArguments=transformers.TrainingArguments,
        AutoModelForCausalLM=transformers.AutoModelForCausalLM,
        args=transformers.TrainingArguments(output_dir="out"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the guard snippet warns on purpose
        exec(compile(code, f"{rel}:{line}", "exec"), namespace)  # noqa: S102
    trainer = namespace.get("trainer")
    if trainer is not None and "trainer.train()" in code:
        assert trainer.state.global_step == 1


_MODEL_CLASS = re.compile(r"`(\w+(?:ForCausalLM|ForConditionalGeneration|_Reasoning_V3))`")


def test_model_class_names_in_the_docs_exist():
    """Class names the prose gives (e.g. the Nemotron-H Omni class) must exist in the installed transformers."""
    import transformers

    names = {m for rel in DOCS for m in _MODEL_CLASS.findall((ROOT / rel).read_text(encoding="utf-8"))}
    assert "NemotronH_Omni_Reasoning_V3" in names
    assert [n for n in sorted(names) if not hasattr(transformers, n)] == []
