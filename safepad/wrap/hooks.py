"""The model-level hooks of a wrapped model: boundaries -> call context, cache policy for packed calls,
attention boundaries for hybrids.

A forward pre-hook on the model (and on every ``PreTrainedModel`` inside it that holds patched mixers)
normalises packed boundaries once per call (``seq_idx``, ``cu_seq_lens_q/k``, or ``position_ids`` that
restart at 0) and hands them to the mixers through the call context (``safepad.context``), because several
families drop ``**kwargs`` before their mixers. On packed calls it also:

* raises when a cache was explicitly requested (``use_cache=True`` or a cache passed): the cache holds
  one state per row, and a packed row holds several sequences;
* turns off the cache that would come only from the config default (so a Trainer step works);
* synthesises ``position_ids`` that restart at each boundary for hybrids, so their attention layers see
  the boundaries too (transformers detects packing from ``position_ids``);
* builds the block-diagonal attention mask for hybrids whose mask construction ignores ``position_ids``.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .._tracing import device_check, tracing
from ..cache import (
    CACHE_NAMES,
    CachePreHook,
    SafepadGenerate,
    SafepadPrepareInputs,
    cache_argument,
    cache_from_kwargs,
    cache_post_hook,
    fresh_cache_is_recurrent_only,
    needs_token_count,
)
from ..context import CallContext, current_context, enter_call, exit_call
from ..layout.boundaries import mark_valid_seq_idx, packing_positions
from ..layout.masks import check_mask_values, pads_before_real
from ..layout.normalize import (
    multi_sequence,
    normalize_boundaries,
    position_ids_from_seq_idx,
    restarts_at_real_tokens,
)
from .attention_masks import packed_mask_mapping
from .checkpoint import hook_checkpoint_functions
from .cache_rows import check_cache_rows
from .frames import BOUNDARY_INPUTS, boundaries_of_enclosing_call, check_enclosing_call_at_trace
from .slot_calls import check_traced_cache, counts_slots, slot_justify, slot_restore

__all__ = ["install_model_hooks"]


def install_model_hooks(model: nn.Module) -> None:
    try:
        from transformers import PreTrainedModel
    except Exception:  # noqa: BLE001
        PreTrainedModel = ()  # type: ignore[assignment]
    targets = [model] + [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel)]
    for target in targets:
        if "_safepad_hook_handles" in target.__dict__:
            continue
        specs = [m._safepad_spec for m in target.modules() if getattr(m, "_safepad_spec", None) is not None]
        if not specs:
            continue
        params = inspect.signature(target.forward).parameters
        info = {
            "accepts_position_ids": "position_ids" in params,
            "var_kwargs": any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()),
            "params": tuple(params),
            "hybrid": any(s.hybrid for s in specs),
            "packed_attention_mask": tuple(sorted({k for s in specs for k in s.packed_attention_mask})),
            # a spec's refusals of slot layouts its attention cannot serve (Inkling's log scaling)
            "slot_checks": tuple(dict.fromkeys(s.options["slot_check"] for s in specs if "slot_check" in s.options)),
            # attention that counts cache slots (sliding windows, slot-relative positions, selected key slots):
            # its one-token steps always go through slot justification (safepad.wrap.slot_calls)
            "slot_sensitive": counts_slots(target, specs),
            # text models that read row 0 of [R, B, T] position_ids as their text positions, for these R
            # (Qwen3.5: 4; Qwen4-Exp: 4 and 1); None: the model reads [B, T] position_ids only
            "text_position_rows": next(
                (s.options["text_position_rows"] for s in specs if "text_position_rows" in s.options), None
            ),
            # a spec whose attention reads slot distances: calls without a cache on rows with holes are re-laid too
            "slot_distances": any(s.options.get("slot_distances", False) for s in specs),
            # modules that transformers may give a checkpoint function (GradientCheckpointingLayer, base models)
            "checkpointed": [m for m in target.modules() if hasattr(m, "gradient_checkpointing")],
        }
        target._safepad_tokens = []
        target._safepad_slot_calls = []
        pre = target.register_forward_pre_hook(_ModelPreHook(info), with_kwargs=True)
        post = target.register_forward_hook(_post_hook, always_call=True)
        target._safepad_hook_handles = [pre, post]
        # a cache without attention layers cannot tell its length in transformers: safepad counts it
        # (safepad.cache); registered after _ModelPreHook, so it sees the packed-call policy's use_cache
        recurrent = needs_token_count(target)
        if recurrent:
            target._safepad_cache_calls = []
            cache_pre = target.register_forward_pre_hook(
                CachePreHook(cache_argument(target.forward), recurrent), with_kwargs=True
            )
            cache_post = target.register_forward_hook(cache_post_hook, always_call=True)
            target._safepad_hook_handles += [cache_pre, cache_post]
        if fresh_cache_is_recurrent_only(getattr(target, "config", None)):
            # generate() re-feeds the whole sequence to a recurrent-only cache: feed only what it has not read
            if callable(getattr(type(target), "generate", None)) and "generate" not in target.__dict__:
                target.generate = SafepadGenerate(target, track=recurrent)
        if callable(getattr(type(target), "prepare_inputs_for_generation", None)):
            # (and refuses right-padded prompts where generate builds the mask itself: safepad.cache)
            target.__dict__.setdefault("prepare_inputs_for_generation", SafepadPrepareInputs(target))


def _first_tensor(args, kwargs, names: tuple[str, ...], params: tuple[str, ...]):
    for n in names:
        v = kwargs.get(n)
        if isinstance(v, torch.Tensor):
            return v
    for i, a in enumerate(args):
        if i < len(params) and params[i] in names and isinstance(a, torch.Tensor):
            return a
    return None


class _ModelPreHook:
    """Forward pre-hook of a wrapped model: boundaries -> context, cache policy, attention boundaries.

    A class (not a closure) so that a wrapped model can be pickled.
    """

    def __init__(self, info: dict):
        self.info = info

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        info = self.info
        params = info["params"]
        module._safepad_slot_calls.append(None)
        ids = _first_tensor(args, kwargs, ("input_ids", "inputs_embeds"), params)
        outer = current_context()
        if outer is not None:
            # nested model call (PEFT -> model, VLM -> language model): the outer call decided the boundaries;
            # this level only applies the packed-call policy to its own kwargs
            # seq_idx.shape, not outer.shape: under torch.compile(dynamic=True) the latter holds the ints the
            # outer compiled frame ran with, and comparing with them would specialise the sequence length
            if outer.seq_idx is not None and ids is not None and tuple(ids.shape[:2]) == tuple(outer.seq_idx.shape):
                kwargs.pop("seq_idx", None)
                self._packed_policy(module, kwargs, outer.seq_idx, ids, outer.source, nested=True)
                module._safepad_tokens.append(None)
                return args, kwargs
            module._safepad_tokens.append(None)
            return None
        if module.training:
            hook_checkpoint_functions(info["checkpointed"])
        if ids is None or ids.dim() < 2:
            module._safepad_tokens.append(None)
            return None
        B, T = ids.shape[0], ids.shape[1]
        if tracing():
            return self._traced_call(module, args, kwargs, B, T, ids)
        check_cache_rows(cache_from_kwargs(kwargs)[1], B)  # a cache of another batch size: name it
        check_mask_values(_two_d_mask(kwargs.get("attention_mask")), on_device=T == 1)
        # cached calls with padding after real tokens keep every cache row [pads | real tokens] (any family)
        args, kwargs = slot_justify(module, info, args, kwargs, B, T)
        T = _first_tensor(args, kwargs, ("input_ids", "inputs_embeds"), params).shape[1]  # generate's cut (slot_calls)
        record = module._safepad_slot_calls[-1]
        token_mask = record.call.token_mask if record is not None and record.call is not None else None
        mask = _two_d_mask(kwargs.get("attention_mask")) if token_mask is None else token_mask
        # a one-token step keeps its 2-D mask unread (no host sync; rows marked real are unaffected), as under compile
        padding = isinstance(mask, torch.Tensor) and mask.dim() == 2 and (T == 1 or not bool(mask.all()))
        position_ids = kwargs.get("position_ids")
        seq_idx, source = normalize_boundaries(
            (B, T),
            seq_idx=kwargs.get("seq_idx"),
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
            cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
            position_ids=position_ids if isinstance(position_ids, torch.Tensor) else None,
            padding_mask=mask if padding else None,
        )
        if source == "none":
            seq_idx, source = boundaries_of_enclosing_call(module, (B, T), position_ids, mask if padding else None)
        kwargs.pop("seq_idx", None)
        if not info["var_kwargs"]:
            for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
                if k not in params:
                    kwargs.pop(k, None)
        if seq_idx is not None:
            if padding:
                seq_idx = _trailing_pads_as_segment(seq_idx, mask[:, -T:].to(torch.bool), source)
            self._packed_policy(module, kwargs, seq_idx, ids, source, nested=False)
        decode_mask = None
        if T == 1 and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            decode_mask = mask[:, -1:].to(torch.bool)  # [B, 1]: this step's token may be padding in some rows
        padding_mask = mask if padding and seq_idx is None else None
        token = enter_call(
            CallContext(
                seq_idx=seq_idx, shape=(B, T), source=source, decode_mask=decode_mask, padding_mask=padding_mask,
                token_mask=token_mask,
            )
        )
        module._safepad_tokens.append(token)
        return args, kwargs

    def _traced_call(self, module: nn.Module, args: tuple, kwargs: dict, B: int, T: int, ids: torch.Tensor):
        """The pre-hook while dynamo traces the call: every decision from what is static, checks on the device.

        * given boundaries (``seq_idx`` / ``cu_seq_lens_*``, or 2-D ``position_ids`` without a 2-D mask) run the
          varlen path, whether or not a row really holds several sequences (same result). A 2-D mask next to
          ``seq_idx`` / ``cu_seq_lens`` must be right-padded (checked); its pads become a segment of their own and
          it is dropped, as eager does for packed rows;
        * an explicitly requested cache keeps the unpacked path and checks on the device that no row holds
          several sequences (the eager error); without one the call runs with ``use_cache=False``;
        * ``position_ids`` next to a 2-D mask are not read as packing; the device checks that they do not
          restart at 0 after a row's first real token (eager would read them as packed rows);
        * a 2-D mask on a one-token step always travels to the mixers (rows marked real are unaffected).
        """
        info = self.info
        params = info["params"]
        if not any(isinstance(kwargs.get(k), torch.Tensor) for k in BOUNDARY_INPUTS):
            check_enclosing_call_at_trace()  # run by dynamo at trace time, on the real Python stack
        check_traced_cache(module, kwargs)  # a cache an eager call re-laid (slot_calls) cannot be read traced
        mask = kwargs.get("attention_mask")
        mask2d = isinstance(mask, torch.Tensor) and mask.dim() == 2
        position_ids = kwargs.get("position_ids")
        position_ids = position_ids if isinstance(position_ids, torch.Tensor) else None
        explicit = any(isinstance(kwargs.get(k), torch.Tensor) for k in ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k"))
        seq_idx, source = normalize_boundaries(
            (B, T),
            seq_idx=kwargs.get("seq_idx"),
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
            cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
            position_ids=position_ids if (explicit or not mask2d) else None,
            padding_mask=mask if (explicit and mask2d) else None,
        )
        kwargs.pop("seq_idx", None)
        if not info["var_kwargs"]:
            for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
                if k not in params:
                    kwargs.pop(k, None)
        cache_requested = kwargs.get("use_cache") is True or any(
            kwargs.get(k) is not None for k in ("past_key_values", "cache_params", "cache")
        )
        if seq_idx is not None and cache_requested:
            device_check(
                ~multi_sequence(seq_idx),
                f"packed rows (several sequences per row, from {source}) cannot be used with a cache: the cache "
                "keeps one recurrent state per row, so there is no right state to store. Call with "
                "use_cache=False, or pad the sequences (left or right) instead of packing them.",
            )
            seq_idx = None  # every row holds one sequence (checked): the unpacked path, as eager
        elif seq_idx is not None:
            if mask2d:
                m = mask[:, -T:].to(torch.bool)  # [B, T]
                device_check(
                    ~pads_before_real(m).any(),
                    f"packed boundaries ({source}) came together with an attention_mask that has padding before "
                    "or between real tokens; packed rows may only end in padding (under torch.compile this holds "
                    f"for rows of one sequence with {source} too). Put the pads at the end of each row, or pad "
                    "without packing boundaries.",
                )
                seq_idx = torch.where(m, seq_idx, seq_idx.amax(dim=1, keepdim=True) + 1).to(torch.int32)  # [B, T]
            self._packed_policy(module, kwargs, seq_idx, ids, source, nested=False)
        elif mask2d and T > 1 and (pos := packing_positions(position_ids, (B, T))) is not None:  # pos [B, T]
            m = mask[:, -T:].to(device=pos.device, dtype=torch.bool)  # [B, T]
            device_check(
                ~restarts_at_real_tokens(pos, m).any(),
                "position_ids restart at 0 inside a row (packed sequences) while an attention_mask is given: "
                "under torch.compile packed rows must describe their boundaries with seq_idx / cu_seq_lens_q "
                "when they come with an attention_mask (or come without one)",
            )
        decode_mask = mask[:, -1:].to(torch.bool) if T == 1 and mask2d else None  # [B, 1]
        padding_mask = mask if mask2d and seq_idx is None else None
        token = enter_call(
            CallContext(seq_idx=seq_idx, shape=(B, T), source=source, decode_mask=decode_mask, padding_mask=padding_mask)
        )
        module._safepad_tokens.append(token)
        return args, kwargs

    def _packed_policy(self, module: nn.Module, kwargs: dict, seq_idx: torch.Tensor, ids: torch.Tensor, source: str,
                       nested: bool) -> None:
        """Cache off (or raise if one was asked for), restarting position_ids and packed masks for hybrids."""
        info = self.info
        explicit = kwargs.get("use_cache") is True or any(kwargs.get(k) is not None for k in CACHE_NAMES)
        if explicit and not nested:
            raise ValueError(
                f"packed rows (several sequences per row, from {source}) cannot be used with a cache: the cache "
                "keeps one recurrent state per row, so there is no right state to store. Call with "
                "use_cache=False, or pad the sequences (left or right) instead of packing them."
            )
        if "use_cache" in info["params"] or info["var_kwargs"]:
            kwargs["use_cache"] = False  # the config default would build a cache nobody can use
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            # an all-ones mask carries no padding, but transformers detects packing from position_ids only
            # when no 2-D mask is given: drop it so that attention layers see the boundaries
            kwargs["attention_mask"] = None
        if info["hybrid"] and kwargs.get("position_ids") is None and info["accepts_position_ids"]:
            kwargs["position_ids"] = position_ids_from_seq_idx(seq_idx).to(ids.device)
        elif info["hybrid"] and isinstance(rope := kwargs.get("position_ids"), torch.Tensor) and rope.dim() == 3:
            rows = info["text_position_rows"]
            if rows is None:
                raise ValueError(
                    f"position_ids of shape {list(rope.shape)} (several RoPE rows) on a packed call of "
                    f"{type(module).__name__}, whose forward reads [batch, seqlen] position_ids only: its attention "
                    "mask cannot read the boundaries from them. Pass position_ids of shape [batch, seqlen] that "
                    "restart at 0 per sequence (or seq_idx / cu_seq_lens_q without position_ids)."
                )
            if rope.shape[0] not in rows:
                # RoPE rows without a text row ([3, B, T], or [1, B, T] where it is not read as text): these models
                # build their attention mask from a [4, B, T]'s row 0 only, so give them one restarting per sequence
                text = position_ids_from_seq_idx(seq_idx).to(device=rope.device, dtype=rope.dtype)  # [B, T]
                kwargs["position_ids"] = torch.cat([text[None], rope.expand(3, *text.shape)])  # [4, B, T]
        if info["packed_attention_mask"] and "attention_mask" in info["params"]:
            if kwargs.get("attention_mask") is None:
                kwargs["attention_mask"] = packed_mask_mapping(module, seq_idx, info["packed_attention_mask"])


def _two_d_mask(mask):
    """The 2-D ``[B, T]`` padding mask of a call's ``attention_mask``: generate() with a compileable cache (e.g. one
    without attention layers) hands in per-layer-type masks, whose recurrent layers' entry is the 2-D one."""
    if isinstance(mask, dict):
        return next((m for m in mask.values() if isinstance(m, torch.Tensor) and m.dim() == 2), None)
    return mask


