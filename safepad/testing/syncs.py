"""Count the host syncs a piece of code would cost on an accelerator, by running it on CPU.

On CUDA every op whose result the host must read stalls the stream until the device catches up, and a step
containing one cannot be captured in a CUDA graph: ``.item()`` / ``bool(t)`` / ``int(t)`` / ``float(t)``
(``aten._local_scalar_dense``), ``tolist()``, ``torch.equal``, ``nonzero`` (also ``torch.where(mask)``,
``argwhere``), boolean-mask indexing and assignment (``x[mask]``, ``x[mask] = v``), ``masked_select``,
``unique``, and ``repeat_interleave`` without ``output_size`` (its output length is data). On CPU these ops
cost nothing special, but they still go through the dispatcher, so a :class:`~torch.utils._python_dispatch.
TorchDispatchMode` sees each of them: :func:`count_syncs` counts them during a call (forward and backward).

``.cpu()`` / ``.to("cpu")`` / a ``copy_`` into a CPU tensor is a sync too when the source is a device tensor
(counted then); on CPU tensors it is a no-op copy, so a CPU run cannot see it.

Example::

    from safepad.testing.syncs import count_syncs

    out, n, ops = count_syncs(lambda: model(input_ids, seq_idx=seq_idx).loss.backward())
    assert n <= 2, ops            # ops: Counter({"aten._local_scalar_dense": 1, ...})
"""

from __future__ import annotations

import copy
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "KIND_FAMILIES",
    "SYNC_OPS",
    "SyncCount",
    "SyncCounter",
    "count_syncs",
    "decode_step",
    "depth_overrides",
    "packed_train_step",
]

#: aten ops (overload packet names) that read device data on the host whenever they run
SYNC_OPS: frozenset[str] = frozenset(
    {
        "aten._local_scalar_dense",  # .item(), bool(t), int(t), float(t), `if t:`
        "aten.equal",  # torch.equal
        "aten.nonzero",  # nonzero, torch.where(mask), argwhere
        "aten.masked_select",
        "aten._unique",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
        "aten.unique_dim_consecutive",
    }
)
#: ops that sync only for some arguments (see :func:`_is_sync`)
_INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
#: Tensor methods that copy device data to the host (seen by a TorchFunctionMode: they dispatch no aten op on CPU)
_HOST_METHODS = frozenset({"tolist", "numpy"})


class SyncCount(NamedTuple):
    """What :func:`count_syncs` returns: ``result, count, ops = count_syncs(fn)``."""

    #: what ``fn()`` returned
    result: Any
    #: the number of host syncs
    count: int
    #: op name (``"aten._local_scalar_dense"``, ``"Tensor.tolist"``, ...) -> how many times it ran
    ops: Counter


def _bool_index(indices) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()) if i is not None
    )


def _is_sync(name: str, args: tuple, kwargs: dict) -> bool:
    if name in SYNC_OPS:
        return True
    if name in _INDEX_OPS:  # x[mask] / x[mask] = v: the number of selected entries is read first
        return len(args) > 1 and _bool_index(args[1])
    if name == "aten.repeat_interleave":  # .Tensor(repeats, *, output_size): the output length is data without it
        return isinstance(args[0], torch.Tensor) and args[0].dim() > 0 and kwargs.get("output_size") is None
    if name == "aten._to_copy":  # .cpu() / .to("cpu") of a device tensor (a no-op copy on CPU tensors)
        device = kwargs.get("device")
        return _on_device(args[0]) and device is not None and torch.device(device).type == "cpu" and not kwargs.get(
            "non_blocking", False
        )
    if name == "aten.copy_":  # cpu_tensor.copy_(device_tensor)
        return len(args) > 1 and _on_device(args[1]) and not _on_device(args[0]) and not (
            len(args) > 2 and args[2]
        )
    return False


