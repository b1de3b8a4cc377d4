"""AdamW parameter groups, warmup + cosine schedule, grouped gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def _no_decay(name: str, param: nn.Parameter) -> bool:
    # biases, norm scales and scalars (temperature) are not regularised towards zero
    return param.ndim <= 1 or "norm" in name.lower() or name.endswith(".bias")


def param_groups(towers: dict[str, tuple[Any, float]], weight_decay: float) -> list[dict]:
    """AdamW decay/no-decay groups per ``{name: (module or named parameters, lr)}`` (first owner wins); frozen
    ones out."""
    seen: set[int] = set()
    groups = []
    for group_name, (module, lr) in towers.items():
        decay, no_decay = [], []
        for name, p in module.named_parameters() if isinstance(module, nn.Module) else module:
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if _no_decay(name, p) else decay).append(p)
        if decay:
            groups.append({"name": group_name, "params": decay, "lr": lr, "weight_decay": weight_decay})
        if no_decay:
            groups.append(
                {"name": f"{group_name}_no_decay", "params": no_decay, "lr": lr, "weight_decay": 0.0}
            )
    return groups


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: Callable[[], float],
    min_lr_ratio: float,
) -> LambdaLR:
    """Linear warmup from 0 to each group's LR over ``warmup_steps``, then cosine decay to ``min_lr_ratio``.

    ``total_steps()`` (``inf``: LR stays at peak) is asked only after warmup; asked earlier, the trainer would
    set up the train loader before a checkpoint's position in it is restored."""
    known: list[float] = []

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if step == warmup_steps:  # the decay's start: 1 whatever the length
            return 1.0
        if not known:
            known.append(total_steps())
            if not math.isfinite(known[0]):
                rank_zero_warn(
                    "The training length is unbounded (no trainer.max_steps or max_epochs), so the learning rate "
                    "stays at its peak after warmup instead of following the cosine decay. Set trainer.max_steps "
                    "to get the decay."
                )
        if not math.isfinite(known[0]):
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, int(known[0]) - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def clip_grouped(groups: dict[str, tuple[Iterable[nn.Parameter], float | None]]) -> dict[str, torch.Tensor]:
    """Clips each named group of parameters to its own max norm; returns each one's pre-clipping norm."""
    norms = {}
    for name, (params, max_norm) in groups.items():
        if max_norm is None:
            continue
        params = [p for p in params if p.grad is not None]
        if params:
            norms[name] = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norms


def optimizer_and_schedule(
    module: nn.Module,
    towers: dict[str, tuple[Any, float | None]],
    optim: Any,
    total_steps: Callable[[], float],
) -> dict[str, Any]:
    """Lightning's ``configure_optimizers`` dict: AdamW over towers and heads, warmup + cosine per step.

    ``towers``: name -> (tower or its named parameters, LR; None: ``optim.lr``); parameters outside them are the
    ``heads`` group."""
    rates = {name: (tower, optim.lr if lr is None else lr) for name, (tower, lr) in towers.items()}
    groups = param_groups({**rates, "heads": (module, optim.lr)}, optim.weight_decay)
    fused = optim.fused
    if fused is None:
        trainable = [p for p in module.parameters() if p.requires_grad]
        fused = bool(trainable) and all(p.is_cuda for p in trainable)
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, fused=fused)
    scheduler = warmup_cosine(optimizer, optim.warmup_steps, total_steps, optim.min_lr_ratio)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def clip_towers_and_heads(
    module: nn.Module, towers: dict[str, tuple[nn.Module, float | None]], heads_norm: float | None
) -> dict[str, torch.Tensor]:
    """Clips each tower's gradients to its own max norm, and the other (head) parameters to ``heads_norm``."""
    if heads_norm is None and all(norm is None for _, norm in towers.values()):
        return {}  # nothing to clip: no walk over the parameters every step
    in_towers = {id(p) for tower, _ in towers.values() for p in tower.parameters()}
    heads = [p for p in module.parameters() if id(p) not in in_towers]
    return clip_grouped(
        {name: (tower.parameters(), norm) for name, (tower, norm) in towers.items()}
        | {"heads": (heads, heads_norm)}
    )


def clip_gradients(
    module: Any,
    optimizer: torch.optim.Optimizer,
    towers: dict[str, tuple[nn.Module, float | None]],
    heads_norm: float | None,
    clip_val: float | None,
    algorithm: str | None,
) -> None:
    """Clips per tower and heads, then the trainer's global clipping (sharded gradients too: torch sums a norm
    over the shards)."""
    clip_towers_and_heads(module, towers, heads_norm)
    module.clip_gradients(optimizer, clip_val, algorithm)
