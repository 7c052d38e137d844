"""The wrapped ``generate`` of a model whose cache safepad adapts (:mod:`safepad.cache`).

* :class:`SafepadGenerate` (``model.generate``): checks the caller's ``attention_mask`` values once on the host (so
  that its decode steps need no device check of theirs: :func:`mask_checked_by_generate`), hands ``generate`` a
  length-tracking cache, re-lays a right-padded
  prompt pads first when the cache is compileable or the forward compiled (:func:`_justified_prompt`, the caller's
  prompt goes back in the output, :func:`_with_caller_prompt`), keeps the ``rope_deltas`` a call left with the cache
  it returned, and drops transformers' right-padding warning while it runs;
* :class:`SafepadPrepareInputs` (``model.prepare_inputs_for_generation``): feeds a continued recurrent-only cache
  only the tokens it has not read, and refuses a cache whose history it cannot tell.

What a cache has read is kept on the cache itself (:mod:`safepad.cache`, ``_record``).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from typing import Any

import torch
from torch import Tensor

from ..cache import (
    _GEN_COUNTS,
    _RECORD_ATTR,
    _holds_states,
    _record,
    _state_versions,
    _TracksSeqLength,
    cache_argument,
    cache_from_kwargs,
    fresh_cache_is_recurrent_only,
    layer_token_count,
    new_tracked_cache,
    output_cache,
    recurrent_only,
    track_seq_length,
)
from ..layout.masks import check_mask_values, pads_after_real
from ..layout.slots import pads_first_order
from ..ops.prepared import keep_prepared
from .slot_record import _PADDED_FLAG, _RELAID_FLAG

logger = logging.getLogger(__name__)

__all__ = [
    "SafepadCompiledCall", "SafepadGenerate", "SafepadPrepareInputs", "generated_step", "mask_checked_by_generate",
]


def _tokens_read(cache: Any) -> int | None:
    """Tokens an untracked recurrent-only ``cache`` has read: 0 when it holds no state (new, or ``reset()``), its
    layers' own count where they keep one (transformers >= 5.25, whoever wrote the states), else the count a wrapped
    ``generate`` left when its states are those it left, ``None`` (unknown) otherwise."""
    if not _holds_states(cache):
        return 0
    own = layer_token_count(cache)
    if own is not None:
        return own
    rec = _record(cache)
    return None if rec is None else rec[0]


def _counted_length(cache: Any) -> int | None:
    """Tokens a cache that can count them (an attention layer, or safepad's count) says it holds; None if it cannot."""
    try:
        return int(cache.get_seq_length())
    except (ValueError, AttributeError, TypeError, RuntimeError):
        return None


def _check_continuation(model: Any, cache: Any, seq: Tensor, read: int) -> None:
    """The first forward of a ``generate`` handed a cache that has read ``read`` tokens and the full sequence
    ``seq`` ``[B, L]`` (``input_ids``, or ``inputs_embeds`` ``[B, L, D]``): the cache must hold a prefix of it.

    A cache is advanced in place by every call that reads it, so a second continuation from the same object (or a
    ``StaticCache`` reused for a new prompt without ``reset()``) would go on from states of other tokens, silently
    (stock transformers slices the sequence by the cache's length, or feeds it whole on top of the old states).
    """
    name = f"{type(model).__name__}.generate"
    fix = (
        "To continue twice from one point, pass copy.deepcopy(cache) to each continuation (a cache is advanced in "
        "place by every call that reads it); to start a new sequence, pass a new cache or call cache.reset() first."
    )
    L = int(seq.shape[1])
    if read >= L:
        raise ValueError(
            f"{name}: the cache has already read {read} tokens but the input sequence holds {L}, so its states are not "
            "those of a prefix of this sequence (a later generate() or forward continued from the same cache object, "
            f"or it served another prompt). {fix}"
        )
    rec = _record(cache)
    if rec is None or rec[0] != read or not isinstance(rec[1], Tensor) or seq.dim() != 2:
        return
    ids = rec[1]
    if tuple(ids.shape) != (seq.shape[0], read):
        return
    prompt = _GEN_PROMPT.get()
    if prompt is not None:  # generate runs on the prompt re-laid pads first; the record holds the caller's ids
        seq = _caller_columns(seq, *prompt)
    if not torch.equal(ids.to(seq.device), seq[:, :read]):
        raise ValueError(
            f"{name}: the cache holds the states of another sequence: the first {read} tokens it has read differ from "
            f"those of input_ids. {fix}"
        )


def _note_ids(entry: list, input_ids: Any) -> None:
    if isinstance(input_ids, Tensor) and input_ids.dim() == 2:
        entry[2] = input_ids


def _length_of(inputs: dict) -> int:
    x = inputs.get("input_ids")
    if not isinstance(x, Tensor):
        x = inputs.get("inputs_embeds")
    return int(x.shape[1]) if isinstance(x, Tensor) and x.dim() >= 2 else 0


def _refuse_built_mask_on_right_pads(model: Any, mask: Any, built: Any) -> None:
    """``generate`` with a compileable cache (``cache_implementation="static"``, compiled generation) hands the
    model a mask it built (4-D, or a dict of them) instead of the 2-D ``mask`` ``[B, L]``: safepad's slot
    justification, which keeps rows with padding after real tokens right, reads the 2-D mask only. Such a
    prompt (right padding) raises instead of generating from the caller's pads (stock is wrong there too)."""
    if not isinstance(mask, Tensor) or mask.dim() != 2 or built is None or built is mask:
        return
    if isinstance(built, Tensor) and built.dim() == 2:
        return
    m = mask.to(bool)
    if bool(pads_after_real(m).any()):
        raise ValueError(
            f"{type(model).__name__}.generate: the prompt has padding after real tokens (right padding), and with "
            "a static / compileable cache generate() builds the attention mask itself, so safepad cannot keep the "
            "padded rows right. Pass the attention_mask to generate() (the wrapped generate then lays such prompts "
            "pads first), pad prompts on the left (tokenizer.padding_side = 'left'), or generate with the default "
            "dynamic cache (no cache_implementation='static', no compile_config)."
        )


def _padding_mask_for_recurrent_only(cache: Any, inputs: dict) -> None:
    """A cache with no attention layer is compileable, so ``generate`` hands the model per-layer-type masks it built
    (a dict) instead of the 2-D padding mask. No attention layer reads them; the recurrent layers' entry is the 2-D
    mask ``[B, L]`` itself: pass that, so the wrapped model sees the padding (a right-padded prompt's rows are then
    re-laid as in any cached call, and generate reads each row's last real token)."""
    built = inputs.get("attention_mask")
    if cache is None or not isinstance(built, dict) or not recurrent_only(cache):
        return
    two_d = next((m for m in built.values() if isinstance(m, Tensor) and m.dim() == 2), None)
    if two_d is not None:
        inputs["attention_mask"] = two_d


class SafepadPrepareInputs:
    """``model.prepare_inputs_for_generation`` of a wrapped model whose fresh cache has no attention layer.

    transformers slices the tokens a cache has already read off the sequence ``generate`` is handed only for
    caches with an attention layer (``get_seq_length``); continuing from a returned recurrent-only cache, it
    feeds the whole sequence again, and safepad's mixers (which continue from the cache) would read the prompt
    twice. Inside a wrapped ``generate`` (:class:`SafepadGenerate`) this counts the tokens each forward feeds
    through the cache and, on the first forward of a ``generate`` that continues from a cache that an earlier
    wrapped ``generate`` left (its states unchanged since), feeds only the unseen suffix ``[B, L - n]`` and the
    mask's matching columns. A cache holding states of unknown history raises ``ValueError`` when the call
    would be ambiguous (``input_ids`` as long as the mask). From transformers 5.25 on, ``generate`` slices by the
    cache layers' own token count, which every cache has (whoever wrote it: no unknown history); the same checks
    (:func:`_check_continuation`) run on that count. Outside ``generate`` it is the class's own method.
    """

    def __init__(self, model: Any):
        self.model = model

    @property
    def __signature__(self) -> inspect.Signature:
        # generate() reads the method's parameters (e.g. whether it takes inputs_embeds): the class's, bound
        sig = inspect.signature(type(self.model).prepare_inputs_for_generation)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __call__(self, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        counts = _GEN_COUNTS.get()
        _, cache = cache_from_kwargs(kwargs)
        first = bool(kwargs.get("is_first_iteration"))
        seq = kwargs.get("inputs_embeds") if first else None
        seq = seq if isinstance(seq, Tensor) else input_ids
        mask = kwargs.get("attention_mask")
        # the whole sequence (not only the new tokens with the full mask, which stock also accepts)
        full = isinstance(seq, Tensor) and (mask is None or (isinstance(mask, Tensor) and mask.shape[-1] == seq.shape[1]))
        untracked = (
            counts is not None and cache is not None and not isinstance(cache, _TracksSeqLength) and recurrent_only(cache)
        )
        if not untracked:
            if first and full and cache is not None and kwargs.get("next_sequence_length") is not None:
                read = _counted_length(cache) if _holds_states(cache) or not recurrent_only(cache) else None
                if read:  # generate slices the sequence by this count
                    _check_continuation(model, cache, seq, read)
            if counts is not None and cache is not None:
                _note_ids(counts.setdefault(id(cache), [cache, None, None]), input_ids)
            inputs = type(model).prepare_inputs_for_generation(model, input_ids, *args, **kwargs)
            _padding_mask_for_recurrent_only(cache, inputs)
            if first:
                _refuse_built_mask_on_right_pads(model, kwargs.get("attention_mask"), inputs.get("attention_mask"))
            return inputs
        entry = counts.setdefault(id(cache), [cache, _tokens_read(cache), None])
        read, drop = entry[1], 0
        # generate's prefill: before 5.25 it hands a recurrent-only cache the whole sequence (no next_sequence_length);
        # from 5.25 on it slices by the layers' own count (next_sequence_length = L - count, unchecked: a count >= L
        # feeds a wrong slice, all of the sequence or its tail past the excess), so the same checks run on that count
        # and the slice is set here, as an int
        prefill = kwargs.get("next_sequence_length") is None or layer_token_count(cache) is not None
        if first and prefill and full and _holds_states(cache):
            if read is None:
                raise ValueError(
                    f"{type(model).__name__}.generate: the cache holds recurrent states that no wrapped generate() "
                    "left as they are (a plain forward, an unwrapped model or a later call wrote them), so safepad "
                    "cannot tell which of the input tokens it has already read, and reading them again would be "
                    "wrong. Pass the cache the wrapped model's last generate(return_dict_in_generate=True) returned, "
                    "together with its full sequences (copy.deepcopy(cache) first to continue twice from it); or call "
                    "the model's forward with only the new tokens."
                )
            _check_continuation(model, cache, seq, read)
            drop = read
            kwargs["next_sequence_length"] = int(seq.shape[1]) - read
        _note_ids(entry, input_ids)
        inputs = type(model).prepare_inputs_for_generation(model, input_ids, *args, **kwargs)
        if first:
            _refuse_built_mask_on_right_pads(model, kwargs.get("attention_mask"), inputs.get("attention_mask"))
        if drop:
            m = inputs.get("attention_mask")
            if isinstance(m, Tensor) and m.dim() == 2 and m.shape[1] == seq.shape[1]:
                inputs["attention_mask"] = m[:, drop:]  # a recurrent-only model reads the mask of its inputs only
        if entry[1] is not None:
            entry[1] += _length_of(inputs)
        return inputs


#: inside a wrapped ``generate`` call that re-laid its prompt pads first (:func:`_justified_prompt`): the caller's
#: ``input_ids`` ``[B, L]`` and the re-laid ones
_GEN_PROMPT: contextvars.ContextVar[tuple[Tensor | None, Tensor | None] | None] = contextvars.ContextVar(
    "safepad_generate_prompt", default=None
)
#: inside a wrapped ``generate`` call that checked the caller's 2-D ``attention_mask`` on the host: its model
#: (:func:`mask_checked_by_generate`)
_GEN_MASK_CHECKED: contextvars.ContextVar[Any] = contextvars.ContextVar("safepad_generate_mask_checked", default=None)
#: inside a wrapped ``generate`` call: the columns of the caller's prompt (its 2-D mask's, else its ``input_ids``'),
#: after which every mask column is one ``generate`` appended (:func:`generated_step`); None when unknown
_GEN_PROMPT_COLUMNS: contextvars.ContextVar[int | None] = contextvars.ContextVar("safepad_prompt_columns", default=None)
#: inside a wrapped ``generate`` call (this thread / task only): transformers' right-padding warning is dropped
_IN_WRAPPED_GENERATE: contextvars.ContextVar[bool] = contextvars.ContextVar("safepad_in_generate", default=False)


def mask_checked_by_generate(model: Any) -> bool:
    """Whether this call of ``model`` runs inside ``model``'s wrapped ``generate`` (eager code only: a ContextVar),
    which checked the values of the caller's ``attention_mask`` on the host when it started.

    Every mask ``generate`` hands its forward calls is the caller's (sliced, or extended with ones on each decode
    step; or one it built from ``input_ids``, of 0 and 1): its values need no check of their own, in particular no
    device check on every decode step (one on CUDA, failing, would be a device-side assert that loses the process's
    CUDA context; docs/limits.md, "Device checks").
    """
    return _GEN_MASK_CHECKED.get() is model


def generated_step(model: Any, T: int, mask: Any) -> bool:
    """Whether a one-token call of ``model`` (``T == 1``) with the 2-D ``mask`` ``[B, M]`` brings the token its wrapped
    ``generate`` appended: inside that ``generate`` (:func:`mask_checked_by_generate`) with more mask columns than the
    caller's prompt has. ``generate`` extends the mask with a column of ones for each token it adds, so every row's
    token is real: a host-side fact (no device read), which spares the decode step holding pad rows' states in
    every layer and re-laying the cached keys (docs/limits.md, "Device checks"). A one-token call covering only
    the caller's columns (a prompt whose last token alone is uncached) is not such a step: its column is the
    caller's."""
    if T != 1 or not mask_checked_by_generate(model) or not isinstance(mask, Tensor) or mask.dim() != 2:
        return False
    columns = _GEN_PROMPT_COLUMNS.get()
    return columns is not None and mask.shape[1] > columns


#: the logger transformers' ``generate`` warns on, and the start of its right-padding warning
_GENERATE_LOGGER = "transformers.generation.utils"
_RIGHT_PADDING_WARNING = "A decoder-only architecture is being used, but right-padding was detected"


class _RightPaddingFilter(logging.Filter):
    """Drops transformers' "right-padding was detected! ... set padding_side='left'" warning, only while a wrapped
    model's ``generate`` runs in this thread: safepad makes right-padded prompts correct, so the advice is wrong
    there. Installed once on transformers' generation logger; inert outside a wrapped ``generate``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_IN_WRAPPED_GENERATE.get() and str(record.msg).startswith(_RIGHT_PADDING_WARNING))


_RIGHT_PADDING_FILTER = _RightPaddingFilter()


def _quiet_right_padding_warning() -> contextvars.Token:
    """Enter a wrapped ``generate``: install the (inert elsewhere) filter once and switch it on for this call."""
    gen_logger = logging.getLogger(_GENERATE_LOGGER)
    if _RIGHT_PADDING_FILTER not in gen_logger.filters:
        gen_logger.addFilter(_RIGHT_PADDING_FILTER)
    return _IN_WRAPPED_GENERATE.set(True)


#: the multimodal-rotary position offsets (``rope_deltas`` ``[B, 1]``, Qwen-VL-style models) that a ``generate`` call
#: left on its model, kept on the cache it returned (:func:`_keep_rope_deltas`)
_ROPE_DELTAS_ATTR = "_safepad_rope_deltas"


def _rope_deltas_holders(model: Any) -> list:
    """The modules of ``model`` that keep ``rope_deltas`` between calls (a transformers M-RoPE convention)."""
    return [m for m in model.modules() if "rope_deltas" in m.__dict__]


def _keep_rope_deltas(model: Any, cache: Any) -> None:
    """After ``generate`` (returned or raised; ``cache`` the one it returned, or None): the ``rope_deltas`` it left
    on the model are a ``generate`` call's (not a prefill's), and belong to that cache."""
    for holder in _rope_deltas_holders(model):
        holder.__dict__[_ROPE_DELTAS_ATTR] = holder.rope_deltas
        if cache is not None:
            cache.__dict__[_ROPE_DELTAS_ATTR] = holder.rope_deltas


def _rope_deltas_of_cache(model: Any, cache: Any, rows: int | None = None) -> None:
    """Before ``generate`` continues ``cache``: the model's ``rope_deltas`` are the cache's own.

    transformers keeps them on the model, from its last multimodal prefill or ``generate``, and a ``generate``
    continuing a cache adds them to the positions of its tokens: after a ``generate`` on other rows they are
    another batch's (a shape error, or another sequence's offsets). The cache's own (kept by
    :func:`_keep_rope_deltas`) are put back; a cache no ``generate`` returned gets none when the model's are
    another ``generate``'s (the positions then come from the mask, as for text), and keeps what a prefill set.
    ``rows``: the call's batch size; kept deltas of fewer rows (one per prompt of a ``generate`` that returned
    ``num_return_sequences`` or beams per prompt, ``[P, 1]``) are repeated per prompt, as generate expands rows.
    """
    for holder in _rope_deltas_holders(model):
        if _ROPE_DELTAS_ATTR in cache.__dict__:
            deltas = cache.__dict__[_ROPE_DELTAS_ATTR]
            if isinstance(deltas, Tensor) and rows and deltas.shape[0] != rows and rows % deltas.shape[0] == 0:
                deltas = deltas.repeat_interleave(rows // deltas.shape[0], dim=0)  # [rows, 1]
            holder.rope_deltas = deltas
        elif holder.rope_deltas is not None and holder.__dict__.get(_ROPE_DELTAS_ATTR) is holder.rope_deltas:
            holder.rope_deltas = None


def _compiles(model: Any, kwargs: dict, cache: Any) -> bool:
    """Will this ``generate`` run a compileable cache or a compiled forward? (``cache_implementation`` other than
    dynamic, a compileable cache handed in (``StaticCache``), a ``compile_config``, or ``model.forward`` replaced by
    ``torch.compile(model.forward)``, or the model compiled in place: ``model.compile()``.)"""
    gen_config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    implementation = kwargs.get("cache_implementation", getattr(gen_config, "cache_implementation", None))
    if implementation not in (None, "dynamic"):
        return True
    if cache is not None and getattr(cache, "is_compileable", False) and type(cache).__name__ != "DynamicCache":
        return True
    if kwargs.get("compile_config", getattr(gen_config, "compile_config", None)) is not None:
        return True
    if getattr(model, "_compiled_call_impl", None) is not None:  # model.compile(): every call traced, hooks too
        return True
    forward = model.__dict__.get("forward")
    return forward is not None and hasattr(forward, "_torchdynamo_orig_callable")


def _prompt_columns(args: tuple, kwargs: dict) -> int | None:
    """The columns of the prompt ``generate`` is called with: its 2-D ``attention_mask``'s, else its ``input_ids``'
    (``[B, L]``, positional or named ``input_ids`` / ``inputs``), else None (``inputs_embeds`` only: unknown)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2:
        return mask.shape[1]
    ids = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("input_ids", kwargs.get("inputs"))
    if isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point():
        return ids.shape[1]
    return None


