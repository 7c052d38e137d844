"""docs/compile.md's ``SFTTrainer`` recipe (safepad's packing, ``skip_prepare_dataset``, fixed-length rows)
compiles once for its whole run (3 epochs) with the installed TRL and TRL's default gradient checkpointing.

The recipe block is executed as printed except two stated changes: 48-token rows instead of 4096 (``L = 4096`` ->
``L = 64``, so that ragged documents fill several rows on CPU) and dynamo's ``eager`` backend instead of inductor
(``torch.compile`` is patched to pass ``backend="eager"``): dynamo decides on guards and recompiles before any
backend sees a graph, so the compiled-frame count (``torch._dynamo.utils.counters["frames"]["ok"]``, read after
every training step) is the same. On main the count grew at step 2: safepad swapped TRL-default gradient
checkpointing's function inside the trace, which failed the graph's guard on it.
"""

from __future__ import annotations

import copy
import importlib
import re
import sys
from pathlib import Path

import datasets
import pytest
import torch
from torch._dynamo.utils import counters

import safepad
from safepad.testing.tiny import tiny_model

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
ROW = 48


def _recipe() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "compile.md").read_text(encoding="utf-8"), re.DOTALL)
    found = [b for b in blocks if "SFTTrainer(" in b and "torch_compile=True" in b]
    assert len(found) == 1, "docs/compile.md must hold one SFTTrainer torch_compile recipe"
    assert found[0].count("L = 4096") == 1, "the recipe's row length changed: update this test's substitution"
    return found[0].replace("L = 4096", f"L = {ROW}")


def _tokenizer():
    sys.path.insert(0, str(ROOT / "tests" / "docs"))
    try:
        from test_snippets import _tokenizer as make
    finally:
        sys.path.pop(0)
    return make()


@pytest.fixture
def setup(monkeypatch, tmp_path):
    """Ragged documents, a frame counter after every step, the eager backend, TRL's tokenizer lookup offline."""
    import transformers

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (12,), generator=g)]
    frames: list[int] = []
    step = transformers.Trainer.training_step

    def counted(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        frames.append(counters["frames"]["ok"])
        return out

    compile_ = torch.compile

    def eager_compile(*args, **kwargs):
        kwargs["backend"] = "eager"
        kwargs.pop("mode", None)
        return compile_(*args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "training_step", counted)
    monkeypatch.setattr(torch, "compile", eager_compile)
    sft = importlib.import_module("trl.trainer.sft_trainer")
    monkeypatch.setattr(sft.AutoProcessor, "from_pretrained", staticmethod(lambda *a, **k: _tokenizer()))
    monkeypatch.chdir(tmp_path)
    return datasets.Dataset.from_dict({"input_ids": docs}), frames


@pytest.fixture(scope="module")
def stock():
    return tiny_model("nemotron_h")


def test_docs_sft_recipe_compiles_once_per_epoch(setup, stock):
    tokenized, frames = setup
    namespace = {"model": safepad.wrap(copy.deepcopy(stock)), "tokenized": tokenized, "torch": torch}
    exec(compile(_recipe(), "docs/compile.md:SFTTrainer", "exec"), namespace)  # noqa: S102
    trainer, packed = namespace["trainer"], namespace["packed"]
    assert trainer.args.gradient_checkpointing, "TRL's default changed: the recipe no longer checks checkpointing"
    assert len(frames) == len(packed) * int(trainer.args.num_train_epochs) and len(packed) > 2, frames
    assert frames[0] > 0 and frames[-1] == frames[0], f"recompiled: compiled frames after each step {frames}"

