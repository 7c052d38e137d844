"""A pickled / torch.save'd wrapped model loads in a fresh process and is still wrapped (packed calls right).

On main the patched classes existed only in the process that called ``safepad.wrap``, so loading failed with
``Can't get attribute 'SafepadMamba2Mixer' on <module 'safepad.wrap'>``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import safepad
from safepad.testing.tiny import tiny_model

from .helpers import packed_batch

ROOT = Path(__file__).resolve().parents[2]

_LOADER = """
import pickle, sys, torch
import safepad
for path in sys.argv[1:]:
    if path.endswith(".pt"):
        model = torch.load(path, weights_only=False)
    else:
        with open(path, "rb") as f:
            model = pickle.load(f)
    ref = torch.load(path + ".ref", weights_only=False)
    assert safepad.is_wrapped(model), f"{path}: not wrapped after loading"
    with torch.no_grad():
        out = model(input_ids=ref["ids"], seq_idx=ref["seq_idx"], use_cache=False).logits
    torch.testing.assert_close(out, ref["logits"], rtol=1e-5, atol=1e-5)
    print(path, type(model.get_submodule(ref["mixer"])).__name__)
"""

CASES = [
    ("mamba2", "backbone.layers.0.mixer"),
    ("nemotron_h", "model.layers.0.mixer"),
    ("qwen3_next", "model.layers.0.linear_attn"),
]


def test_wrapped_models_load_in_a_fresh_process(tmp_path):
    """torch.save and pickle of three families, all loaded by one fresh interpreter (one start-up)."""
    paths = []
    _, ids, seq_idx, _, _ = packed_batch([5, 9, 3])
    for family, mixer in CASES:
        model = safepad.wrap(tiny_model(family))
        with torch.no_grad():
            logits = model(input_ids=ids, seq_idx=seq_idx, use_cache=False).logits
        for ext in (".pt", ".pkl"):
            path = tmp_path / f"{family}{ext}"
            if ext == ".pt":
                torch.save(model, path)
            else:
                path.write_bytes(pickle.dumps(model))
            torch.save({"ids": ids, "seq_idx": seq_idx, "logits": logits, "mixer": mixer}, str(path) + ".ref")
            paths.append(str(path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _LOADER, *paths], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == len(paths) and all(line.split()[-1].startswith("Safepad") for line in lines), res.stdout


def test_unknown_safepad_name_is_an_attribute_error():
    import safepad.wrap as w

    with pytest.raises(AttributeError):
        w.SafepadNoSuchMixer  # noqa: B018