def _trailing_pads_as_segment(seq_idx: torch.Tensor, mask: torch.Tensor, source: str) -> torch.Tensor:
    """Packed rows followed by padding: the pads (``mask`` ``[B, T]`` False) become a segment of their own.

    Trailing pads come after every real token of their row, so in a causal model they can change no real
    token's output; as their own segment they also start from a fresh state. The attention mask is then
    dropped (packed calls carry their boundaries in ``seq_idx`` / ``position_ids``). Pads before or between
    the packed sequences of a row have no such reading: raise.
    """
    bad_rows = pads_before_real(mask)  # [B]
    if bool(bad_rows.any()):
        row = int(bad_rows.nonzero()[0])
        raise ValueError(
            f"packed boundaries ({source}) came together with an attention_mask whose row {row} has padding before "
            "or between real tokens; packed rows may only end in padding. Put the pads at the end of each row (the "
            "safepad collator packs without any), or pad one sequence per row without packing boundaries."
        )
    out = torch.where(mask, seq_idx, seq_idx.amax(dim=1, keepdim=True) + 1).to(torch.int32)  # [B, T]
    return mark_valid_seq_idx(out, multi_sequence=True)  # non-decreasing: a valid seq_idx, trailing pads added


def _post_hook(module: nn.Module, args, output):
    tokens = module.__dict__.get("_safepad_tokens")
    if tokens:
        token = tokens.pop()
        if token is not None:
            exit_call(token)
    slot_calls = module.__dict__.get("_safepad_slot_calls")
    if slot_calls:
        record = slot_calls.pop()
        if record is not None:
            return slot_restore(record, output, module)
    return None