def _justified_prompt(model: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple | None]:
    """A right-padded prompt (a pad after a real token in a row of the 2-D ``attention_mask`` ``[B, L]``) handed to a
    ``generate`` that runs a compileable cache or a compiled forward, or to a model with attention layers: every
    ``[B, L, ...]`` input (``input_ids``, ``inputs_embeds``, the mask, ``token_type_ids``, ...) re-laid pads first, one
    gather on the device (:func:`safepad.layout.slots.pads_first_order`), so each row is ``[pads | its tokens]``: a
    left-padded prompt, which a static cache, generate's own 4-D mask and a compiled forward serve as stock does, and
    from which safepad generates each row's own tokens. Eager, it spares every decode step the re-lay of the cached
    slots a right-padded prefill would leave (each step then runs as after a left-padded prompt: the mask generate
    extends describes the cache's layout). Never over a cache that already holds tokens in the caller's layout.
    The caller's prompt goes back in the output (:func:`_with_caller_prompt`).

    Returns ``(args, kwargs, prompt)``; ``prompt`` is ``None`` when nothing was re-laid, else ``(caller's input_ids
    [B, L], re-laid ones)``, both ``None`` when no ``input_ids`` were given (``inputs_embeds`` only).
    """
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return args, kwargs, None
    cache = cache_from_kwargs(kwargs)[1]
    # a cache with slots holding tokens in the caller's layout (no call re-laid it: a left-padded prefill, a
    # hand-written step with a pad) stays in it, described by the caller's mask, which a re-laid one would not be
    in_callers_layout = (
        cache is not None and not recurrent_only(cache) and not getattr(cache, _RELAID_FLAG, False)
        and bool(_counted_length(cache))
    )
    # (eager, a recurrent-only model has no cached slots to re-lay)
    if in_callers_layout or (fresh_cache_is_recurrent_only(model.config) and not _compiles(model, kwargs, cache)):
        return args, kwargs, None
    m = mask.to(torch.bool)  # [B, L]
    if not bool(pads_after_real(m).any()):  # one host read: no pad after a real token anywhere
        return args, kwargs, None
    B, L = m.shape
    order = pads_first_order(m)  # [B, L]
    named = dict(kwargs)
    positional = bool(args) and isinstance(args[0], Tensor)
    if positional:
        named["input_ids"] = args[0]
    elif isinstance(named.get("inputs"), Tensor):
        named["input_ids"] = named.pop("inputs")
    ids = named.get("input_ids")
    for name, value in list(named.items()):
        if isinstance(value, Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (B, L):
            idx = order.to(value.device).view(B, L, *([1] * (value.dim() - 2))).expand(value.shape)
            named[name] = value.gather(1, idx)
    prompt = (ids, named["input_ids"]) if isinstance(ids, Tensor) and tuple(ids.shape[:2]) == (B, L) else (None, None)
    if positional:
        return (named.pop("input_ids"), *args[1:]), named, prompt
    return args, named, prompt


def _caller_columns(seq: Tensor, ids: Tensor | None, relaid: Tensor | None) -> Tensor:
    """``seq`` ``[B * k, L + n]`` with the caller's prompt ``ids`` ``[B, L]`` in place of the re-laid one
    (:func:`_justified_prompt`) in its first ``L`` columns; ``seq`` itself when those columns are not the re-laid
    prompt (or the shapes do not match, or no ``input_ids`` were given)."""
    if ids is None or relaid is None:
        return seq
    if seq.dim() != 2 or seq.shape[1] < ids.shape[1] or seq.shape[0] % ids.shape[0]:
        return seq
    k = seq.shape[0] // ids.shape[0]
    L = ids.shape[1]
    if not torch.equal(seq[:, :L], relaid.repeat_interleave(k, 0).to(seq.device)):
        return seq
    return torch.cat([ids.repeat_interleave(k, 0).to(seq), seq[:, L:]], dim=1)


def _with_caller_prompt(out: Any, ids: Tensor | None, relaid: Tensor | None) -> Any:
    """``generate``'s output (sequences ``[B * k, L + n]``, or an output holding them) with the caller's prompt ``ids``
    ``[B, L]`` in place of the re-laid one (:func:`_justified_prompt`) in its first ``L`` columns."""
    seq = out if isinstance(out, Tensor) else getattr(out, "sequences", None)
    if not isinstance(seq, Tensor):
        return out
    new = _caller_columns(seq, ids, relaid)
    if new is seq:
        return out
    seq = new
    if isinstance(out, Tensor):
        return seq
    out.sequences = seq
    return out


class SafepadGenerate:
    """``model.generate`` of a wrapped model whose cache has no attention layer.

    transformers' ``generate`` asks the cache for its length before the first forward; a recurrent-only
    cache raises there. This hands ``generate`` an empty length-tracking cache (under the name the model's
    forward declares) unless the caller passed a cache, asked for no cache or for a ``cache_implementation``;
    a cache the caller passed is made to track its length. Everything else is the class's own ``generate``.
    """

    def __init__(self, model: Any, track: bool = True):
        self.model = model
        self.track = track  # False: the model never asks the cache its length (Mamba, Mamba2, FalconMamba)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        # the caller's mask, on the host once (none for a bool mask): a clear ValueError for an additive mask, and the
        # decode steps, whose masks generate extends with ones, skip their device check (mask_checked_by_generate)
        check_mask_values(kwargs.get("attention_mask"))
        name = cache_argument(model.forward)
        _, given = cache_from_kwargs(kwargs)
        if not self.track:
            pass
        elif given is not None:
            track_seq_length(given)
        elif name is not None and self._generate_builds_cache(model, kwargs):
            kwargs[name] = new_tracked_cache(model.config, owned=True)
        counts: dict = {}
        if given is not None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            _rope_deltas_of_cache(model, given, ids.shape[0] if isinstance(ids, Tensor) and ids.dim() == 2 else None)
        args, kwargs, prompt = _justified_prompt(model, args, kwargs)
        token = _GEN_COUNTS.set(counts)
        relaid = _GEN_PROMPT.set(prompt)
        checked = _GEN_MASK_CHECKED.set(model)
        columns = _GEN_PROMPT_COLUMNS.set(_prompt_columns(args, kwargs))
        quiet = _quiet_right_padding_warning()
        try:
            with keep_prepared():  # parameter-derived values built once per call, not per step
                out = type(model).generate(model, *args, **kwargs)
            if prompt is not None:
                out = _with_caller_prompt(out, *prompt)
        except BaseException:
            for cache, *_ in counts.values():  # states written part of the way: unknown from here on
                rec = cache.__dict__.get(_RECORD_ATTR)
                if rec is not None and rec[2] != _state_versions(cache):
                    del cache.__dict__[_RECORD_ATTR]
            raise
        finally:
            _IN_WRAPPED_GENERATE.reset(quiet)
            _GEN_MASK_CHECKED.reset(checked)
            _GEN_PROMPT_COLUMNS.reset(columns)
            _GEN_PROMPT.reset(relaid)
            _GEN_COUNTS.reset(token)
            _keep_rope_deltas(model, None)  # (use_cache=False, or raised: no cache to keep them on)
        for cache, read, ids in counts.values():  # what each cache has read, kept on the cache (_record)
            if prompt is not None and not recurrent_only(cache):
                # the prompt was re-laid pads first: the cache holds every row [pads | real tokens], not in the
                # caller's layout, which the caller's mask (and the one a continuing call passes) describes. Marked
                # as an eager re-lay marks it, so that a later call, eager or traced, serves it justified
                setattr(cache, _RELAID_FLAG, True)
                setattr(cache, _PADDED_FLAG, True)
            if read is None and (isinstance(cache, _TracksSeqLength) or not recurrent_only(cache)):
                read = _counted_length(cache)
            if read is None:
                cache.__dict__.pop(_RECORD_ATTR, None)
                continue
            ids = ids[:, :read] if isinstance(ids, Tensor) and ids.shape[1] >= read else None
            if ids is not None and prompt is not None:
                ids = _caller_columns(ids, *prompt)  # what the caller fed, as a continuing generate passes it
            cache.__dict__[_RECORD_ATTR] = (read, ids, _state_versions(cache))
        _keep_rope_deltas(model, output_cache(out))
        return out

    @staticmethod
    def _generate_builds_cache(model: Any, kwargs: dict) -> bool:
        gen_config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        use_cache = kwargs.get("use_cache", getattr(gen_config, "use_cache", True))
        implementation = kwargs.get("cache_implementation", getattr(gen_config, "cache_implementation", None))
        return bool(use_cache) and implementation is None and fresh_cache_is_recurrent_only(model.config)



class _CallModel:
    """``model(*args, **kwargs)`` from a frame of safepad's own, which dynamo traces (``Module.__call__`` itself it
    runs uncompiled, compiling the hooks and the forward as separate frames, each guarded on the inputs it reads:
    the pre-hook's frame then recompiles for every new mask length under ``dynamic=False``). Traced from here, the
    model call, its hooks included, is one frame, as stock's call without hooks."""

    __slots__ = ("model",)

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


class SafepadCompiledCall:
    """``model.get_compiled_call`` of a wrapped model (transformers' compiled decode steps in ``generate``): the
    same compiled callable and cache of it as transformers' own, of :class:`_CallModel` instead of
    ``model.__call__``, so that the hooks compile into the forward's frame."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, compile_config: Any = None) -> Any:
        model = self.model
        if "llama4" in model.config.model_type:  # (transformers' own exception: the uncompiled call)
            return model.__call__
        compile_config = compile_config or model._default_compile_config()
        default = getattr(model.generation_config, "compile_config", None) or model._default_compile_config()
        if not hasattr(model, "_compiled_call") or getattr(model, "_last_compile_config", default) != compile_config:
            model._last_compile_config = compile_config
            model._compiled_call = torch.compile(_CallModel(model), **compile_config.to_dict())
        return model._compiled_call
