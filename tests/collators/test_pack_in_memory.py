"""An in-memory Dataset is packed without ``Dataset.map`` (map would serialize every packed batch into an in-memory
Arrow stream and read it back: most of ``pack_dataset``'s time on the long-tailed benchmark, which took it below TRL's
BFD), and the result is the same dataset, to the byte, as the ``map`` path (still used on disk, with ``num_proc`` or
``map_kwargs``)."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from safepad.collators import pack_dataset

_rng = np.random.default_rng(0)
_PLAIN = {"input_ids": [_rng.integers(0, 100, int(n)).tolist() for n in _rng.integers(0, 40, 300)]}
_VLM = {
    "input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
    "labels": [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
    "pixel_values": [[[0.1, 0.2]], None, [[0.3, 0.4], [0.5, 0.6]]],
}


def _datasets():
    plain = datasets.Dataset.from_dict(_PLAIN)
    return {
        "plain": plain,
        "shuffled-selected": plain.shuffle(seed=1).select(range(200)),
        "torch-format": plain.with_format("torch"),
        "per-token-and-per-example": datasets.Dataset.from_dict(_VLM),
    }


OPTIONS = [
    pytest.param({}, id="defaults"),
    pytest.param({"batch_size": 64}, id="batch-64"),
    pytest.param({"strategy": "wrapped"}, id="wrapped"),
    pytest.param({"emit_position_ids": False, "overflow": "truncate"}, id="truncate-no-position-ids"),
]


@pytest.mark.parametrize("options", OPTIONS)
def test_in_memory_pack_skips_map_and_equals_the_map_path(options, monkeypatch):
    for name, ds in _datasets().items():
        if name == "per-token-and-per-example" and options.get("strategy") == "wrapped":
            continue  # a per-example value is never cut: wrapped raises (tested elsewhere)
        via_map, map_stats = pack_dataset(ds, 16, return_stats=True, map_kwargs={"desc": "map"}, **options)
        with monkeypatch.context() as m:
            m.setattr(datasets.Dataset, "map", lambda *a, **k: pytest.fail("in-memory packing went through map"))
            direct, stats = pack_dataset(ds, 16, return_stats=True, **options)
        assert direct.features == via_map.features, name
        assert direct.format == via_map.format, name
        assert direct.with_format("arrow")[:].equals(via_map.with_format("arrow")[:]), name
        assert str(stats) == str(map_stats), name
        assert direct._fingerprint != ds._fingerprint
