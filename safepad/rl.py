"""Per-token log-probs of many ``[prompt | completion]`` sequences, packed into rows: the RL training forward.

RL trainers (GRPO, DPO, ...) score a batch of sequences laid out ``[B, T]``: one sequence per row, padded on
the left (prompts) and on the right (completions). The padded forward spends its compute on pads and
materialises ``[B, T, V]`` logits. :func:`packed_logprobs` instead

1. reads each row's sequence (its real tokens under ``attention_mask``, which must be contiguous);
2. packs the sequences into rows of ``max_tokens_per_row`` tokens with best-fit-decreasing
   (:func:`safepad.collators.packing.bfd_assign`; no sequence is cut, no token dropped);
3. runs the wrapped model once on the packed ``[R, L]`` rows, the boundaries given as ``seq_idx``,
   restarting ``position_ids`` and ``cu_seq_lens_q/k`` (each row's unused tail is a segment of its own);
4. projects only the hidden states of the scored tokens through the model's own output head, in chunks of
   ``chunk_size`` tokens (recomputed in backward), and gathers ``log_softmax(logits / temperature)`` of each
   token. The head is the causal LM's own forward run on those hidden states (its backbone swapped for them), so
   every family's final scaling, softcapping, μP multipliers and vocab slicing are the model's own code;
5. scatters the result back into the caller's ``[B, T]`` layout.

The result equals each sequence run alone through the stock model (tests/rl). The model must be wrapped
(:func:`safepad.wrap`): a stock SSM would carry its state from one packed sequence into the next.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers.utils import ModelOutput

from .errors import PaddingError
from .wrap import is_wrapped

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CHUNK_SIZE", "packed_logprobs", "packed_logprobs_and_entropy"]

#: scored tokens projected through the LM head at once: at most ``DEFAULT_CHUNK_SIZE x V`` logits live at a time
DEFAULT_CHUNK_SIZE = 1024


@dataclass(frozen=True)
class _Plan:
    """Where each real token of the ``[B, T]`` batch sits in the packed ``[R, L]`` rows."""

    ids: Tensor  # [R, L] packed token ids (0 in the unused tail of a row)
    position_ids: Tensor  # [R, L] restarting at 0 at every segment (the tail too)
    seq_idx: Tensor  # [R, L] int32, 0.. per row, the tail its own segment
    cu_seqlens: Tensor  # [S + 1] int32 over the flattened [R * L] packed rows, every segment
    max_length: int  # longest segment
    src: Tensor  # [N] flat index into [B * T] of each packed real token
    dst: Tensor  # [N] flat index into [R * L] of the same token


def _check_inputs(input_ids: Tensor, attention_mask: Tensor | None, completion_mask: Tensor | None) -> Tensor:
    """``[B, T]`` bool mask of real tokens, after checking the shapes and that each row's tokens are contiguous."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, seqlen] tensor, got {getattr(input_ids, 'shape', input_ids)}")
    B, T = input_ids.shape
    if attention_mask is None:
        mask = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
    else:
        if tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {(B, T)}")
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask must hold only 0 and 1 (1 = real token)")
        mask = attention_mask.to(torch.bool)
    if completion_mask is not None and tuple(completion_mask.shape) != (B, T):
        raise ValueError(f"completion_mask has shape {tuple(completion_mask.shape)}, input_ids {(B, T)}")
    if mask.numel() == 0:  # T = 0 or B = 0: no token, nothing to check
        return mask
    lengths = mask.sum(1)  # [B]
    first = mask.to(torch.int8).argmax(1)  # [B]
    pos = torch.arange(T, device=mask.device)
    span = (pos >= first[:, None]) & (pos < (first + lengths)[:, None])  # [B, T]
    holes = (span != mask).any(1)
    if bool(holes.any()):
        row = int(holes.nonzero()[0, 0])
        raise PaddingError(
            f"row {row} of attention_mask has pads between real tokens: packed_logprobs needs one sequence per "
            "row, laid out [pads | tokens | pads]. Split the row into its sequences (one per row) first."
        )
    return mask


