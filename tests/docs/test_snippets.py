"""Every fenced ``python`` block of README.md, every docs/*.md page and collators/README.md runs as printed, so the
docs cannot rot.

The blocks of one page run in order in one namespace, as a reader runs them in one session: every name a block
uses is defined by it or by a visible block above it on the same page (a "# given" line there says so). Nothing
is injected and no argument is changed. The only substitutions replace downloads (the tests run offline):

* ``AutoModelForCausalLM.from_pretrained(anything)`` returns a tiny Nemotron-H;
* TRL's tokenizer lookup (``AutoProcessor.from_pretrained``) returns a tiny word-level tokenizer.

So a recipe that sets what a CPU cannot run (``bf16=True``, TRL's default) fails here, as it would for a reader.
A block that cannot run on CPU without downloads or several processes is marked in the markdown with
``<!-- snippet: skip REASON -->`` on the line before its fence, and is reported as skipped with that reason;
the page's later blocks must not need what it defines.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

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


PAGES = [pytest.param(rel, id=rel) for rel in DOCS if _blocks(rel)]


def test_the_quick_starts_have_snippets():
    """README's quick starts, the training and inference pages and the collator README each hold executed code."""
    assert {"README.md", "docs/training.md", "docs/inference.md", "collators/README.md"} <= {p.values[0] for p in PAGES}


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


@pytest.mark.parametrize("rel", PAGES)
def test_page_runs_as_printed(rel, tmp_path, monkeypatch):
    """The page's blocks, in order, in one namespace; only the downloads are replaced (see the module docstring)."""
    # Resolve the lazy names first: that can put another module object into sys.modules["transformers"], and
    # `from transformers import ...` in a snippet reads whatever sys.modules holds, so patch that one.
    importlib.import_module("transformers").AutoModelForCausalLM  # noqa: B018
    transformers = sys.modules["transformers"]
    sft = importlib.import_module("trl.trainer.sft_trainer")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(lambda *a, **k: _tiny_lm()))
    monkeypatch.setattr(sft.AutoProcessor, "from_pretrained", staticmethod(lambda *a, **k: _tokenizer()))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    ran, skipped = 0, []
    for line, code, skip in _blocks(rel):
        if skip is not None:
            skipped.append(f"{rel}:{line}: {skip}")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the guard snippet warns on purpose
            try:
                exec(compile(code, f"{rel}:{line}", "exec"), namespace)  # noqa: S102
            except Exception as e:
                raise AssertionError(f"{rel}:{line} does not run as printed: {type(e).__name__}: {e}") from e
        ran += 1
        trainer = namespace.get("trainer")
        if trainer is not None and "trainer.train()" in code:
            assert trainer.state.global_step >= 1, f"{rel}:{line}: trainer.train() took no step"
    if not ran:
        pytest.skip("; ".join(skipped))


_MODEL_CLASS = re.compile(r"`(\w+(?:ForCausalLM|ForConditionalGeneration|_Reasoning_V3))`")


def test_model_class_names_in_the_docs_exist():
    """Class names the prose gives (e.g. the Nemotron-H Omni class) must exist in the installed transformers."""
    import transformers

    names = {m for rel in DOCS for m in _MODEL_CLASS.findall((ROOT / rel).read_text(encoding="utf-8"))}
    assert "NemotronH_Omni_Reasoning_V3" in names
    assert [n for n in sorted(names) if not hasattr(transformers, n)] == []


_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_MD_NAME = re.compile(r"`([\w./-]+\.md)`")


def test_docs_point_only_to_files_in_the_repository():
    """Every relative link target and every backticked ``*.md`` name exists in the repository (main pointed
    training.md at a ``stock-transformers-5.23.md`` that is not there)."""
    missing = []
    for rel in DOCS:
        page = ROOT / rel
        text = page.read_text(encoding="utf-8")
        for target in _LINK.findall(text):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                missing.append(f"{rel}: link {target}")
        for name in _MD_NAME.findall(text):
            if not any(p.exists() for p in (page.parent / name, ROOT / name, ROOT / "docs" / name)):
                missing.append(f"{rel}: `{name}`")
    assert missing == []
