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
* builds the block-diagonal attention mask for hybrids whose mask construction ignores ``position_ids``;
* for MoE models whose top-level forward hands its ``attention_mask`` to the router load-balancing loss (spec
  option ``router_loss_mask``), hands it the ``[B, T]`` mask of the real tokens instead (the pad tail of
  ``DataCollatorForPackedSSM``'s ``real_token_mask`` and trailing pads are 0); the inner model's own hook
  drops it again, as for any packed call.
"""

from __future__ import annotations

import torch
from torch import nn

from .._config import text_config_value
from .._state import hooked, module_state, state_of
from .._tracing import device_check, kwarg, require, size_in, tracing
from ..cache import (
    CACHE_NAMES,
    CachePreHook,
    cache_argument,
    cache_from_kwargs,
    cache_post_hook,
    expect_count,
    needs_token_count,
    output_cache,
    settle_count,
)
from ..context import CallContext, current_context, enter_call, exit_call
from ..layout.boundaries import mark_valid_seq_idx, packing_positions
from ..layout.masks import has_holes, pads_before_real
from ..layout.normalize import (
    multi_sequence,
    normalize_boundaries,
    position_ids_from_seq_idx,
    restarts_at_real_tokens,
)
from ..serving.manager import SafepadContinuousBatching
from ..serving.paged_cache import SafepadPagedCache
from .attention import sync_upcast_sdpa, upcast_needed
from .attention_masks import packed_mask_mapping
from .cache_rows import cover_row_ops
from .checkpoint import hook_checkpoint_functions
from .entry import name_arguments, read_call, refuse_empty_call, two_d_mask
from .frames import boundaries_of_enclosing_call, check_enclosing_call_at_trace
from .generate import SafepadCompiledCall, SafepadGenerate, SafepadPrepareInputs
from .plan import ModelPlan, _pretrained_model_class, plan_for
from .slot_calls import slot_justify
from .slot_record import _arange_positions, _cache_wanted, _mask_positions, _mrope, _past_length, slot_restore
from .traced_slot_calls import traced_slot_step

__all__ = ["REAL_TOKEN_MASK", "ModelPlan", "install_model_hooks", "plan_for"]

#: Batch key of ``DataCollatorForPackedSSM``'s ``[B, T]`` real-token mask (0 on the pad tail); consumed here.
REAL_TOKEN_MASK = "real_token_mask"


def install_model_hooks(model: nn.Module) -> None:
    PreTrainedModel = _pretrained_model_class()
    targets = [model] + [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel)]
    for target in targets:
        if hooked(target):
            continue
        specs = [m._safepad_spec for m in target.modules() if getattr(m, "_safepad_spec", None) is not None]
        if not specs:
            continue
        plan = plan_for(target, specs)
        state = module_state(target)
        pre = target.register_forward_pre_hook(_ModelPreHook(plan), with_kwargs=True)
        post = target.register_forward_hook(_post_hook, always_call=True)
        state.hook_handles = [pre, post]
        # a cache without attention layers cannot tell its length in transformers: safepad counts it
        # (safepad.cache); registered after _ModelPreHook, so it sees the packed-call policy's use_cache
        recurrent = needs_token_count(target)
        if recurrent:
            state.cache_calls = []
            cache_pre = target.register_forward_pre_hook(
                CachePreHook(cache_argument(target.forward), recurrent), with_kwargs=True
            )
            cache_post = target.register_forward_hook(cache_post_hook, always_call=True)
            state.hook_handles += [cache_pre, cache_post]
        # generate() re-feeds the whole sequence to a recurrent-only cache: feed only what it has not read; and for
        # every cache, keep on it what it has read, so a reused one raises instead of continuing from other tokens
        if callable(getattr(type(target), "generate", None)) and "generate" not in target.__dict__:
            target.generate = SafepadGenerate(target, track=recurrent)
        if callable(getattr(type(target), "get_compiled_call", None)):
            # transformers compiles model.__call__ for generate's decode steps, whose hooks dynamo then compiles as
            # frames of their own: compile a call from safepad's frame, one frame with the hooks (SafepadCompiledCall)
            target.__dict__.setdefault("get_compiled_call", SafepadCompiledCall(target))
        if callable(getattr(type(target), "init_continuous_batching", None)):
            # generate_batch / the continuous-batching manager: paged attention plus a recurrent-state slot per request
            target.__dict__.setdefault("init_continuous_batching", SafepadContinuousBatching(target))
        if callable(getattr(type(target), "prepare_inputs_for_generation", None)):
            # (and refuses right-padded prompts where generate builds the mask itself: safepad.cache)
            target.__dict__.setdefault("prepare_inputs_for_generation", SafepadPrepareInputs(target))


def _text_config(module: nn.Module):
    config = getattr(module, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _serving_step(kwargs: dict, ids):
    """The step a continuous-batching call's :class:`~safepad.serving.SafepadPagedCache` laid out, or None."""
    if tracing():
        return None
    cache = cache_from_kwargs(kwargs)[1]
    if not isinstance(cache, SafepadPagedCache):
        return None
    if ids is None or ids.dim() < 2 or ids.shape[0] != 1:
        raise ValueError("a continuous-batching step is one packed row [1, T] of input_ids or inputs_embeds")
    return cache.take_step(int(ids.shape[1]), ids.device)


def _first_tensor(args, kwargs, names: tuple[str, ...], params: tuple[str, ...]):
    for n in names:
        v = kwarg(kwargs, n)
        if isinstance(v, torch.Tensor):
            return v
    for i, a in enumerate(args):
        if i < len(params) and params[i] in names and isinstance(a, torch.Tensor):
            return a
    return None


class _ModelPreHook:
    """Forward pre-hook of a wrapped model: boundaries -> context, cache policy, attention boundaries.

    One body for eager and traced calls (``torch.compile``): every check goes through
    :func:`safepad._tracing.require` (eager: raised on the host; traced: checked on the device). The steps that need
    the host are explicit ``if not tracing()`` branches: the cache's batch size and generate's record of it, slot
    justification (:mod:`safepad.wrap.slot_calls`), whether an all-ones mask carries padding, and the boundaries of
    the enclosing module call (:mod:`safepad.wrap.frames`). While tracing, every decision comes from what is static:

    * given boundaries (``seq_idx`` / ``cu_seq_lens_*``, or 2-D ``position_ids`` without a 2-D mask) run the
      varlen path, whether or not a row really holds several sequences (same result). A 2-D mask next to
      ``seq_idx`` / ``cu_seq_lens`` must be right-padded (checked); its pads become a segment of their own and
      it is dropped, as eager does for packed rows;
    * an explicitly requested cache keeps the unpacked path and checks on the device that no row holds
      several sequences (the eager error); without one the call runs with ``use_cache=False``;
    * ``position_ids`` next to a 2-D mask are not read as packing; the device checks that they do not
      restart at 0 after a row's first real token (eager would read them as packed rows);
    * a 2-D mask on a one-token step always travels to the mixers (rows marked real are unaffected).

    A class (not a closure) so that a wrapped model can be pickled.
    """

    def __init__(self, plan: ModelPlan):
        self.plan = plan

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        plan = self.plan
        params = plan.params
        module._safepad.slot_calls.append(None)
        # model(ids, mask) reads as model(input_ids=ids, attention_mask=mask) from here on (safepad.wrap.entry)
        args, kwargs = name_arguments(plan.positional, args, kwargs)
        ids = _first_tensor(args, kwargs, ("input_ids", "inputs_embeds"), params)
        real = kwargs.pop(REAL_TOKEN_MASK) if kwarg(kwargs, REAL_TOKEN_MASK) is not None else None
        outer = current_context()
        if outer is not None:
            # nested model call (PEFT -> model, VLM -> language model): the outer call decided the boundaries;
            # this level only applies the packed-call policy to its own kwargs
            # seq_idx.shape, not outer.shape: under torch.compile(dynamic=True) the latter holds the ints the
            # outer compiled frame ran with, and comparing with them would specialise the sequence length
            if outer.seq_idx is not None and ids is not None and tuple(ids.shape[:2]) == tuple(outer.seq_idx.shape):
                kwargs.pop("seq_idx", None)
                self._packed_policy(module, kwargs, outer.seq_idx, ids)
                module._safepad.tokens.append(None)
                return args, kwargs
            module._safepad.tokens.append(None)
            return None
        refuse_empty_call(module, ids)
        # "sdpa" <-> "safepad_sdpa" by this call's dtype / device (host facts; a no-op after the first call of each)
        sync_upcast_sdpa(plan.attention_configs, upcast_needed(module, ids))
        step = _serving_step(kwargs, ids)
        if step is not None:
            # a continuous-batching step (safepad.serving): the recurrent layers run each request's chunk from its
            # slot; the attention layers read the paged cache as the call hands it to them, untouched
            ctx = CallContext(None, tuple(ids.shape[:2]), "serving", serving=step)
            for group in step.groups:  # rows right-padded by construction: no host read of their mask
                if group.mask is not None:
                    ctx.layouts[(id(group.mask), (group.n, group.L))] = (group.mask, group.mask, None)
            module._safepad.tokens.append(enter_call(ctx))
            masks = kwargs.get("attention_mask")
            if isinstance(masks, dict):
                # one mask per attention type (a model with full and sliding layers): the model looks every layer's
                # type up in it, recurrent ones too, whose mixers take the step's rows instead (None here)
                layer_types = getattr(_text_config(module), "layer_types", None) or ()
                kwargs["attention_mask"] = {**dict.fromkeys(layer_types), **masks}
                return args, kwargs
            return None
        if module.training:
            hook_checkpoint_functions(plan.checkpointed)
        if ids is None or ids.dim() < 2:
            module._safepad.tokens.append(None)
            return None
        facts = read_call(module, kwargs, ids)  # every check of the call's arguments, once (safepad.wrap.entry)
        traced, cache, generated = facts.traced, facts.cache, facts.generated
        B, T = facts.shape
        token_mask = None
        if traced:
            # a call with the full-length mask re-lays a cache an eager call re-laid on the device, as eager calls do
            # ([B, T] token mask, a chunk reordered pads first); any other call on such a cache raises
            # (traced_slot_calls.check_traced_cache)
            token_mask = traced_slot_step(module, plan, kwargs, B, T)
        else:
            past = facts.past  # (the cache's length, read once per call: safepad.wrap.entry)
            # cached calls with padding after real tokens keep every cache row [pads | real tokens] (any family)
            args, kwargs = slot_justify(module, plan, args, kwargs, B, T, past, facts.real)
            T = _first_tensor(args, kwargs, ("input_ids", "inputs_embeds"), params).shape[1]  # generate's cut
            # a static cache's count after this call, known on the host (settled by the post-hook): no read next call
            module._safepad.counts[:] = [expect_count(cache, past, T)] if past is not None else []
            record = module._safepad.slot_calls[-1]
            # (generate's own step: [B, 1] all real, not read)
            token_mask = None if generated or record is None or record.call is None else record.call.token_mask
        mask = two_d_mask(kwargs.get("attention_mask")) if token_mask is None else token_mask
        mask2d = isinstance(mask, torch.Tensor) and mask.dim() == 2
        # eager only: an all-ones mask carries no padding (one host read); a one-token step keeps its 2-D mask unread
        # (no host sync; rows marked real are unaffected), as a traced call keeps every 2-D mask
        padding = mask2d and (traced or T == 1 or not bool(mask.all()))
        position_ids = kwargs.get("position_ids")
        position_ids = position_ids if isinstance(position_ids, torch.Tensor) else None
        explicit = any(isinstance(kwargs.get(k), torch.Tensor) for k in ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k"))
        # traced: position_ids next to a 2-D mask are not read as packing (checked below)
        positions_read = not (traced and mask2d and not explicit)
        seq_idx, source = normalize_boundaries(
            (B, T),
            seq_idx=kwargs.get("seq_idx"),
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
            cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
            position_ids=position_ids if positions_read else None,
            padding_mask=mask if padding else None,
        )
        if traced and not explicit and position_ids is None:
            check_enclosing_call_at_trace()  # run by dynamo at trace time, on the real Python stack
        elif not traced and source == "none":
            seq_idx, source = boundaries_of_enclosing_call(module, (B, T), position_ids, mask if padding else None)
        kwargs.pop("seq_idx", None)
        if not plan.var_kwargs:
            for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
                if k not in params:
                    kwargs.pop(k, None)
        cache_requested = kwargs.get("use_cache") is True or any(kwarg(kwargs, k) is not None for k in CACHE_NAMES)
        if seq_idx is not None and cache_requested:
            # eager: seq_idx holds several sequences in some row (raises); traced: checked on the device
            _require_no_packed_cache(~multi_sequence(seq_idx), source)
            seq_idx = None  # every row holds one sequence (checked): the unpacked path
        elif seq_idx is not None:
            if padding:
                seq_idx = _trailing_pads_as_segment(seq_idx, mask[:, -T:].to(torch.bool), source)
            self._packed_policy(module, kwargs, seq_idx, ids)
            self._router_loss_mask(module, kwargs, real, mask[:, -T:] if padding else None, (B, T))
        elif not positions_read and T > 1 and (pos := packing_positions(position_ids, (B, T))) is not None:
            # traced only (eager read them above): position_ids [B, T] restarting at real tokens would be packing
            device_check(
                ~restarts_at_real_tokens(pos, mask[:, -T:]).any(),
                "position_ids restart at 0 inside a row next to an attention_mask: under torch.compile give packed "
                "rows seq_idx / cu_seq_lens_q, or no mask (docs/limits.md, check D2)",
            )
        if not traced and plan.hybrid and T > 1:  # (one token: no pair of positions to read segments from)
            _check_attention_segments(module, kwargs, seq_idx, mask[:, -T:] if padding else None, (B, T))
        if traced and seq_idx is None:  # eager: slot_justify gave the cached call its positions
            _traced_cache_positions(module, plan, args, kwargs, T, two_d_mask(kwargs.get("attention_mask")), ids)
        # [B, 1]: a pad step token (unknown on the host outside generate: the mixers hold such rows' states)
        decode_mask = _step_token_mask(mask, facts) if T == 1 and mask2d and not generated else None
        padding_mask = mask if padding and seq_idx is None and not generated else None
        token = enter_call(
            CallContext(
                seq_idx=seq_idx, shape=(B, T), source=source, decode_mask=decode_mask, padding_mask=padding_mask,
                token_mask=token_mask,
            )
        )
        module._safepad.tokens.append(token)
        return args, kwargs

    def _packed_policy(self, module: nn.Module, kwargs: dict, seq_idx: torch.Tensor, ids: torch.Tensor) -> None:
        """Cache off, restarting position_ids and packed masks for hybrids (a requested cache raised before)."""
        plan = self.plan
        if "use_cache" in plan.params or plan.var_kwargs:
            kwargs["use_cache"] = False  # the config default would build a cache nobody can use
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() in (2, 4):
            # an all-ones mask carries no padding, but transformers detects packing from position_ids only
            # when no 2-D mask is given: drop it so that attention layers see the boundaries. A 4-D mask here is a
            # plain causal one (check_four_d_mask refuses any other, on the device while tracing): it carries no
            # boundaries either, and kept it would hand attention one sequence per row while the recurrent layers
            # read the packing
            kwargs["attention_mask"] = None
        if plan.hybrid and kwargs.get("position_ids") is None and plan.accepts_position_ids:
            kwargs["position_ids"] = position_ids_from_seq_idx(seq_idx).to(ids.device)
        elif plan.hybrid and isinstance(rope := kwargs.get("position_ids"), torch.Tensor) and rope.dim() == 3:
            rows = plan.text_position_rows
            if rows is None:
                raise ValueError(
                    f"position_ids of shape {list(rope.shape)} (several RoPE rows) on a packed call of "
                    f"{type(module).__name__}, whose forward reads [batch, seqlen] position_ids only: its attention "
                    "mask cannot read the boundaries from them. Pass position_ids of shape [batch, seqlen] that "
                    "restart at 0 per sequence (or seq_idx / cu_seq_lens_q without position_ids)."
                )
            if not size_in(rope.shape[0], rows):
                # RoPE rows without a text row ([3, B, T], or [1, B, T] where it is not read as text): these models
                # build their attention mask from a [4, B, T]'s row 0 only, so give them one restarting per sequence
                text = position_ids_from_seq_idx(seq_idx).to(device=rope.device, dtype=rope.dtype)  # [B, T]
                kwargs["position_ids"] = torch.cat([text[None], rope.expand(3, *text.shape)])  # [4, B, T]
        if plan.packed_attention_mask and "attention_mask" in plan.params:
            if kwargs.get("attention_mask") is None:
                kwargs["attention_mask"] = packed_mask_mapping(module, seq_idx, plan.packed_attention_mask)


    def _router_loss_mask(self, module: nn.Module, kwargs: dict, real, pads, shape: tuple[int, int]) -> None:
        """A packed top-level call of a model whose forward gives ``attention_mask`` to its router load-balancing
        loss: hand it the ``[B, T]`` real-token mask (``real`` from the collator, and ``pads``, a 2-D padding mask,
        both ``[B, T]`` or None), so that the pad tail stays out of that loss, as it stays out of the LM loss. The
        inner model's hook drops the mask again (packed attention reads the boundaries). Without either mask
        the loss gets no mask (every token is real), never the packed attention-mask mapping."""
        if not self.plan.router_loss_mask:
            return
        requested = kwargs.get("output_router_logits")
        if not (requested if requested is not None else text_config_value(module, "output_router_logits", False)):
            return
        keep = None
        for m in (real, pads):
            if m is None:
                continue
            if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(shape):
                got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
                raise ValueError(
                    f"{REAL_TOKEN_MASK} must be a [batch, seqlen] = {list(shape)} tensor (1 on real tokens, 0 on the "
                    f"pad tail), as DataCollatorForPackedSSM emits it; got {got}"
                )
            m = m.to(torch.bool)
            keep = m if keep is None else keep & m.to(keep.device)
        kwargs["attention_mask"] = None if keep is None else keep.to(torch.long)


def _step_token_mask(mask: torch.Tensor, facts) -> torch.Tensor:
    """``[B, 1]`` bool: a one-token call's last mask column (``mask`` ``[B, M]``), taken from the bool copy the
    value check made when ``mask`` is the caller's (:class:`~safepad.wrap.entry.CallFacts`), as it is when it is
    a bool ``[B, 1]`` already (a re-laid step's token mask)."""
    if mask.dtype == torch.bool and mask.shape[1] == 1:
        return mask
    if mask is facts.mask and facts.real is not None:
        mask = facts.real
    return mask[:, -1:].to(torch.bool)


def _require_no_packed_cache(ok: torch.Tensor | bool, source: str) -> None:
    """A call that asks for a cache must not hold packed rows: ``ok`` False (eager: the rows are packed) raises, a
    ``[]`` bool tensor (traced: no row holds several sequences) is checked on the device
    (:func:`safepad._tracing.require`). The one copy of the message."""
    require(
        ok,
        f"packed rows (several sequences per row, from {source}) cannot be used with a cache: the cache keeps one "
        "recurrent state per row, so there is no right state to store. Call with use_cache=False, or pad the "
        "sequences (left or right) instead of packing them.",
        f"packed rows (from {source}) cannot be used with a cache (one state per row): call with use_cache=False, "
        "or pad instead of packing (docs/limits.md, check D3)",
    )


def _traced_cache_positions(module: nn.Module, plan: ModelPlan, args: tuple, kwargs: dict, T: int, mask, ids) -> None:
    """While dynamo traces a cached call without ``position_ids``: each token's real position, as eager gives it.

    The eager hook (``slot_calls``) gives a cached call without ``position_ids`` the row's cached real tokens plus
    ``cumsum(mask) - 1`` over the chunk (``cache length + arange(T)`` without a mask), so that padded rows and
    families that restart their rotary positions on every call (Bamba in transformers 5.24) decode right. Traced,
    the same positions come from the mask on the device: ``cumsum(mask) - 1`` over the given mask ``[B, M]``, its
    last ``T`` columns, plus the cached tokens the mask does not cover (``cache length + T - M``). Sets
    ``kwargs["position_ids"]`` ``[B, T]`` in place; nothing for uncached calls, training calls with only the
    config's cache, models without ``position_ids`` or with multimodal rotary positions.
    """
    params = plan.params
    cache = cache_from_kwargs(kwargs)[1]
    uncached = not _cache_wanted(module, cache, kwargs.get("use_cache"))[2]  # no cache, or one nobody reads
    if uncached:  # with or without the caller's position_ids: slots, not positions, are what such models count
        _traced_refuse_slot_holes(module, plan, T, mask, ids)
    if not plan.accepts_position_ids or _first_tensor(args, kwargs, ("position_ids",), params) is not None:
        return
    if "position_ids" in params[: len(args)] or _mrope(module):
        return
    if uncached:
        _traced_hole_positions(module, plan, kwargs, T, mask, ids)
        return
    past = _past_length(cache, traced=True)  # an int, or a symbolic size while traced (no host read)
    # the eager hook's positions (slot_calls._with_cache_positions, _decode_step), the same helpers
    if mask is None:
        kwargs["position_ids"] = _arange_positions(past, ids.shape[0], T, ids.device)  # [B, T]
        return
    kwargs["position_ids"] = _mask_positions(mask.to(device=ids.device, dtype=torch.long), T, past)  # [B, T]


def _traced_hole_positions(module: nn.Module, plan: ModelPlan, kwargs: dict, T: int, mask, ids: torch.Tensor) -> None:
    """While dynamo traces an uncached call of a hybrid: what the eager re-lay of rows with holes gives.

    Eager (``slot_calls``) re-lays an uncached call whose rows have a pad between real tokens (a hole), so that
    attention counts real tokens only: positions ``cumsum(mask) - 1`` when none are given. Traced, the same
    positions come from the mask ``[B, T]`` on the device whenever some row has a hole, or (hybrids) a left pad
    (otherwise rows keep ``arange(T)``, as eager leaves them). A family whose attention counts slots (sliding
    windows, slot distances) would also need the re-lay itself, which a traced call cannot do: a hole there raises
    on the device.
    """
    if mask is None or T < 2 or mask.shape[1] != T or not (plan.hybrid or plan.slot_distances):
        return
    m = mask.to(device=ids.device, dtype=torch.bool)  # [B, T]
    holes = has_holes(m).any()  # [] bool
    arange = torch.arange(T, device=ids.device).expand(m.shape[0], T)  # [B, T]
    if plan.hybrid:  # left pads too, as eager (slot_calls._with_real_positions): the rollout's positions
        holes = holes | pads_before_real(m).any()
    # eager's positions (slot_calls._with_real_positions, the same helper) where eager gives them
    kwargs["position_ids"] = torch.where(holes, _mask_positions(m, T), arange)  # [B, T]


def _traced_refuse_slot_holes(module: nn.Module, plan: ModelPlan, T: int, mask, ids: torch.Tensor) -> None:
    """While dynamo traces an uncached call of a family whose attention counts slots (a sliding window, slot
    distances, slot log scaling): a row with a hole (a pad between real tokens) needs the eager re-lay, which a
    traced call cannot do, whether or not the caller passes ``position_ids``: raise on the device.
    ``mask`` ``[B, T]``."""
    if mask is None or T < 2 or mask.shape[1] != T or not plan.slot_sensitive:
        return
    device_check(
        ~has_holes(mask.to(device=ids.device, dtype=torch.bool)).any(),
        f"{type(module).__name__} under torch.compile: attention_mask has a pad between real tokens, which a traced "
        "call cannot re-lay; pad each row on one side, or call eagerly (docs/limits.md, check D4)",
    )


def _check_attention_segments(module: nn.Module, kwargs: dict, seq_idx, real, shape: tuple[int, int]) -> None:
    """An eager call of a hybrid whose attention mask transformers will build from ``position_ids`` (no mask, no
    cache reaches the model: ``masking_utils.find_packed_sequence_indices``, a new sequence wherever a position is not
    the previous one plus 1) must read the same sequences as the recurrent layers (``seq_idx`` ``[B, T]``, None: one
    per row; a new one at each 0 after a row's first real token, or the given boundaries). Where the two readings
    differ at real tokens (``real`` ``[B, T]`` bool, None: every token), e.g. positions ``[-1, 0, 1]`` (attention: one
    sequence; recurrent layers: two) or ``[0, 1, 5, 6]`` (the reverse), the result would match neither: raise
    naming the row, the column and the fix. One host read, only for such calls."""
    pos = kwargs.get("position_ids")
    if kwargs.get("attention_mask") is not None or not isinstance(pos, torch.Tensor) or pos.dim() != 2:
        return
    B, T = shape
    if T < 2 or pos.shape[1] != T or not size_in(pos.shape[0], (1, B)):
        return
    cache = cache_from_kwargs(kwargs)[1]
    if cache is not None or _cache_wanted(module, cache, kwargs.get("use_cache"))[1]:
        return  # a cache reaches create_causal_mask: transformers reads no packing from the positions
    pos = pos.expand(B, T)
    attention = (pos[:, 1:] - pos[:, :-1]) != 1  # [B, T - 1]: a new sequence at column t + 1 (transformers)
    if seq_idx is None:
        recurrent = torch.zeros_like(attention)
    else:
        s = seq_idx.to(pos.device)
        recurrent = s[:, 1:] != s[:, :-1]
    differ = attention != recurrent
    if real is not None:
        r = real.to(device=pos.device, dtype=torch.bool)
        differ &= r[:, 1:] & r[:, :-1]
    if not bool(differ.any()):
        return
    row, col = (int(i) for i in differ.nonzero()[0])
    was, now = int(pos[row, col]), int(pos[row, col + 1])
    reading = "a new sequence" if bool(recurrent[row, col]) else "the same sequence"
    raise ValueError(
        f"{type(module).__name__}: position_ids[{row}] go from {was} to {now} at column {col + 1}, which safepad's "
        f"recurrent layers read as {reading} (a new sequence starts at each 0 after a row's first real token, or at "
        "the given seq_idx / cu_seq_lens boundaries) but this hybrid's attention layers read otherwise (transformers "
        "starts a new sequence wherever a position is not the previous one plus 1): the result would match neither "
        "reading. Give each sequence positions 0, 1, 2, ... (restarting at 0 at each new sequence), or pass "
        "seq_idx / cu_seq_lens_q with such position_ids (or none; safepad derives them)."
    )


def _trailing_pads_as_segment(seq_idx: torch.Tensor, mask: torch.Tensor, source: str) -> torch.Tensor:
    """Packed rows followed by padding: the pads (``mask`` ``[B, T]`` False) become a segment of their own.

    Trailing pads come after every real token of their row, so in a causal model they can change no real
    token's output; as their own segment they also start from a fresh state. The attention mask is then
    dropped (packed calls carry their boundaries in ``seq_idx`` / ``position_ids``). Pads before or between
    the packed sequences of a row have no such reading: raise (eager: ``ValueError``; traced: checked on the device).
    One body for eager and traced calls.
    """
    require(
        ~pads_before_real(mask).any(),
        f"packed boundaries ({source}) came together with an attention_mask that has padding before or between real "
        "tokens in a row; packed rows may only end in padding (under torch.compile this holds for rows of one "
        f"sequence with {source} too). Put the pads at the end of each row (the safepad collator packs without any), "
        "or pad one sequence per row without packing boundaries.",
        f"boundaries from {source} next to an attention_mask with pads before or between real tokens: packed rows "
        "may only end in padding (docs/limits.md, check D5)",
    )
    out = torch.where(mask, seq_idx, seq_idx.amax(dim=1, keepdim=True) + 1).to(torch.int32)  # [B, T]
    if tracing():
        return out
    return mark_valid_seq_idx(out, multi_sequence=True)  # non-decreasing: a valid seq_idx, trailing pads added


def _post_hook(module: nn.Module, args, output):
    state = state_of(module)
    if state is not None and state.counts and not tracing():
        settle_count(state.counts.pop())
    if isinstance(output, tuple):  # return_dict=False: the cache is an element
        for value in output:
            cover_row_ops(value if hasattr(value, "layers") else None)
    elif output is not None:
        cover_row_ops(output_cache(output))  # a cache built inside the forward: its row operations too
    tokens = state.tokens if state is not None else None
    if tokens:
        token = tokens.pop()
        if token is not None:
            exit_call(token)
    slot_calls = state.slot_calls if state is not None else None
    if slot_calls:
        record = slot_calls.pop()
        if record is not None:
            return slot_restore(record, output, module)
    return None