def _plan(input_ids: Tensor, mask: Tensor, max_tokens_per_row: int | None) -> _Plan:
    from .collators.packing import bfd_assign

    B, T = input_ids.shape
    device = input_ids.device
    lengths = mask.sum(1).cpu().numpy().astype(np.int64)  # [B]
    first = mask.to(torch.int8).argmax(1).cpu().numpy().astype(np.int64)  # [B]
    rows = np.flatnonzero(lengths)  # rows holding a sequence (an all-pad row is left out)
    longest = int(lengths.max()) if lengths.size else 0
    L = longest if max_tokens_per_row is None else int(max_tokens_per_row)
    if L < longest:
        raise ValueError(
            f"a sequence of {longest} tokens does not fit max_tokens_per_row={L}: packed_logprobs never cuts a "
            f"sequence; raise max_tokens_per_row to at least {longest} (or leave it None: the longest sequence)"
        )
    order, counts = bfd_assign(lengths[rows], max(L, 1))
    seqs = rows[order]  # [S] batch rows, grouped by packed row
    seq_len = lengths[seqs]
    R = counts.shape[0]
    packed_row = np.repeat(np.arange(R), counts)  # [S]
    row_start = np.cumsum(counts) - counts  # [R] index of each packed row's first sequence
    within = np.cumsum(seq_len) - seq_len  # [S] exclusive cumsum over all sequences
    offset = within - np.repeat(within[row_start], counts)  # [S] start inside its packed row
    # every real token: source [B * T] and destination [R * L] flat indices
    tok_seq = np.repeat(np.arange(seqs.shape[0]), seq_len)  # [N]
    tok_k = np.arange(tok_seq.shape[0]) - np.repeat(within, seq_len)  # [N] index inside its sequence
    src = seqs[tok_seq] * T + first[seqs[tok_seq]] + tok_k
    dst = packed_row[tok_seq] * L + offset[tok_seq] + tok_k
    # segments: each sequence, plus each row's unused tail
    used = np.bincount(packed_row, weights=seq_len, minlength=R).astype(np.int64)  # [R]
    seg_row = np.concatenate([packed_row, np.flatnonzero(used < L)])
    seg_start = np.concatenate([offset, used[used < L]])
    seg_len = np.concatenate([seq_len, L - used[used < L]])
    by = np.lexsort((seg_start, seg_row))
    seg_row, seg_start, seg_len = seg_row[by], seg_start[by], seg_len[by]
    seg_first = np.r_[True, seg_row[1:] != seg_row[:-1]] if seg_row.size else np.zeros(0, dtype=bool)
    seg_no = np.arange(seg_row.shape[0])
    seg_in_row = seg_no - np.maximum.accumulate(np.where(seg_first, seg_no, 0))  # [segments] 0.. in each row
    seg_of_tok = np.repeat(np.arange(seg_row.shape[0]), seg_len)  # [R * L] in flat order (segments tile the rows)
    flat_pos = np.arange(R * L) - np.repeat(seg_row * L + seg_start, seg_len)
    cu = np.zeros(seg_row.shape[0] + 1, dtype=np.int32)
    np.cumsum(seg_len, out=cu[1:])
    ids = torch.zeros(R * L, dtype=input_ids.dtype, device=device)
    src_t = torch.as_tensor(src, device=device)
    dst_t = torch.as_tensor(dst, device=device)
    ids[dst_t] = input_ids.reshape(-1)[src_t]
    return _Plan(
        ids=ids.view(R, L),
        position_ids=torch.as_tensor(flat_pos, device=device).view(R, L),
        seq_idx=torch.as_tensor(seg_in_row[seg_of_tok], dtype=torch.int32, device=device).view(R, L),
        cu_seqlens=torch.as_tensor(cu, device=device),
        max_length=int(seg_len.max()) if seg_len.size else 0,
        src=src_t,
        dst=dst_t,
    )


def _causal_lm(model: nn.Module) -> nn.Module:
    """The ``...ForCausalLM`` inside DDP / PEFT wrappers (the module whose backbone and head are read)."""
    inner = model
    for _ in range(4):
        if hasattr(inner, "get_base_model") and callable(inner.get_base_model):  # PEFT
            inner = inner.get_base_model()
        elif isinstance(getattr(inner, "module", None), nn.Module) and not hasattr(inner, "get_output_embeddings"):
            inner = inner.module  # DDP and other ``.module`` wrappers
        else:
            break
    if _has_head(inner):
        return inner
    # a multimodal wrapper whose forward hands the text to an inner causal LM (NemotronH-Omni's language_model)
    inner_lms = [m for m in inner.modules() if m is not inner and _has_head(m)]
    if len(inner_lms) == 1:
        return inner_lms[0]
    raise ValueError(f"packed_logprobs needs a causal LM with an LM head, got {type(inner).__name__}")


