"""The entry point: :func:`sequence_parallel` turns a wrapped model into a sequence-sharded one.

Every rank of the group is fed the SAME full batch (as with accelerate's context parallelism); a forward
pre-hook on the model cuts each row into ``W`` contiguous shards and keeps this rank's, together with its
``position_ids`` (the row's global positions, restarting at each packed boundary) and ``seq_idx`` (the
row's global boundaries, from ``seq_idx`` / ``cu_seq_lens_q|k`` / restarting ``position_ids``). Labels are
shifted over the WHOLE row before sharding, so the token after a shard edge is still predicted; the
returned ``loss`` is the loss of the whole batch (the same value on every rank, equal to the unsharded
call's), and ``logits`` are this rank's shard ``[B, T / W, V]``.

After ``loss.backward()`` each rank holds its part of every parameter gradient. Two ways to combine them:

* ``gradients="sync"`` (default): :meth:`SequenceParallel.sync_gradients` sums them over the group (one
  all-reduce per dtype), after which every rank holds the gradient of the unsharded call;
* ``gradients="ddp"``: the model is (or will be) wrapped by DDP / FSDP over exactly the ranks of the group,
  which AVERAGES gradients; the backward of the loss is scaled by the group size so that the average is
  the sum. The returned loss value is unchanged. Do not call ``sync_gradients`` then.

Without an explicit ``group`` a new process group over all ranks is created, so that the exchanges never
interleave with a DDP wrapper's own all-reduces on the default group.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .._state import state_of
from ..cache import CACHE_NAMES
from ..layout.normalize import normalize_boundaries, position_ids_from_seq_idx
from ..wrap import is_wrapped, wrapped_modules
from ..parallel import attention as _attention
from ..parallel.collectives import all_gather_stack, sum_replicated
from ..parallel.context import SPContext, current_sp, reset_sp, set_sp
from .agreement import check_same_call

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_KINDS", "SequenceParallel", "UnsupportedSequenceParallelError", "sequence_parallel"]

#: mixer kinds whose state crosses ranks (conv halo + state exchange); any other kind raises
SUPPORTED_KINDS = ("mamba2", "gated_delta", "mamba1", "short_conv")

_IGNORE = -100
#: per-token kwargs sharded with the row (besides input_ids / inputs_embeds / position_ids / labels)
_SHARDED_KWARGS = ("token_type_ids",)
#: kwargs consumed here (boundaries)
_BOUNDARY = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class UnsupportedSequenceParallelError(ValueError):
    """The model (or this call) cannot be sequence-sharded exactly; nothing was run."""


def _attention_like(module: nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("Attention") and getattr(module, "_safepad_spec", None) is None


def sequence_parallel(
    model: nn.Module, group=None, *, gradients: str = "sync", check_batch: bool = True
) -> "SequenceParallel":
    """Shard every call of the wrapped ``model`` over the ranks of ``group`` (default: all ranks, in a new group).

    ``gradients``: ``"sync"`` (call ``sync_gradients()`` after backward) or ``"ddp"`` (a DDP / FSDP wrapper over
    the same ranks averages them). ``check_batch``: verify on every call (one all-gather of fingerprints) that all
    ranks got the same call: every tensor argument (``input_ids`` / ``inputs_embeds``, ``labels``,
    ``position_ids``, the boundaries, ...).
    Returns the :class:`SequenceParallel` handle (``sync_gradients()``, ``shard()``, ``gather()``,
    ``remove()``). Raises :class:`UnsupportedSequenceParallelError` for models it cannot shard exactly.
    """
    return SequenceParallel(model, group, gradients=gradients, check_batch=check_batch)


class SequenceParallel:
    """Hooks that shard a wrapped model's calls over a process group (see :func:`sequence_parallel`)."""

    def __init__(self, model: nn.Module, group=None, *, gradients: str = "sync", check_batch: bool = True):
        if gradients not in ("sync", "ddp"):
            raise ValueError(f"gradients must be 'sync' (call sync_gradients()) or 'ddp' (a DDP/FSDP wrapper averages), got {gradients!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise UnsupportedSequenceParallelError(
                "safepad.distributed.sequence_parallel needs torch.distributed initialised (torchrun / accelerate "
                "launch, or dist.init_process_group) before it is called"
            )
        if not is_wrapped(model):
            raise UnsupportedSequenceParallelError(
                "sequence_parallel expects a model wrapped by safepad.wrap(model) first: only safepad's mixers carry "
                "their state across ranks, a stock mixer would restart it from zero on every rank"
            )
        kinds = sorted({m._safepad_spec.kind for _, m in wrapped_modules(model)})
        bad = [k for k in kinds if k not in SUPPORTED_KINDS]
        if bad:
            raise UnsupportedSequenceParallelError(
                f"sequence parallelism does not support mixer kind(s) {bad} yet (supported: {', '.join(SUPPORTED_KINDS)}): "
                "their state would restart from zero on every rank"
            )
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layer_types = set(getattr(text, "layer_types", None) or [])
        windowed = sorted(t for t in layer_types if "sliding" in t or "chunked" in t)
        if windowed:
            raise UnsupportedSequenceParallelError(
                f"sequence parallelism expresses only full causal attention; this model has {windowed} layers"
            )
        indexed = sorted(t for t in layer_types if "indexed" in t) or sorted(
            {type(m).__name__ for m in model.modules() if _attention_like(m) and hasattr(m, "indexer")}
        )
        if indexed:
            raise UnsupportedSequenceParallelError(
                f"sequence parallelism does not support indexed (top-k selected) attention ({indexed}): its indexer "
                "selects keys from the whole row, but under sequence parallelism it would see only this rank's "
                "shard; train this model without sequence parallelism"
            )
        if getattr(text, "output_router_logits", False):
            raise UnsupportedSequenceParallelError(
                "output_router_logits=True: the router auxiliary loss is not sharded yet; set "
                "config.output_router_logits=False to train under sequence parallelism"
            )
        self.model = model
        self.group = group if group is not None else dist.new_group(backend=dist.get_backend())
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.gradients = gradients
        self.check_batch = check_batch
        self._calls: list = []
        _attention.register()
        self._configs: list[tuple[object, object]] = []
        seen: set[int] = set()
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                m._safepad_sp_fallback = getattr(m, "_safepad_sp_fallback", None) or cfg._attn_implementation
                if id(cfg) not in seen:
                    seen.add(id(cfg))
                    self._configs.append((cfg, cfg._attn_implementation))
        for cfg, _ in self._configs:
            cfg._attn_implementation = _attention.SP_ATTENTION
        params = inspect.signature(model.forward).parameters
        self._params = tuple(params)
        self._accepts = lambda n: n in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self._attention = [m for m in model.modules() if _attention_like(m)]
        self._ran: set[int] = set()
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._post, with_kwargs=True, always_call=True),
        ] + [m.register_forward_pre_hook(self._attention_ran) for m in self._attention]
        # sync_gradients' bookkeeping: a backward since the last sync, and one that added onto summed gradients
        self._backward_since_sync = False
        self._onto_synced: set[str] = set()
        if gradients == "sync":
            self._handles += [
                p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, name))
                for name, p in model.named_parameters() if p.requires_grad
            ]
        logger.info("safepad: sequence parallel over %d ranks (rank %d), kinds %s", self.world, self.rank, kinds)

    # ------------------------------------------------------------------------------------------ public helpers

    def shard(self, t: Tensor, dim: int = 1) -> Tensor:
        """This rank's contiguous shard of a full-row tensor along ``dim`` (length divisible by the world)."""
        n = t.shape[dim]
        if n % self.world:
            raise ValueError(f"length {n} along dim {dim} is not divisible by the {self.world} sequence-parallel ranks")
        size = n // self.world
        return t.narrow(dim, self.rank * size, size)

    def gather(self, t: Tensor, dim: int = 1) -> Tensor:
        """The full rows from every rank's shard ``t`` (differentiable), concatenated along ``dim``."""
        parts = all_gather_stack(t, self.group, self.rank, self.world)  # [W, ...]
        return torch.cat(parts.unbind(0), dim=dim)

    def _accumulated(self, name: str, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: note the backward, and whether it added onto a gradient the last sync summed
        (the summed tensor, its version one past the sync's write: accumulated in place, not zeroed first)."""
        self._backward_since_sync = True
        g = p.grad
        if g is not None and getattr(g, "_safepad_synced_version", None) == g._version - 1:
            self._onto_synced.add(name)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Sum every parameter's gradient over the group (missing gradients count as zeros).

        Call it ONCE per optimizer step, after the backward of the last micro-batch (gradient accumulation:
        ``backward()`` on every micro-batch, then one ``sync_gradients()``, then ``step()`` and ``zero_grad()``).
        Raises ``RuntimeError`` (before any exchange, on every rank) when no backward ran since the last sync (a
        second sum would multiply the gradients by the group size), or when a backward added onto the gradients
        the last sync had already summed (a sync after every micro-batch, without ``zero_grad()`` in between).
        """
        if self.gradients == "ddp":
            raise ValueError("gradients='ddp': the DDP / FSDP wrapper already combines the gradients; do not sync again")
        if not self._backward_since_sync:
            raise RuntimeError(
                "sync_gradients() called without a backward since the last sync: the gradients are already summed "
                f"over the {self.world} ranks, a second sum would multiply them by {self.world}. Call it once per "
                "optimizer step, after the last micro-batch's backward"
            )
        if self._onto_synced:
            first = sorted(self._onto_synced)[0]
            self._onto_synced = set()
            self._backward_since_sync = False
            raise RuntimeError(
                f"gradients (e.g. {first!r}) were accumulated onto gradients that an earlier sync_gradients() had "
                "already summed over the group, so this sum would count the earlier micro-batches "
                f"{self.world} times. With gradient accumulation, call sync_gradients() once, after the LAST "
                "micro-batch's backward (or zero_grad() after each sync)"
            )
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.model.parameters():
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, ps in by_dtype.items():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            i = 0
            for p in ps:
                n = p.numel()
                g = flat[i : i + n].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                p.grad._safepad_synced_version = p.grad._version  # see _accumulated
                i += n
        self._backward_since_sync = False

    def remove(self) -> None:
        """Remove the hooks and restore every config's attention implementation."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for cfg, impl in self._configs:
            cfg._attn_implementation = impl
        for m in self.model.modules():
            m.__dict__.pop("_safepad_sp_fallback", None)
            if state_of(m) is not None:
                state_of(m).last_sp = None

    # ------------------------------------------------------------------------------------------ hooks

    def _attention_ran(self, module, args):
        if current_sp() is not None:
            self._ran.add(id(module))

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict):
        if current_sp() is not None:  # nested call inside a sharded call
            self._calls.append(None)
            return None
        args = list(args)
        name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        ids = kwargs.get(name)
        if ids is None and args and isinstance(args[0], Tensor):
            ids, name = args.pop(0), "input_ids"
        if not isinstance(ids, Tensor) or ids.dim() < 2:
            raise ValueError("a sequence-parallel call needs input_ids [B, T] or inputs_embeds [B, T, C]")
        if kwargs.get("fused_lm_head"):
            raise UnsupportedSequenceParallelError(
                "fused_lm_head=True (TRL's fused LM head) computes the loss inside the forward from the full rows' "
                "labels; under sequence parallelism the loss is the SP hook's `loss` over the shards' logits: call "
                "without fused_lm_head"
            )
        if self.check_batch:  # first: a rank-specific refusal below must not leave the other ranks waiting
            check_same_call({**kwargs, name: ids}, self.group, self.rank, self.world, ids.device)
        B, Tg = ids.shape[:2]
        W, r = self.world, self.rank
        if Tg % W:
            raise ValueError(
                f"sequence parallelism over {W} ranks needs the row length to be a multiple of {W}, got {Tg}: pack to a "
                f"max_length divisible by {W}, or pad each row with its own padding segment (labels -100)"
            )
        T = Tg // W
        mask = kwargs.pop("attention_mask", None)
        if isinstance(mask, Tensor) and not bool(mask.all()):
            raise ValueError(
                "sequence parallelism does not take padding masks: pack the sequences (safepad.pack_dataset / "
                "DataCollatorForPackedSSM) and describe padding as its own segment, with labels -100"
            )
        if kwargs.get("use_cache") is True or any(kwargs.get(k) is not None for k in CACHE_NAMES):
            raise ValueError("sequence parallelism is for training calls: call with use_cache=False and no cache")
        if self._accepts("use_cache"):
            kwargs["use_cache"] = False
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, Tensor) and tuple(position_ids.shape[-2:]) != (B, Tg):
            raise ValueError(
                f"position_ids must cover the full rows [{B}, {Tg}] (every rank passes the whole batch), got "
                f"{list(position_ids.shape)}"
            )
        labels = kwargs.get("labels")
        if isinstance(labels, Tensor) and tuple(labels.shape) != (B, Tg):
            raise ValueError(f"labels must have the full rows' shape [{B}, {Tg}] (unshifted), got {list(labels.shape)}")
        seq_g, _ = normalize_boundaries(
            (B, Tg), seq_idx=kwargs.get("seq_idx"), cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
            cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
            position_ids=position_ids if isinstance(position_ids, Tensor) else None,
        )  # [B, Tg] or None (every row one sequence)
        for k in _BOUNDARY:
            kwargs.pop(k, None)
        kwargs.pop("real_token_mask", None)  # the collator's pad tail, read only by the router loss (refused here)
        for k, v in kwargs.items():
            if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[:2] == (B, Tg) and k not in (
                name, "labels", "position_ids", *_SHARDED_KWARGS
            ):
                raise ValueError(f"sequence parallelism does not know how to shard the per-token argument {k!r}")
        sl = slice(r * T, (r + 1) * T)
        kwargs[name] = ids[:, sl]
        for k in _SHARDED_KWARGS:
            if isinstance(kwargs.get(k), Tensor):
                kwargs[k] = kwargs[k][:, sl]
        if isinstance(position_ids, Tensor) or self._accepts("position_ids"):
            if not isinstance(position_ids, Tensor):
                position_ids = (
                    position_ids_from_seq_idx(seq_g)
                    if seq_g is not None
                    else torch.arange(Tg, device=ids.device).expand(B, Tg)
                )
            kwargs["position_ids"] = position_ids[..., sl].to(ids.device)  # global positions, this shard
        if seq_g is not None:
            kwargs["seq_idx"] = seq_g[:, sl].contiguous()
        labels = kwargs.pop("labels", None)
        call: dict = {"labels": None}
        if labels is not None:
            shifted = F.pad(labels[:, 1:], (0, 1), value=_IGNORE)  # [B, Tg]: the next token over the whole row
            n_items = kwargs.pop("num_items_in_batch", None)
            call["labels"] = shifted[:, sl]
            call["n_items"] = n_items if n_items is not None else (shifted != _IGNORE).sum()
        crosses = torch.zeros(W, B, dtype=torch.bool, device=ids.device)
        for q in range(1, W):
            crosses[q] = True if seq_g is None else seq_g[:, q * T - 1] == seq_g[:, q * T]
        ctx = SPContext(
            group=self.group, rank=r, world=W, offset=r * T, shape=(B, T), global_len=Tg,
            global_seq_idx=seq_g, crosses=crosses, attention_seen=set(),
        )
        call["token"] = set_sp(ctx)
        call["ctx"] = ctx
        self._ran = set()
        self._calls.append(call)
        return tuple(args), kwargs

    def _post(self, module, args, kwargs, output):
        call = self._calls.pop() if self._calls else None
        if call is None:
            return None
        reset_sp(call["token"])
        missed = self._ran - call["ctx"].attention_seen
        if missed:
            names = sorted({type(m).__name__ for m in self._attention if id(m) in missed})
            raise UnsupportedSequenceParallelError(
                f"attention module(s) {names} ran without the sequence-parallel attention (they bypass transformers' "
                "attention interface), so they saw only this rank's keys; this model cannot be sharded"
            )
        if call["labels"] is None or output is None:
            return None
        if not hasattr(output, "keys") or "logits" not in output.keys():
            raise ValueError(
                "sequence parallelism computes the loss from the model output's 'logits': call with return_dict=True "
                "(the default) on a model that returns logits"
            )
        logits = output["logits"]  # [B, T, V]
        local = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), call["labels"].reshape(-1).to(logits.device),
            ignore_index=_IGNORE, reduction="sum",
        )
        n = call["n_items"]
        n = n.to(local.device) if isinstance(n, Tensor) else torch.tensor(float(n), device=local.device)
        scale = float(self.world) if self.gradients == "ddp" else 1.0
        loss = sum_replicated(local, self.group, scale) / n.clamp(min=1).to(local.dtype)
        fields = {k: v for k, v in output.items()}
        fields["loss"] = loss
        return type(output)(**fields)
