"""Spec for Qwen4-Exp (``qwen4_exp_text``, also inside the ``qwen4_exp`` VLM): its Gated DeltaNet is Qwen3.5's
(:func:`safepad.mixers.gated_delta.gated_delta_mixer_forward`), and its Per-Layer Embedding layers keep a dilated
conv state and an n-gram token-id state in the same recurrent cache entry (:func:`safepad.mixers.ple.ple_forward`).

One model type, two mixer classes: the PLE layers get their own forward (``forward_by_class``). The QSA indexer of
its attention layers reads the 4-D attention mask (block-diagonal for packed rows, pads masked), so it needs
nothing from safepad beyond the restarting ``position_ids`` every hybrid gets.
"""

from __future__ import annotations

from types import MappingProxyType

from ..mixers.gated_delta import gated_delta_mixer_forward
from ..mixers.ple import ple_forward
from .gdn_family import _QWEN3_5
from .registry import MixerSpec, register

__all__ = ["QWEN4_EXP_FAMILY"]

_PLE_CLASS = "Qwen4ExpTextPLELayer"


QWEN4_EXP_FAMILY = (
    register(
        MixerSpec(
            model_type="qwen4_exp_text",
            kind="gated_delta",
            mixer_classes=("Qwen4ExpTextGatedDeltaNet", _PLE_CLASS),
            inner_classes=("Qwen4ExpTextNGramEmbedding",),  # the PLE forward computes its n-grams itself
            forward=gated_delta_mixer_forward,
            forward_by_class=MappingProxyType({_PLE_CLASS: ple_forward}),
            options=MappingProxyType({**_QWEN3_5, "text_position_rows": (4, 1)}),  # [1, B, T]: row 0 too
            hybrid=True,
            description="Qwen3.5 Gated DeltaNet + PLE (dilated conv, n-gram ids restarting at EOS and packed boundaries)",
        )
    ),
)