def _has_head(module: nn.Module) -> bool:
    get = getattr(module, "get_output_embeddings", None)
    return callable(get) and get() is not None


class _HiddenStatesIn(nn.Module):
    """Stands in for the backbone while the causal LM's own forward turns given hidden states into logits.

    ``forward`` returns the backbone output ``output`` (its last hidden state replaced by the chunk to project)
    whatever it is called with; any other attribute (``lm_head_multiplier``, ``config``, ...) is the backbone's.
    """

    def __init__(self, backbone: nn.Module, output: object) -> None:
        super().__init__()
        object.__setattr__(self, "_safepad_backbone", backbone)  # not registered: no parameters of its own
        object.__setattr__(self, "_safepad_output", output)

    def forward(self, *args: object, **kwargs: object) -> object:
        return self._safepad_output

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_safepad_backbone"), name)


class _OwnHead:
    """The model's own output head: its ``forward`` after the backbone (final scaling, LM head, softcapping,
    μP multipliers, vocab slicing), run on given hidden states ``[n, H]`` -> logits ``[n, V]``.

    The causal LM's forward is called with the backbone swapped for a :class:`_HiddenStatesIn` that hands back
    the hidden states, so whatever the family's forward does between its backbone and its logits is done by
    that code itself, not re-implemented here.
    """

    def __init__(self, lm: nn.Module, backbone: nn.Module, output: object) -> None:
        self.lm = lm
        self.backbone = backbone
        self.name = next((n for n, child in lm.named_children() if child is backbone), None)
        if self.name is None:
            raise ValueError(
                f"packed_logprobs runs {type(lm).__name__}'s own output head on the packed hidden states, but its "
                f"backbone {type(backbone).__name__} is not a direct child of it; score such a model with its padded "
                "forward instead"
            )
        self.output = output
        params = inspect.signature(lm.forward).parameters
        self.kwargs: dict[str, object] = {"use_cache": False}
        if "logits_to_keep" in params:
            self.kwargs["logits_to_keep"] = 0
        if "output_router_logits" in params:
            self.kwargs["output_router_logits"] = False

    def _output_with(self, h: Tensor) -> object:
        out = self.output
        if isinstance(out, ModelOutput):
            fields = {k: None for k in out.keys()}
            fields[next(iter(out.keys()))] = h
            return type(out)(**fields)
        return (h,)

    def __call__(self, h: Tensor, targets: Tensor) -> Tensor:
        """Logits ``[n, V]`` of hidden states ``h`` ``[n, H]`` (``targets`` ``[n]`` stand in as the input ids)."""
        stub = _HiddenStatesIn(self.backbone, self._output_with(h[None]))
        modules = self.lm._modules
        modules[self.name] = stub
        try:
            out = self.lm.forward(input_ids=targets[None], **self.kwargs)
        except Exception as exc:
            raise RuntimeError(
                f"packed_logprobs runs {type(self.lm).__name__}'s own forward on the packed hidden states to apply "
                f"its output head, and that forward failed ({type(exc).__name__}: {exc}); score this model with its "
                "padded forward instead"
            ) from exc
        finally:
            modules[self.name] = self.backbone
        logits = out.logits if hasattr(out, "logits") else out[0]
        if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[:2] != (1, h.shape[0]):
            raise RuntimeError(
                f"{type(self.lm).__name__}'s forward returned logits of shape {getattr(logits, 'shape', None)} for "
                f"{h.shape[0]} hidden states; packed_logprobs cannot apply its output head"
            )
        return logits[0]


def _head_chunk(h: Tensor, targets: Tensor, head: _OwnHead, temperature: float) -> tuple[Tensor, Tensor]:
    """``(log p(target), entropy)`` ``[n]`` float32 from hidden states ``h`` ``[n, H]``."""
    logits = head(h, targets).float()  # [n, V]
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    picked = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy


def _attached(x: Tensor, model: nn.Module) -> Tensor:
    """``x`` (zeros: no token scored) attached to the graph of every trainable parameter of ``model`` by a zero
    term, while grad is enabled: a loss built on it backpropagates (zero gradients, as the padded forward of a batch
    whose every token is masked gives) instead of raising "does not require grad" in the caller's backward."""
    if not torch.is_grad_enabled() or x.requires_grad:
        return x
    terms = [p.reshape(-1)[:1].sum().float() for p in model.parameters() if p.requires_grad and p.numel()]
    if not terms:
        return x
    return x + (torch.stack([t.to(x.device) for t in terms]).sum() * 0.0)


