"""Real text that is on every machine, and a byte-level tokenizer: shared by the safepad examples.

Nothing is downloaded. The text is the docstrings of the Python standard library's own sources (the
``.py`` files under ``sysconfig.get_paths()["stdlib"]``): English prose with code, a few thousand
documents whose lengths are heavy-tailed (median ~150 bytes, some several KB), the kind of length mix
where padding wastes most of a batch.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "OFFSET",
    "PAD_ID",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "stdlib_docstrings",
]

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
OFFSET = 3  # byte b -> id b + OFFSET
VOCAB_SIZE = 256 + OFFSET


class ByteTokenizer:
    """UTF-8 bytes -> ids ``b + 3``; ids 0 / 1 / 2 are pad / bos / eos. No training, no files."""

    pad_token_id, bos_token_id, eos_token_id = PAD_ID, BOS_ID, EOS_ID
    vocab_size = VOCAB_SIZE
    padding_side = "right"

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = [b + OFFSET for b in text.encode("utf-8")]
        return ([BOS_ID] if add_bos else []) + ids + ([EOS_ID] if add_eos else [])

    def decode(self, ids) -> str:
        data = bytes(int(i) - OFFSET for i in ids if int(i) >= OFFSET)
        return data.decode("utf-8", errors="replace")


def stdlib_docstrings(max_docs: int = 3000, min_chars: int = 16, max_chars: int = 6000) -> list[str]:
    """Module, class and function docstrings of the stdlib's top-level ``.py`` files, in a fixed order.

    Files are read in sorted order and docstrings in source order, so the list is deterministic for a
    given Python installation. Docstrings shorter than ``min_chars`` are skipped, longer ones are cut to
    ``max_chars`` characters.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    docs.append(doc[:max_chars])
                    if len(docs) >= max_docs:
                        return docs
    if not docs:
        raise RuntimeError(f"no docstrings found under {root}; is the Python standard library installed?")
    return docs
