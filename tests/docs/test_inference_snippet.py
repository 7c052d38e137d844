"""README's inference quick start, executed as written and with ``position_ids`` added, on a RoPE hybrid
(qwen3_next, lfm2), a Mamba2 hybrid (nemotron_h) and a sliding-window family (lfm3, window 6): the chunked call's
logits and the generated tokens of every row (right-padded, left-padded, unpadded in one batch) equal that row run
alone through the stock model without a cache (greedy, the whole sequence re-run at every step), which is what the
README says they equal. (Stock's own cached ``generate`` is not that reference: its decode skips the dt limit.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from safepad.testing.tiny import family_available, tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _inference_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.DOTALL)
    found = [b for b in blocks if "next_chunk" in b and "generate" in b]
    assert len(found) == 1, "README.md must hold one inference quick start (chunked prefill + generate)"
    return found[0]


def _with_position_ids(code: str) -> str:
    out = code.replace("attention_mask=mask, use_cache", "attention_mask=mask, position_ids=pos, use_cache")
    out = out.replace("attention_mask=mask2, past_key_values", "attention_mask=mask2, position_ids=pos2, past_key_values")
    assert out.count("position_ids=pos") == 2, "the quick start's calls changed: update this test's substitution"
    return out


FAMILIES = [
    pytest.param("qwen3_next", {}, id="rope_hybrid-qwen3_next"),
    pytest.param("lfm2", {}, id="rope_hybrid-lfm2"),
    pytest.param("nemotron_h", {}, id="mamba2_hybrid-nemotron_h"),
    pytest.param("lfm3", {"sliding_window": 6}, id="sliding_window-lfm3"),
]


@pytest.mark.parametrize("positions", [pytest.param(False, id="as-written"), pytest.param(True, id="with-position_ids")])
@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_readme_inference_quick_start_matches_each_row_alone(family, overrides, positions):
    ok, why = family_available(family)
    if not ok:
        pytest.skip(why)
    import safepad

    stock = tiny_model(family, **overrides)
    model = tiny_model(family, **overrides)
    pad = int(getattr(stock.config, "pad_token_id", None) or 0)
    for m in (stock, model):
        m.generation_config.pad_token_id = pad
    g = torch.Generator().manual_seed(1)
    vocab = stock.config.vocab_size
    ids = torch.randint(3, vocab, (3, 6), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    ids = ids.masked_fill(mask == 0, pad)
    nxt = torch.randint(3, vocab, (3, 3), generator=g)
    mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
    namespace = {
        "safepad": safepad, "model": model, "input_ids": ids, "mask": mask, "next_chunk": nxt, "mask2": mask2,
        "pos": (mask.cumsum(1) - 1).clamp(min=0), "pos2": (mask2.cumsum(1) - 1)[:, -3:],
        "batch": {"input_ids": ids, "attention_mask": mask, "do_sample": False},
    }
    code = _inference_block()
    exec(compile(_with_position_ids(code) if positions else code, "README.md:inference", "exec"), namespace)  # noqa: S102
    out, tokens = namespace["out"], namespace["tokens"]
    new = int(re.search(r"generate\(\*\*batch, max_new_tokens=(\d+)\)", code).group(1))
    for b in range(3):
        row = torch.cat([ids[b][mask[b].bool()], nxt[b]])[None]
        with torch.no_grad():
            ref = stock(row).logits[0, -3:]
        err = (out.logits[b] - ref).abs().max().item()
        assert err < 1e-4, f"row {b} (mask {mask[b].tolist()}): chunked-prefill logits off by {err:.3g}"
        alone = ids[b][mask[b].bool()][None]
        with torch.no_grad():
            for _ in range(new):  # greedy, cache-free: the whole sequence through stock at every step
                alone = torch.cat([alone, stock(alone, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert tokens[b, -new:].tolist() == alone[0, -new:].tolist(), f"row {b}: generate differs from the row alone"