def _forward(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    completion_mask: Tensor | None,
    temperature: float,
    max_tokens_per_row: int | None,
    chunk_size: int,
    compute_aux_loss: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(logps [B, T], entropy [B, T], aux_loss [] or None)``: see :func:`packed_logprobs`. ``compute_aux_loss``:
    also the model's MoE load-balancing loss over every real token of the batch (its ``aux_loss`` output, as the
    padded forward with ``attention_mask`` computes it)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lm = _causal_lm(model)
    if not is_wrapped(lm):
        raise PaddingError(
            f"packed_logprobs runs packed rows, which the stock {type(lm).__name__} gets wrong (the recurrent state "
            "runs from one sequence into the next): call model = safepad.wrap(model) first"
        )
    mask = _check_inputs(input_ids, attention_mask, completion_mask)
    B, T = input_ids.shape
    if not bool(mask.any()):  # T = 0, B = 0 or only pads: no log-prob to compute, the model is not run
        zeros = _attached(torch.zeros(B, T, dtype=torch.float32, device=input_ids.device), model)
        aux = _attached(zeros.new_zeros(()), model) if compute_aux_loss else None
        return zeros, zeros.clone(), aux
    scored = mask.clone()
    scored[:, 1:] &= mask[:, :-1]  # the first token of each sequence has no prediction
    scored[:, 0] = False
    if completion_mask is not None:
        scored &= completion_mask.to(torch.bool)
    plan = _plan(input_ids, mask, max_tokens_per_row)
    # the scored tokens' flat indices, in both layouts, and the packed position of the hidden state predicting each
    is_scored = scored.reshape(-1)[plan.src]  # [N]
    src = plan.src[is_scored]  # [K] into [B * T]
    dst = plan.dst[is_scored]  # [K] into [R * L]
    logps = torch.zeros(B * T, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros(B * T, dtype=torch.float32, device=input_ids.device)
    if plan.ids.numel() == 0:
        aux = _attached(logps.new_zeros(()), model) if compute_aux_loss else None
        return _attached(logps.view(B, T), model), _attached(entropy.view(B, T), model), aux
    extra: dict[str, object] = {}
    if compute_aux_loss:
        _check_router_loss_mask(lm)
        real = torch.zeros(plan.ids.numel(), dtype=torch.long, device=input_ids.device)
        real[plan.dst] = 1  # the rows' unused tails stay out of the load-balancing loss
        extra = {"output_router_logits": True, "real_token_mask": real.view(plan.ids.shape)}

    captured: list[object] = []

    def grab(module, args, output):  # the backbone's output: its last hidden state [R, L, H] first
        captured.append(output)

    backbone = lm.base_model
    handle = backbone.register_forward_hook(grab)
    try:
        # through the caller's model object (DDP / PEFT / TRL's patched forward run as usual); logits_to_keep=1:
        # the model's own head projects one position per row, the scored ones are projected below
        out = model(
            input_ids=plan.ids,
            position_ids=plan.position_ids,
            seq_idx=plan.seq_idx,
            cu_seq_lens_q=plan.cu_seqlens,
            cu_seq_lens_k=plan.cu_seqlens,
            max_length_q=plan.max_length,
            max_length_k=plan.max_length,
            use_cache=False,
            logits_to_keep=1,
            **extra,
        )
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"the backbone {type(backbone).__name__} ran {len(captured)} times in one forward")
    hidden = captured[0][0]  # a ModelOutput's first field, or a tuple's first element
    H = hidden.shape[-1]
    h = hidden.reshape(-1, H)[dst - 1]  # [K, H]: the hidden state before each scored token (same segment)
    targets = plan.ids.reshape(-1)[dst]  # [K]
    head = _OwnHead(lm, backbone, captured[0])
    picked, ents = [], []
    for start in range(0, h.shape[0], chunk_size):
        args = (h[start : start + chunk_size], targets[start : start + chunk_size], head, temperature)
        if torch.is_grad_enabled() and h.requires_grad:
            p, e = checkpoint(_head_chunk, *args, use_reentrant=False)  # [n, V] logits recomputed in backward
        else:
            p, e = _head_chunk(*args)
        picked.append(p)
        ents.append(e)
    if picked:
        logps = logps.index_put((src,), torch.cat(picked))
        entropy = entropy.index_put((src,), torch.cat(ents))
    else:  # no token scored (one-token sequences, an all-zero completion_mask)
        logps, entropy = _attached(logps, model), _attached(entropy, model)
    aux_loss = None
    if compute_aux_loss:
        aux_loss = getattr(out, "aux_loss", None)
        if aux_loss is None:
            raise ValueError(
                f"{type(lm).__name__} returned no aux_loss with output_router_logits=True: it computes no MoE "
                f"load-balancing loss. {_AUX_LOSS_OFF}"
            )
    return logps.view(B, T), entropy.view(B, T), aux_loss


