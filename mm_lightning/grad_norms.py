"""Gradient norms computed once per optimizer step and shared by everyone who needs them.

The NaN guard needs the total norm every step (is it finite?) and the gradient-norm monitor needs the
per-submodule norms on logging steps: both read :func:`step_grad_norms` in ``on_before_optimizer_step``, which
computes each quantity at most once per optimizer step (keyed by ``global_step``) and keeps it as a device tensor,
so nothing waits for the device unless a caller asks for a Python number. Gradient clipping
(:func:`mm_lightning.models.optim.clip_gradients`) does not read them: torch's ``clip_grad_norm_`` computes the
norm of each clipping group itself.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


def _grads(module: nn.Module) -> list[Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]


@dataclass
class GradNorms:
    """The L2 norms of one step's gradients of ``module`` (computed lazily, each at most once).

    Args:
        module: The LightningModule whose gradients are measured.
        step: The optimizer step they belong to.
    """

    module: nn.Module
    step: int
    _total: Tensor | None = None
    _children: dict[str, Tensor] | None = field(default=None)

    @property
    def total(self) -> Tensor | None:
        """Norm over every parameter with a gradient (``None`` if none has one)."""
        if self._total is None:
            if self._children is not None:
                norms = list(self._children.values())
                self._total = torch.linalg.vector_norm(torch.stack(norms)) if norms else None
            else:
                grads = _grads(self.module)
                self._total = torch.nn.utils.get_total_norm(grads) if grads else None
        return self._total

    @property
    def children(self) -> dict[str, Tensor]:
        """Norm per top-level submodule (``image_encoder``, ``text_encoder``, ...) that has gradients."""
        if self._children is None:
            self._children = {}
            # the network's parts (a LightningModule that holds its network as ``model``: that network's parts)
            network = getattr(self.module, "model", None)
            parent = network if isinstance(network, torch.nn.Module) else self.module
            for name, child in parent.named_children():
                grads = _grads(child)
                if grads:
                    self._children[name] = torch.nn.utils.get_total_norm(grads)
        return self._children

    def of(self, names: list[str]) -> Tensor | None:
        """Norm over the union of the named top-level submodules (e.g. a clipping group).

        Args:
            names: Top-level submodule names.
        """
        norms = [self.children[n] for n in names if n in self.children]
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else None


_CACHE: weakref.WeakKeyDictionary[nn.Module, GradNorms] = weakref.WeakKeyDictionary()


def step_grad_norms(module: nn.Module, step: int) -> GradNorms:
    """The shared :class:`GradNorms` of ``module`` for optimizer step ``step`` (call after backward).

    Args:
        module: The LightningModule.
        step: ``trainer.global_step`` at ``on_before_optimizer_step`` (one optimizer step per value).
    """
    cached = _CACHE.get(module)
    if cached is None or cached.step != step:
        cached = GradNorms(module, step)
        _CACHE[module] = cached
    return cached