def _on_device(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, owner: SyncCounter):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if _is_sync(name, args, kwargs):
            self.owner._record(name)
        return func(*args, **kwargs)


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, owner: SyncCounter):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_METHODS and args and isinstance(args[0], torch.Tensor):
            self.owner._record(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Context manager counting host syncs: ``with SyncCounter() as c: ...``; then ``c.count``, ``c.ops``.

    ``stacks=True`` also keeps, for every sync, the Python frames that led to it (``c.stacks``: a list of
    ``(op name, formatted stack)``), to find where a sync comes from.
    """

    def __init__(self, stacks: bool = False):
        self.ops: Counter = Counter()
        self.stacks: list[tuple[str, str]] = []
        self._keep_stacks = stacks
        self._modes: list = []

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def _record(self, name: str) -> None:
        self.ops[name] += 1
        if self._keep_stacks:
            frames = [f for f in traceback.extract_stack()[:-3] if "torch/" not in f.filename or "autograd" in f.filename]
            self.stacks.append((name, "".join(traceback.format_list(frames[-12:]))))

    def __enter__(self) -> SyncCounter:  # noqa: PYI034 (Self needs Python 3.11)
        self._modes = [_FunctionCounter(self), _DispatchCounter(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []


def count_syncs(fn: Callable[[], Any]) -> SyncCount:
    """Run ``fn()`` and count the host syncs it makes (forward and any backward it runs).

    Returns ``SyncCount(result, count, ops)``: ``fn``'s result, the number of syncs, and a ``Counter`` of the
    ops that made them. On CPU tensors it counts what each op would cost on an accelerator; on CUDA tensors it
    counts device-to-host copies too. :class:`SyncCounter` (``stacks=True``) also tells where each one came from.
    """
    with SyncCounter() as counter:
        result = fn()
    return SyncCount(result, counter.count, counter.ops)


def packed_train_step(model: torch.nn.Module, lengths: tuple[int, ...] = (5, 9, 7), seed: int = 0) -> Callable[[], Any]:
    """A closure running one packed training step of ``model``: one ``[1, sum(lengths)]`` row holding
    ``len(lengths)`` sequences, described by ``seq_idx`` (the collator's fast path; ``position_ids`` restarting
    at 0 too when the forward takes them), labels, forward and ``loss.backward()``. Returns the loss."""
    import inspect

    from ..layout.normalize import position_ids_from_seq_idx

    first = next(model.parameters())
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    ids = torch.randint(3, int(cfg.vocab_size), (1, T), generator=gen).to(first.device)  # [1, T]
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]  # [1, T]
    seq_idx = seq_idx.to(first.device)
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor(lengths), 0)[:-1].tolist()] = -100  # no loss across a boundary
    kwargs: dict[str, Any] = {"input_ids": ids, "labels": labels, "seq_idx": seq_idx, "use_cache": False}
    params = inspect.signature(model.forward).parameters
    if "position_ids" in params:
        kwargs["position_ids"] = position_ids_from_seq_idx(seq_idx)

    def step():
        model.zero_grad(set_to_none=True)
        # fresh tensors every step, as a collator gives: nothing recorded about an earlier step's batch carries over
        loss = model(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}).loss
        loss.backward()
        return loss.detach()

    return step


def decode_step(
    model: torch.nn.Module, batch: int = 4, prompt: int = 6, seed: int = 0, padding_side: str = "left"
) -> Callable[[], Any]:
    """A closure running one cached single-token decode step of ``model`` over ``batch`` padded rows.

    The prefill (rows of ``prompt - b % 3`` real tokens, padded on ``padding_side``: ``"left"``, ``"right"``, or
    ``"none"`` for full rows) runs when the closure is built, under
    ``torch.no_grad()``; the closure feeds one new token per row with the cache and the extended mask, as
    ``generate()`` does, and returns the ``[B, 1, V]`` logits. Each call re-runs the same step from the
    same cache state (a copy), so it may be called repeatedly; ``step(cache)`` runs it on a given cache instead
    (``step.fresh_cache()`` makes one). ``step.rows`` holds each row's real tokens
    (prompt, then the decoded token), for a reference that runs every row alone.
    """
    from .scenarios import _ModelIO

    io = _ModelIO(model)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, io.vocab, (batch, prompt), generator=gen)  # [B, L]
    if padding_side not in ("left", "right", "none"):
        raise ValueError(f"padding_side must be 'left', 'right' or 'none', got {padding_side!r}")
    mask = torch.ones(batch, prompt, dtype=torch.long)
    for b in range(batch):
        if padding_side == "left":
            mask[b, : b % 3] = 0
        elif padding_side == "right" and b % 3:
            mask[b, -(b % 3) :] = 0
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)  # [B, L]
    with torch.no_grad():
        _, cache = io(ids, attention_mask=mask, position_ids=position_ids, cache=io.fresh_cache(), use_cache=True)
    nxt = torch.randint(3, io.vocab, (batch, 1), generator=gen)  # [B, 1]
    full = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], 1)  # [B, L + 1]
    pos = mask.sum(1, keepdim=True)  # [B, 1]: each row's real tokens so far
    snapshot = copy.deepcopy(cache)
    decode_mask = io.decode_mask(full)

    def step(cache: Any = None):
        with torch.no_grad():
            logits, _ = io(nxt, attention_mask=decode_mask, position_ids=pos,
                           cache=copy.deepcopy(snapshot) if cache is None else cache, use_cache=True)
        return logits

    #: each row's real tokens, prompt then the decoded one (``[n_b + 1]`` each): the reference runs them alone
    step.rows = [torch.cat([ids[b][mask[b].bool()], nxt[b]]) for b in range(batch)]
    #: a fresh copy of the prefilled cache: ``step(step.fresh_cache())`` runs the step on it, so that a counter
    #: around that call sees the model's step alone (not the copy)
    step.fresh_cache = lambda: copy.deepcopy(snapshot)
    return step


#: one tiny family per mixer kind (``MixerSpec.kind``; ``safepad/mixers/``) for the structural sync tests
KIND_FAMILIES: dict[str, str] = {
    "mamba2": "mamba2",
    "mamba2 (hybrid)": "nemotron_h",
    "mamba1": "mamba",
    "gated_delta": "qwen3_next",
    "gated_delta (kda)": "kimi_linear",
    "short_conv": "lfm2",
    "rg_lru": "recurrent_gemma",
    "cca": "zaya",
    "attn_conv": "inkling_text",
    "ple": "qwen4_exp_text",
    "dsa_indexer": "glm5_next",
}


def depth_overrides(family: str, n_layers: int) -> dict[str, Any]:
    """Config overrides giving the tiny ``family`` model ``n_layers >= 2`` layers, every one past the second a
    sequence mixer (hybrids keep one attention layer, second), so that the layer count scales the mixers only."""
    if n_layers < 2:
        raise ValueError(f"n_layers must be >= 2, got {n_layers}")
    extra = n_layers - 2
    if family in ("mamba2", "mamba", "falcon_mamba", "zaya"):
        return {"num_hidden_layers": n_layers}
    if family == "nemotron_h":
        return {"layers_block_type": ["mamba", "attention"] + ["mamba"] * extra}
    if family == "lfm2":
        return {"num_hidden_layers": n_layers, "layer_types": ["conv", "full_attention"] + ["conv"] * extra}
    if family == "recurrent_gemma":
        return {"num_hidden_layers": n_layers, "block_types": ["recurrent", "attention"] + ["recurrent"] * extra}
    if family == "inkling_text":
        return {"num_hidden_layers": n_layers, "layer_types": ["hybrid_sliding", "hybrid"] + ["hybrid"] * extra}
    linear = {"num_hidden_layers": n_layers,
              "layer_types": ["linear_attention", "full_attention"] + ["linear_attention"] * extra}
    if family == "qwen3_next":
        return linear
    if family == "kimi_linear":
        return {**linear, "mlp_layer_types": ["dense", "sparse"] + ["dense"] * extra}
    if family == "qwen4_exp_text":
        types = ["linear_attention", "indexed_attention"] + ["linear_attention"] * extra
        return {"num_hidden_layers": n_layers, "layer_types": types, "ple_layer_ids": [1]}
    if family == "glm5_next":  # a VLM: the layer pattern lives in its text config
        from .tiny import _TINY

        text = copy.deepcopy(_TINY["glm5_next"]["text_config"])
        text.update(linear, mlp_layer_types=["dense", "sparse"] + ["dense"] * extra, indexer_types=["full"] * n_layers)
        return {"text_config": text}
    raise ValueError(f"family: no depth overrides for {family!r}; choose one of {sorted(set(KIND_FAMILIES.values()))}")
