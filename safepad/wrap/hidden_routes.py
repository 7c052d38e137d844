"""Returned hidden states on the loss path of a re-laid call (``output_hidden_states`` with gradients).

A slot-justified call (:mod:`safepad.wrap.slot_calls`: a cached call on rows with padding after real tokens, or
an uncached hybrid call on rows with holes) runs its forward with each row re-laid ``[pads | real tokens]``; the
post-hook puts every ``[B, T, ...]`` output back in the caller's order with a gather
(:meth:`~safepad.layout.slots.SlotJustifiedCall.restore`). A gather made after the forward is a side branch of the
graph: the loss (over the restored logits or ``last_hidden_state``) does not depend on it, and
``outputs.hidden_states[i].retain_grad()`` then leaves ``.grad`` None, where stock's returned hidden states are
the tensors its forward continued from.

:class:`HiddenStateRoute` makes them so: while such a call runs with gradients and hidden states asked for, each
decoder layer's input ``x`` ``[B, T, D]`` (re-laid order) is replaced by ``reorder(restore(x))`` (bitwise ``x``,
a permutation and its inverse), and each inner base model's ``last_hidden_state`` likewise, so the forward
continues from ``restore(x)``, the caller-order tensor. The post-hook returns that same tensor for every hidden
state that is ``x`` or its replacement (:meth:`HiddenStateRoute.caller_view`), once per tensor
(``hidden_states[-1]`` and ``last_hidden_state`` stay one object, as in stock). Decoder layers are transformers'
``GradientCheckpointingLayer`` modules; with gradient checkpointing on, no route is installed (a hook inside the
checkpointed region would recompute another graph) and the returned hidden states keep ``.grad`` None there
(docs/limits.md).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

__all__ = ["HiddenStateRoute", "route_wanted"]

logger = logging.getLogger(__name__)


def _layer_class() -> type | tuple:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except Exception:  # noqa: BLE001
        return ()
    return GradientCheckpointingLayer


def _pretrained_class() -> type | tuple:
    try:
        from transformers import PreTrainedModel
    except Exception:  # noqa: BLE001
        return ()
    return PreTrainedModel


def route_wanted(module: nn.Module, named: dict) -> bool:
    """Does this call return hidden states that a backward could reach (gradients on, asked for, no checkpointing)?"""
    wanted = named.get("output_hidden_states")
    if wanted is None:
        wanted = getattr(getattr(module, "config", None), "output_hidden_states", False)
    if not wanted or not torch.is_grad_enabled():
        return False
    if module.training and any(getattr(m, "gradient_checkpointing", False) for m in module.modules()):
        return False
    return any(p.requires_grad for p in module.parameters())


class HiddenStateRoute:
    """Per call: forward hooks that make each decoder layer continue from the caller-order view of its input.

    ``call``: the call's :class:`~safepad.layout.slots.SlotJustifiedCall` (``reorder`` / ``restore`` on
    ``[B, T, ...]``); ``module``: the hooked model. :meth:`remove` takes the hooks off (the post-hook).
    """

    def __init__(self, call, module: nn.Module, shape: tuple[int, int]):
        self.call = call
        self.shape = shape
        # id(tensor) -> (tensor, its caller-order view); the tensor is kept so that its id is not reused
        self._views: dict[int, tuple[Tensor, Tensor]] = {}
        layer = _layer_class()
        pretrained = _pretrained_class()
        self._handles = []
        for m in module.modules():
            if layer and isinstance(m, layer):
                self._handles.append(m.register_forward_pre_hook(self._pre_layer, with_kwargs=True))
            elif pretrained and m is not module and isinstance(m, pretrained):
                # prepend: before the model's own post-hook, should the inner model be hooked by safepad too
                self._handles.append(m.register_forward_hook(self._post_model, prepend=True))

    def _tokens(self, x) -> bool:
        return isinstance(x, Tensor) and x.dim() >= 2 and tuple(x.shape[:2]) == self.shape and x.is_floating_point()

    def caller_view(self, x: Tensor) -> Tensor:
        """``x`` (re-laid order) in the caller's order: one tensor per ``x``, the one the forward continued from."""
        hit = self._views.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        view = self.call.restore(x)
        self._views[id(x)] = (x, view)
        return view

    def _routed(self, x: Tensor) -> Tensor:
        """``reorder(caller_view(x))``: bitwise ``x``, computed from the caller-order view."""
        view = self.caller_view(x)
        routed = self.call.reorder(view)
        self._views[id(routed)] = (routed, view)
        return routed

    def _pre_layer(self, module: nn.Module, args: tuple, kwargs: dict):
        if args and self._tokens(args[0]):
            return (self._routed(args[0]), *args[1:]), kwargs
        if self._tokens(kwargs.get("hidden_states")):
            return args, {**kwargs, "hidden_states": self._routed(kwargs["hidden_states"])}
        return None

    def _post_model(self, module: nn.Module, args, output):
        if not hasattr(output, "keys") or not self._tokens(output.get("last_hidden_state")):
            return None
        last = output["last_hidden_state"]
        routed = self._routed(last)
        output["last_hidden_state"] = routed
        hidden = output.get("hidden_states")
        if isinstance(hidden, tuple):
            output["hidden_states"] = tuple(routed if h is last else h for h in hidden)
        return output

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