#: how to turn the MoE load-balancing loss off, for the messages that refuse it
_AUX_LOSS_OFF = (
    "Turn the auxiliary loss off: GRPOConfig(router_aux_loss_coef=0.0) (TRL's argument), or "
    "model.config.router_aux_loss_coef = 0.0 (the config key TRL reads; for a VLM, the text config's) before "
    "building the trainer"
)


def _check_router_loss_mask(lm: nn.Module) -> None:
    """Raise unless safepad hands this family's router loss the real-token mask of a packed call (the spec option
    ``router_loss_mask``): without it the packed rows' unused tails would count in the load-balancing loss."""
    specs = [m._safepad_spec for m in lm.modules() if getattr(m, "_safepad_spec", None) is not None]
    if not any(spec.options.get("router_loss_mask") for spec in specs):
        from .specs.registry import all_specs

        families = ", ".join(sorted({spec.model_type for spec in specs})) or type(lm).__name__
        supported = ", ".join(spec.model_type for spec in all_specs() if spec.options.get("router_loss_mask"))
        raise ValueError(
            f"packed_logprobs cannot compute the MoE load-balancing loss of {families} on packed rows: safepad does "
            f"not hand its router loss the packed rows' real-token mask (it does for {supported}). {_AUX_LOSS_OFF}"
        )


def packed_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    completion_mask: Tensor | None = None,
    temperature: float = 1.0,
    max_tokens_per_row: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Per-token log-probs ``[B, T]`` float32 of the sequences of ``input_ids``, computed on packed rows.

    ``out[b, t] = log softmax(logits / temperature)[input_ids[b, t]]``, the logits being those of the tokens
    before ``t`` in row ``b``'s own sequence, as if that sequence ran alone (no padding, no cache) through the
    model. ``out`` is 0 at the first token of each sequence, at pads and where ``completion_mask`` is 0, and
    differentiable (gradients reach the model's parameters as through the padded forward). A batch without a
    real token (``T = 0``, ``B = 0`` or only pads) gives zeros ``[B, T]`` without running the model; while grad is
    enabled, zeros a loss can backpropagate through (zero gradients for every trainable parameter).

    Args:
        model: a :func:`safepad.wrap`-ped causal LM (or a DDP / PEFT wrapper of one).
        input_ids: ``[B, T]`` one sequence per row, ``[pads | tokens | pads]`` (left- and/or right-padded).
        attention_mask: ``[B, T]`` 1 at real tokens (contiguous in each row), 0 at pads; None: no pads.
        completion_mask: ``[B, T]`` 1 where a log-prob is wanted (e.g. the completion); None: every real token.
            Only these tokens go through the LM head.
        temperature: the logits are divided by it before the softmax (as TRL's GRPO / RLOO do).
        max_tokens_per_row: length ``L`` of a packed row; None: the longest sequence. Every sequence must fit.
        chunk_size: scored tokens projected through the LM head at once (at most ``chunk_size x V`` logits).

    Raises:
        PaddingError: the model is not wrapped, or a row's real tokens are not contiguous.
        ValueError: bad shapes or mask values, a sequence longer than ``max_tokens_per_row``.
    """
    return _forward(model, input_ids, attention_mask, completion_mask, temperature, max_tokens_per_row, chunk_size)[0]


def packed_logprobs_and_entropy(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    completion_mask: Tensor | None = None,
    temperature: float = 1.0,
    max_tokens_per_row: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """:func:`packed_logprobs` and the entropy ``[B, T]`` float32 of each scored token's distribution (the
    distribution it was drawn from: ``softmax(logits / temperature)``), 0 where no log-prob is computed."""
    out = _forward(model, input_ids, attention_mask, completion_mask, temperature, max_tokens_per_row, chunk_size)
    return out[0], out[1]
