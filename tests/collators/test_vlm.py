"""VLM fields through pack_dataset and the collator: Nemotron-H Omni with images, rows as a plain ``datasets`` row
gives them (nested Python float lists), compared with every example run alone through the stock VLM."""

from __future__ import annotations

import copy

import datasets
import numpy as np
import pytest
import torch

import safepad
from safepad.collators import DataCollatorForPackedSSM, pack_dataset

IMAGE = 250  # image placeholder id
PATCH_DIM = 3 * 4 * 4  # C * p * p


@pytest.fixture(scope="module")
def vlms():
    from transformers.models.nemotron_h_omni.configuration_nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    from safepad.testing.tiny import strengthen_mixers, tiny_config

    cfg = NemotronH_Omni_Reasoning_V3_Config(
        text_config=tiny_config("nemotron_h").to_dict(),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           patch_size=4, image_size=16, max_img_size=16, video_temporal_patch_size=2),
        projector_hidden_size=32, vision_hidden_size=32, force_image_size=16, image_token_id=IMAGE,
    )  # fmt: skip
    torch.manual_seed(0)
    stock = strengthen_mixers(NemotronH_Omni_Reasoning_V3(cfg)).eval()
    return stock, safepad.wrap(copy.deepcopy(stock))


def _examples() -> dict[str, list]:
    """4 examples: images of 1 and 2 embeddings (grid 2x2 -> 1 placeholder, 4x2 -> 2), two images in one, none."""
    g = np.random.default_rng(0)
    grids = [[[2, 2]], [[4, 2]], [], [[2, 2], [4, 2]]]
    ids = [[5, IMAGE, 7, 8, 9], [11, IMAGE, IMAGE, 12, 13, 14, 15], [20, 21, 22], [30, IMAGE, 31, IMAGE, IMAGE, 32]]
    pixels = [g.standard_normal((sum(h * w for h, w in grid), PATCH_DIM)).tolist() if grid else None for grid in grids]
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_hw": grids}


@torch.no_grad()
def _alone(stock, data) -> dict[tuple[int, ...], torch.Tensor]:
    out = {}
    for ids, pv, grid in zip(data["input_ids"], data["pixel_values"], data["image_grid_hw"]):
        kw = {}
        if grid:
            kw = {"pixel_values": torch.tensor(pv, dtype=torch.float32), "image_grid_hw": torch.tensor(grid)}
        out[tuple(ids)] = stock(input_ids=torch.tensor([ids]), **kw).logits[0]
    return out


@torch.no_grad()
def _check_batch(model, batch, alone) -> None:
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    cu = batch["cu_seq_lens_q"].tolist()
    ids = batch["input_ids"][0].tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        ref = alone[tuple(ids[a:b])]
        assert (logits[a:b] - ref).abs().max() < 1e-4, ids[a:b]


def test_collator_gives_float32_pixel_values_from_python_floats(vlms):
    """A plain datasets row holds pixel_values as Python floats: float64 crashed Nemotron-H Omni (m1/m2 dtype)."""
    stock, wrapped = vlms
    data = {k: [v[i] for i in (0, 1, 3)] for k, v in _examples().items()}  # every example has an image
    rows = list(datasets.Dataset.from_dict(data))
    assert isinstance(rows[0]["pixel_values"][0][0], float)
    batch = DataCollatorForPackedSSM()(rows)
    assert batch["pixel_values"].dtype == torch.float32 and batch["pixel_values"].shape == (4 + 8 + 4 + 8, PATCH_DIM)
    assert batch["image_grid_hw"].tolist() == [[2, 2], [4, 2], [2, 2], [4, 2]]
    _check_batch(wrapped, batch, _alone(stock, data))


def test_collator_skips_examples_without_media(vlms):
    """A text-only example (pixel_values None, image_grid_hw []) next to ones with images."""
    stock, wrapped = vlms
    data = _examples()
    batch = DataCollatorForPackedSSM()(list(datasets.Dataset.from_dict(data)))
    assert batch["image_grid_hw"].tolist() == [[2, 2], [4, 2], [2, 2], [4, 2]]
    _check_batch(wrapped, batch, _alone(stock, data))
    assert "pixel_values" not in DataCollatorForPackedSSM()([{"input_ids": [1, 2], "pixel_values": None}])


@pytest.mark.parametrize("max_length", [pytest.param(8, id="rows-of-1-or-2"), pytest.param(32, id="one-row")])
def test_pack_dataset_carries_vlm_columns_in_sequence_order(vlms, max_length):
    """pack_dataset used to drop pixel_values / image_grid_hw (INFO log only): placeholders then trained as text."""
    stock, wrapped = vlms
    data = _examples()
    packed = pack_dataset(datasets.Dataset.from_dict(data), max_length)
    assert {"pixel_values", "image_grid_hw"} <= set(packed.column_names)
    alone = _alone(stock, data)
    collator = DataCollatorForPackedSSM()
    rows = list(packed)
    for batch in (collator(rows), *(collator([r]) for r in rows)):
        _check_batch(wrapped, batch, alone)
    # a row whose sequences carry no image has no pixel_values at all (not an empty tensor)
    text_only = [r for r in rows if not r["image_grid_hw"]]
    for r in text_only:
        assert "pixel_values" not in collator([r])


def test_pack_dataset_refuses_to_cut_an_example_with_media():
    data = _examples()
    ds = datasets.Dataset.from_dict(data)
    with pytest.raises(ValueError, match=r"example 1 has 7 tokens > max_length=6 .* 'pixel_values'"):
        pack_dataset(ds, 6)
    with pytest.raises(ValueError, match="strategy='wrapped' cuts examples"):
        pack_dataset(ds, 16, strategy="wrapped")
    # cutting an example without media is fine
    ok = pack_dataset(ds.select([2, 0]), 5, overflow="split")  # example 2 (3 tokens, no image) -> 2 + 1
    ok = pack_dataset(ds.select([2]), 2, overflow="split")
    assert ok["seq_lengths"] == [[2], [1]] and ok["image_grid_hw"] == [[], []]
