"""``DataCollatorForPackedSSM``: flatten a list of features into one packed ``[1, T]`` row.

The collator emits every boundary encoding a packed SSM / hybrid model may read:

* ``seq_idx``        ``[1, T]`` int32 — mamba-ssm / causal-conv1d's boundary tensor,
* ``position_ids``   ``[1, T]`` int64 — restart at 0 per sequence (attention layers, TRL convention),
* ``cu_seq_lens_q``  ``[N + 1]`` int32 (= ``cu_seq_lens_k``) and ``max_length_q`` (= ``max_length_k``) —
  flash-attention's varlen kwargs,

and never an ``attention_mask`` (a packed row has no padding to mask). The first label of every
sequence is ``-100`` so no token is trained to predict across a boundary.

Everything is built with numpy concatenation: no per-token Python lists.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

__all__ = ["CollatorStats", "DataCollatorForPackedSSM", "PER_TOKEN_KEYS"]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
_INT64_MAX = np.iinfo(np.int64).max
#: Largest ``pad_to_multiple_of`` accepted: a pad tail is at most this many tokens.
MAX_PAD_TO_MULTIPLE_OF = 1 << 20
# Marker: a per-example field with no value in any feature of the batch (omitted from the output).
_ABSENT = object()

#: Feature keys that are always per-token (1-D, same length as ``input_ids``).
PER_TOKEN_KEYS: frozenset[str] = frozenset(
    {
        "labels",
        "token_type_ids",
        "attention_mask",
        "position_ids",
        "completion_mask",
        "assistant_masks",
        "loss_mask",
        "special_tokens_mask",
    }
)

# Keys the collator consumes itself: they describe the layout and are replaced by its own outputs.
_LAYOUT_KEYS = frozenset({"input_ids", "labels", "seq_lengths", "position_ids", "attention_mask"})
# Keys the collator produces: a feature must not carry them (they would be ambiguous).
_OUTPUT_KEYS = frozenset(
    {"seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "real_token_mask"}
)


@dataclass
class CollatorStats:
    """Running counters of a :class:`DataCollatorForPackedSSM` (per process: DataLoader workers keep their own).

    ``fill_ratio`` is real tokens / emitted tokens (the rest is the ``pad_to_multiple_of`` tail).
    """

    batches: int = 0
    sequences: int = 0
    real_tokens: int = 0
    pad_tokens: int = 0
    examples_skipped: int = 0
    last_skipped: list[int] = field(default_factory=list, repr=False)  # feature indices skipped in the last batch

    @property
    def fill_ratio(self) -> float:
        total = self.real_tokens + self.pad_tokens
        return self.real_tokens / total if total else 0.0

    @property
    def sequences_per_batch(self) -> float:
        return self.sequences / self.batches if self.batches else 0.0


def _as_int_array(value: Any, key: str, index: int) -> np.ndarray:
    """A 1-D integer numpy view of ``value`` (list, numpy array or torch tensor)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"feature {index}: {key!r} must hold integer ids, got a tensor of dtype {value.dtype}")
        arr = value.detach().cpu().numpy()
    else:
        arr = _asarray(value, key, index)
    if _python_ints_beyond_int64(value, arr) or (arr.dtype.kind == "u" and arr.size and arr.max() > _INT64_MAX):
        raise ValueError(
            f"feature {index}: {key!r} holds the unsigned value {max(int(x) for x in arr.tolist())} >= 2**63, "
            "which the int64 output cannot hold (it would wrap to a negative id)"
        )
    if arr.ndim != 1:
        raise ValueError(f"feature {index}: {key!r} must be 1-D (one sequence per feature), got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":  # np.asarray([]) is float64: an empty list is fine
            return arr.astype(np.int64)
        raise ValueError(
            f"feature {index}: {key!r} must hold integers, got dtype {arr.dtype} "
            "(convert token ids with int(); floats, bools and strings are rejected)"
        )
    return arr


def _python_ints_beyond_int64(value: Any, arr: np.ndarray) -> bool:
    """numpy turns a list of Python ints with one >= 2**63 into float64 (rounding them): catch that."""
    return (
        arr.dtype.kind == "f"
        and isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
        and max(value) > _INT64_MAX
    )


def _asarray(value: Any, key: str, index: int | str) -> np.ndarray:
    """``np.asarray`` with an error that names the field (ragged nested lists)."""
    try:
        return np.asarray(value)
    except ValueError as e:
        raise ValueError(
            f"feature {index}: {key!r} is a ragged nested list (its rows differ in length), not an array: {e}"
        ) from e


def _as_array(value: Any, key: str = "?", index: int | str = "?") -> np.ndarray:
    """``value`` as numpy. Python floats (lists, as a plain ``datasets`` row gives them) become float32, like
    ``torch.tensor``'s default dtype in transformers' collators; numpy arrays and tensors keep their dtype."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value
    arr = _asarray(value, key, index)
    return arr.astype(np.float32) if arr.dtype == np.float64 else arr


class DataCollatorForPackedSSM:
    """Pack the features of one DataLoader batch into a single ``[1, T]`` row for SSM / hybrid models.

    Each feature holds ``input_ids`` (a list, 1-D numpy array or 1-D tensor) and optionally:

    * ``labels`` — same length; ``-100`` entries (completion-only masks) are kept. Either every
      feature has labels or none does; without labels, ``labels`` is a copy of ``input_ids``.
    * ``seq_lengths`` — the lengths of the several sequences held by a row made by
      :func:`~collators.pack_dataset`; they must add up to the row length.
    * ``position_ids`` — a packed row's positions restarting at 0 per sequence. Used for the
      boundaries when ``seq_lengths`` is absent (``transformers.Trainer`` drops ``seq_lengths``
      with ``remove_unused_columns=True`` but keeps ``position_ids`` for models that accept it),
      and checked against ``seq_lengths`` when both are present.
    * ``attention_mask`` — accepted only when all ones and then dropped: packed features must not
      contain padding.
    * other keys, carried through (see *Extra fields* below).

    Output (``return_tensors="pt"``; ``"np"`` gives numpy arrays of the same dtypes)::

        input_ids      [1, T]   int64
        labels         [1, T]   int64   first token of every sequence (and the pad tail) = -100
        position_ids   [1, T]   int64   0, 1, ... restarting per sequence
        seq_idx        [1, T]   int32   0 .. N-1, one id per sequence
        cu_seq_lens_q  [N + 1]  int32   == cu_seq_lens_k, cumulative lengths ending at T
                                        (pad_to_length: [max_sequences + 1], padded by repeating T)
        max_length_q   int              == max_length_k, longest sequence (pad_to_length: T)
        real_token_mask [1, T]  int64   only with pad_to_multiple_of / pad_to_length: 1 on real tokens, 0 on the
                                        pad tail (a wrapped MoE model keeps the tail out of its router loss)
        <per-token>    [1, T]           concatenated like input_ids, pad tail = 0
        <per-example>  [sum_i n_i, ...] concatenated along dim 0 in packing order

    No ``attention_mask`` is returned (attention reads the packed boundaries, and a 2-D mask would hide them from
    transformers' packing detection). ``real_token_mask`` is consumed by a ``safepad.wrap``-ped model: MoE families
    whose router load-balancing loss reads the ``attention_mask`` (Jamba, Qwen3-Next, GraniteMoeHybrid) get it there,
    so the pad tail stays out of that loss as it stays out of the LM loss. An unwrapped model ignores it.

    Args:
        pad_to_multiple_of: pad ``T`` up to a multiple of this with ONE extra sequence (its own
            ``seq_idx``, positions restarting at 0, labels ``-100``, ids ``pad_token_id``) that also
            appears in ``cu_seq_lens``: static shapes without leaking state into a real sequence.
        pad_to_length: shape-stable rows for ``torch.compile``. An int ``L``: every batch is padded to
            exactly ``L`` tokens; a tuple of lengths (buckets, e.g. ``(1024, 2048, 4096)``): to the smallest
            one that holds the batch. The pad tail is ONE extra sequence as with ``pad_to_multiple_of``, and
            every tensor has a shape fixed by the bucket: ``cu_seq_lens_q/k`` are ``[max_sequences + 1]``
            (padded by repeating ``L``: zero-length sequences, which flash-attention's varlen kernels and
            safepad accept) and ``max_length_q/k`` are ``L`` (an upper bound, which is all flash-attention
            needs). So a compiled model sees one input signature per bucket: one compile for an epoch. A
            batch of more than the largest length raises. Excludes ``pad_to_multiple_of``.
        max_sequences: with ``pad_to_length``, the number of sequences ``cu_seq_lens`` has room for
            (default: the bucket length, which always suffices since every sequence holds a token). A
            batch with more sequences (its pad tail included) raises.
        pad_token_id: id used for the pad tail.
        max_tokens: raise ``ValueError`` when a batch (after padding) holds more tokens.
        on_empty: ``"error"`` (default) raises on a feature with empty ``input_ids``; ``"skip"``
            drops it and counts it in :attr:`stats`.
        return_tensors: ``"pt"`` or ``"np"``.
        per_token_keys: extra keys to treat as per-token (1-D, same length as ``input_ids``).
            :data:`PER_TOKEN_KEYS` are always per-token.
        per_example_keys: keys to treat as per-example even when they happen to be 1-D with the
            length of ``input_ids``.

    Extra fields: a key is *per-token* when it is listed in :data:`PER_TOKEN_KEYS` or
    ``per_token_keys`` (its length must then match ``input_ids``), or, for any other key, when it
    is 1-D, numeric and has the length of ``input_ids`` in every feature of the batch. Per-token fields are
    concatenated like ``input_ids`` and filled with 0 on the pad tail. Every other array/tensor is
    *per-example* and concatenated along dim 0 in packing order; Python scalars become a
    ``[num_features]`` tensor; strings are passed through as a list.

    VLMs (e.g. Nemotron-H Omni): ``pixel_values`` ``[patches_i, C*p*p]`` become
    ``[sum_i patches_i, C*p*p]`` and ``image_grid_hw`` ``[n_i, 2]`` become ``[sum_i n_i, 2]`` (audio
    ``input_features`` ``[n_i, frames, mel]`` likewise, with a shared padded ``frames``). The model
    scatters image embeddings into its image placeholder tokens in token order, so concatenating
    the media in the same order as the sequences keeps every image attached to its own sequence;
    ``seq_idx`` / ``cu_seq_lens`` keep the states apart. See collators/README.md for the caveats.

    Statistics accumulate in :attr:`stats` (:class:`CollatorStats`).
    """

    def __init__(
        self,
        *,
        pad_to_multiple_of: int | None = None,
        pad_to_length: int | Sequence[int] | None = None,
        max_sequences: int | None = None,
        pad_token_id: int = 0,
        max_tokens: int | None = None,
        on_empty: Literal["error", "skip"] = "error",
        return_tensors: Literal["pt", "np"] = "pt",
        per_token_keys: Iterable[str] = (),
        per_example_keys: Iterable[str] = (),
    ) -> None:
        if pad_to_multiple_of is not None and (
            not isinstance(pad_to_multiple_of, int) or isinstance(pad_to_multiple_of, bool) or pad_to_multiple_of < 1
        ):
            raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}")
        if pad_to_multiple_of is not None and pad_to_multiple_of > MAX_PAD_TO_MULTIPLE_OF:
            raise ValueError(
                f"pad_to_multiple_of={pad_to_multiple_of} exceeds {MAX_PAD_TO_MULTIPLE_OF} tokens: every batch would "
                "be padded to that many tokens; use the row length you train with (e.g. 64, or max_length)"
            )
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
        if max_tokens is not None and pad_to_multiple_of is not None and pad_to_multiple_of > max_tokens:
            raise ValueError(
                f"pad_to_multiple_of={pad_to_multiple_of} > max_tokens={max_tokens}: every padded batch would "
                "exceed max_tokens"
            )
        self.pad_to_length = _check_lengths(pad_to_length, pad_to_multiple_of, max_tokens)
        if max_sequences is not None and (
            not isinstance(max_sequences, int) or isinstance(max_sequences, bool) or max_sequences < 1
        ):
            raise ValueError(f"max_sequences must be a positive int or None, got {max_sequences!r}")
        if max_sequences is not None and self.pad_to_length is None:
            raise ValueError("max_sequences only applies with pad_to_length= (it sizes the padded cu_seq_lens)")
        self.max_sequences = max_sequences
        if not isinstance(pad_token_id, (int, np.integer)) or isinstance(pad_token_id, bool):
            raise ValueError(f"pad_token_id must be an int, got {pad_token_id!r}")
        if on_empty not in ("error", "skip"):
            raise ValueError(f"on_empty must be 'error' or 'skip', got {on_empty!r}")
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = int(pad_token_id)
        self.max_tokens = max_tokens
        self.on_empty = on_empty
        self.return_tensors = return_tensors
        self.per_token_keys = frozenset(PER_TOKEN_KEYS | set(per_token_keys))
        self.per_example_keys = frozenset(per_example_keys)
        both = self.per_token_keys & self.per_example_keys
        if both:
            raise ValueError(f"keys {sorted(both)} are listed both as per-token and per-example")
        self.stats = CollatorStats()

    # ------------------------------------------------------------------ helpers
    def _bucket(self, real: int) -> int:
        """The smallest ``pad_to_length`` bucket that holds ``real`` tokens; raise when none does."""
        for length in self.pad_to_length:
            if real <= length:
                return length
        largest = self.pad_to_length[-1]
        raise ValueError(
            f"batch holds {real} real tokens, more than pad_to_length={largest} (the largest row length): pack "
            f"with pack_dataset(max_length={largest}) and collate one packed row per batch "
            "(per_device_train_batch_size=1), or raise pad_to_length"
        )

    def _boundaries(self, feature: Mapping[str, Any], n: int, index: int) -> np.ndarray:
        """Sequence lengths ``[k]`` inside one feature of ``n`` tokens."""
        seq_lengths = feature.get("seq_lengths")
        position_ids = feature.get("position_ids")
        lengths = None
        if seq_lengths is not None:
            lengths = _as_int_array(seq_lengths, "seq_lengths", index)
            if lengths.size == 0 or (lengths <= 0).any():
                raise ValueError(f"feature {index}: seq_lengths must be positive, got {lengths.tolist()}")
            if int(lengths.sum()) != n:
                raise ValueError(
                    f"feature {index}: seq_lengths add up to {int(lengths.sum())} but input_ids has {n} tokens; "
                    "the row's sequence lengths must add up to its length"
                )
        if position_ids is not None:
            pos = _as_int_array(position_ids, "position_ids", index)
            if pos.shape[0] != n:
                raise ValueError(
                    f"feature {index}: position_ids has {pos.shape[0]} entries but input_ids has {n} tokens"
                )
            if n and pos[0] != 0:
                raise ValueError(f"feature {index}: position_ids must start at 0, got {int(pos[0])}")
            starts = np.flatnonzero(pos == 0)  # [k]
            from_pos = np.diff(np.append(starts, n))  # [k]
            expected = np.arange(n) - np.repeat(starts, from_pos)  # [n]
            if not np.array_equal(pos, expected):
                raise ValueError(f"feature {index}: position_ids must count 0, 1, 2, ... and restart at 0 per sequence")
            if lengths is not None and not np.array_equal(lengths, from_pos):
                raise ValueError(
                    f"feature {index}: seq_lengths {lengths.tolist()} disagree with the restarts of position_ids "
                    f"{from_pos.tolist()}"
                )
            lengths = from_pos
        if lengths is None:
            return np.array([n], dtype=np.int64)
        return lengths.astype(np.int64, copy=False)

    def _classify(self, features: Sequence[Mapping[str, Any]], lengths: list[int]) -> tuple[list[str], list[str]]:
        keys = [k for k in features[0] if k not in _LAYOUT_KEYS]
        for i, f in enumerate(features):
            bad = _OUTPUT_KEYS.intersection(f)
            if bad:
                raise ValueError(
                    f"feature {i} already carries {sorted(bad)}: the collator computes the packing layout itself; "
                    "remove these keys from the features"
                )
            if set(f).difference(_LAYOUT_KEYS) != set(keys):
                raise ValueError(
                    f"feature {i} has keys {sorted(set(f) - _LAYOUT_KEYS)} but feature 0 has {sorted(keys)}: "
                    "every feature of a batch must carry the same fields"
                )
        per_token, per_example = [], []
        for k in keys:
            if k in self.per_token_keys:
                per_token.append(k)
            elif k in self.per_example_keys:
                per_example.append(k)
            else:
                arrs = [_as_array(f[k], k, i) for i, f in enumerate(features)]
                is_tok = all(a.ndim == 1 and a.shape[0] == n and a.dtype.kind in "iufb" for a, n in zip(arrs, lengths))
                (per_token if is_tok else per_example).append(k)
        return per_token, per_example

    # ----------------------------------------------------------------- __call__
    def __call__(
        self, features: Sequence[Mapping[str, Any]], return_tensors: Literal["pt", "np"] | None = None
    ) -> dict[str, Any]:
        """Pack ``features`` (a list of dicts) into one ``[1, T]`` batch; see the class docstring."""
        return_tensors = return_tensors or self.return_tensors
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}")
        if isinstance(features, Mapping) or not isinstance(features, Sequence) or len(features) == 0:
            raise ValueError("features must be a non-empty list of dicts (what a DataLoader yields per batch)")

        has_labels = "labels" in features[0]
        skipped: list[int] = []
        ids: list[np.ndarray] = []
        labs: list[np.ndarray] = []
        seq_lens: list[np.ndarray] = []
        kept: list[int] = []
        for i, f in enumerate(features):
            if not isinstance(f, Mapping) or "input_ids" not in f:
                raise ValueError(f"feature {i} must be a dict with an 'input_ids' entry")
            x = _as_int_array(f["input_ids"], "input_ids", i)
            n = x.shape[0]
            if ("labels" in f) != has_labels:
                raise ValueError(
                    f"feature {i} {'has' if not has_labels else 'lacks'} labels but feature 0 "
                    f"{'has' if has_labels else 'does not'}: either every feature carries labels or none does"
                )
            if has_labels:
                y = _as_int_array(f["labels"], "labels", i)
                if y.shape[0] != n:
                    raise ValueError(f"feature {i}: labels has {y.shape[0]} entries but input_ids has {n} tokens")
            mask = f.get("attention_mask")
            if mask is not None:
                m = _as_array(mask)
                if m.shape != (n,):
                    raise ValueError(f"feature {i}: attention_mask has shape {m.shape}, input_ids has ({n},)")
                if not m.all():
                    raise ValueError(
                        f"feature {i}: attention_mask contains zeros; packed features must not be padded "
                        "(tokenize without padding)"
                    )
            if n == 0:
                if self.on_empty == "error":
                    raise ValueError(
                        f"feature {i}: input_ids is empty; filter empty examples out or pass on_empty='skip'"
                    )
                skipped.append(i)
                continue
            ids.append(x)
            if has_labels:
                labs.append(y)
            seq_lens.append(self._boundaries(f, n, i))
            kept.append(i)

        if not ids:
            raise ValueError(f"all {len(features)} features have empty input_ids: nothing to pack")
        kept_features = [features[i] for i in kept]
        feat_lengths = [a.shape[0] for a in ids]
        per_token, per_example = self._classify(kept_features, feat_lengths)

        lengths = np.concatenate(seq_lens)  # [N_real]
        real = int(lengths.sum())
        bucket = self._bucket(real) if self.pad_to_length is not None else None
        if bucket is not None:
            pad = bucket - real
        else:
            pad = (-real) % self.pad_to_multiple_of if self.pad_to_multiple_of else 0
        total = real + pad
        if self.max_tokens is not None and total > self.max_tokens:
            raise ValueError(
                f"batch holds {total} tokens ({real} real + {pad} pad) which exceeds max_tokens={self.max_tokens}; "
                "lower the batch size or raise max_tokens"
            )
        if pad:
            lengths = np.append(lengths, pad)  # [N]; the pad tail is its own sequence
        n_seq = lengths.shape[0]

        slots = n_seq
        if bucket is not None:
            slots = self.max_sequences or bucket
            if n_seq > slots:
                raise ValueError(
                    f"batch holds {n_seq} sequences{' (its pad tail included)' if pad else ''} but "
                    f"max_sequences={slots} sizes cu_seq_lens; raise max_sequences (or leave it None)"
                )
        cu = np.full(slots + 1, total, dtype=np.int32)  # [N + 1], or [max_sequences + 1] padded with T
        cu[0] = 0
        np.cumsum(lengths, out=cu[1 : n_seq + 1])
        starts = cu[:n_seq].astype(np.int64)  # [N]

        input_ids = np.empty(total, dtype=np.int64)  # [T]
        np.concatenate(ids, out=input_ids[:real], casting="unsafe")
        input_ids[real:] = self.pad_token_id
        if has_labels:
            labels = np.empty(total, dtype=np.int64)  # [T]
            np.concatenate(labs, out=labels[:real], casting="unsafe")
        else:
            labels = input_ids.copy()
        labels[real:] = IGNORE_INDEX
        labels[starts] = IGNORE_INDEX  # no token predicts across a boundary

        seq_idx = np.repeat(np.arange(n_seq, dtype=np.int32), lengths)  # [T]
        position_ids = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)  # [T]

        batch: dict[str, Any] = {
            "input_ids": input_ids[None],  # [1, T]
            "labels": labels[None],  # [1, T]
            "position_ids": position_ids[None],  # [1, T]
            "seq_idx": seq_idx[None],  # [1, T]
            "cu_seq_lens_q": cu,  # [N + 1]
            "cu_seq_lens_k": cu,  # [N + 1]
        }
        for k in per_token:
            parts = []
            for j, f, n in zip(kept, kept_features, feat_lengths):
                a = _as_array(f[k], k, j)
                if a.dtype.kind == "u" and a.size and a.max() > _INT64_MAX:
                    raise ValueError(f"feature {j}: per-token field {k!r} holds an unsigned value >= 2**63")
                if a.shape != (n,):
                    raise ValueError(
                        f"feature {j}: per-token field {k!r} has shape {a.shape} but input_ids has {n} tokens"
                    )
                parts.append(a)
            vals = np.concatenate(parts)  # [T_real]
            if pad:
                vals = np.concatenate([vals, np.zeros(pad, dtype=vals.dtype)])  # [T]
            batch[k] = vals[None]  # [1, T]
        for k in per_example:
            value = self._collate_per_example(k, [f[k] for f in kept_features], kept, return_tensors)
            if value is not _ABSENT:
                batch[k] = value

        if self.pad_to_multiple_of or self.pad_to_length is not None:  # a fixed key set, pad or not
            real_mask = np.ones(total, dtype=np.int64)  # [T]
            real_mask[real:] = 0
            batch["real_token_mask"] = real_mask[None]  # [1, T]
        if return_tensors == "pt":
            for k in ("input_ids", "labels", "position_ids", "seq_idx", "cu_seq_lens_q", *per_token):
                batch[k] = torch.from_numpy(batch[k])
            batch["cu_seq_lens_k"] = batch["cu_seq_lens_q"]
            if "real_token_mask" in batch:
                batch["real_token_mask"] = torch.from_numpy(batch["real_token_mask"])
        max_len = bucket if bucket is not None else int(lengths.max())
        batch["max_length_q"] = batch["max_length_k"] = max_len

        self.stats.batches += 1
        if skipped:
            logger.debug("DataCollatorForPackedSSM: skipped empty features %s", skipped)
        self.stats.examples_skipped += len(skipped)
        self.stats.last_skipped = skipped
        self.stats.sequences += n_seq - (1 if pad else 0)
        self.stats.real_tokens += real
        self.stats.pad_tokens += pad
        return batch

    @staticmethod
    def _collate_per_example(key: str, values: list[Any], indices: list[int], return_tensors: str) -> Any:
        """Concatenate one per-example field along dim 0 in packing order.

        ``None`` and empty Python lists (an example without media; a packed row whose sequences have none)
        contribute nothing; a field without any value in the batch is omitted (returns ``_ABSENT``).
        """
        present = [(i, v) for i, v in zip(indices, values) if not _is_nothing(v)]
        if not present:
            return _ABSENT
        first = present[0][1]
        if isinstance(first, str) or any(isinstance(v, str) for _, v in present):
            return list(values)
        if isinstance(first, torch.Tensor) and return_tensors == "pt":
            vals = []
            for _, v in present:
                if not isinstance(v, torch.Tensor):
                    v = torch.from_numpy(np.ascontiguousarray(_as_array(v, key, _)))
                vals.append(v if v.dim() else v.reshape(1))  # scalars -> [1]
            try:
                return torch.cat(vals, dim=0)  # [sum_i n_i, ...]
            except RuntimeError as e:
                raise ValueError(
                    f"per-example field {key!r} cannot be concatenated along dim 0 across features {indices}: {e}"
                ) from e
        arrs = [np.atleast_1d(_as_array(v, key, i)) for i, v in present]
        if any(a.dtype.kind in "OUS" for a in arrs):  # objects / strings: no tensor, pass the values through
            return list(values)
        try:
            out = np.concatenate(arrs, axis=0)  # [sum_i n_i, ...]
        except ValueError as e:
            raise ValueError(
                f"per-example field {key!r} cannot be concatenated along dim 0 across features {indices}: {e}"
            ) from e
        return torch.from_numpy(out) if return_tensors == "pt" else out


def _check_lengths(
    pad_to_length: int | Sequence[int] | None, pad_to_multiple_of: int | None, max_tokens: int | None
) -> tuple[int, ...] | None:
    """``pad_to_length`` as a sorted tuple of bucket lengths (or None), with errors naming the argument."""
    if pad_to_length is None:
        return None
    if pad_to_multiple_of is not None:
        raise ValueError(
            "pass either pad_to_length (fixed row lengths, for torch.compile) or pad_to_multiple_of, not both"
        )
    values = (pad_to_length,) if isinstance(pad_to_length, (int, np.integer)) else pad_to_length
    if (
        isinstance(values, (str, bytes, Mapping))
        or not isinstance(values, Iterable)
        or not (values := tuple(values))
        or any(not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1 for v in values)
    ):
        raise ValueError(
            f"pad_to_length must be a positive int or a non-empty sequence of them (length buckets), got "
            f"{pad_to_length!r}"
        )
    buckets = tuple(sorted({int(v) for v in values}))
    if buckets[-1] > MAX_PAD_TO_MULTIPLE_OF:
        raise ValueError(f"pad_to_length={buckets[-1]} exceeds {MAX_PAD_TO_MULTIPLE_OF} tokens")
    if max_tokens is not None and buckets[-1] > max_tokens:
        raise ValueError(f"pad_to_length={buckets[-1]} > max_tokens={max_tokens}: that row would exceed max_tokens")
    return buckets


def _is_nothing(value: Any) -> bool:
    """``None`` or an empty Python list / tuple: no value for this example."""
    return value is None or (isinstance(value, (list, tuple)) and len(value) == 0)
