"""Loss weighting: the named terms' weighted sum, Dynamic Weight Averaging across the losses, and per-pair
data-complexity weights."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from mm_lightning.distributed import all_reduce_mean


def complexity_weights(images: Tensor, attention_mask: Tensor) -> Tensor:
    """Per-pair weights from data complexity: image detail and caption length, mean 1 per batch.

    Image detail is the mean absolute difference between neighbouring pixels (busy images score high).

    Args:
        images: (B, 3, H, W) images.
        attention_mask: (B, L) caption masks (their sums are the caption lengths).
    """
    with torch.no_grad():
        img = images.float()
        detail = (img[..., 1:, :] - img[..., :-1, :]).abs().mean((1, 2, 3)) + (
            img[..., :, 1:] - img[..., :, :-1]
        ).abs().mean((1, 2, 3))
        length = attention_mask.float().sum(1)
        return 0.5 * (detail / detail.mean().clamp_min(1e-12) + length / length.mean().clamp_min(1e-12))


class DynamicWeightAveraging(nn.Module):
    """Dynamic Weight Averaging (Liu et al., 2019) over windows of training steps.

    At the end of each window the weight of loss k becomes
    ``base_k * K * softmax_k(ratio_k / T)`` with ``ratio_k`` = this window's mean loss / the previous one's,
    so a loss that stops decreasing gains weight. Until two windows are complete the base weights are used.
    State lives in buffers so it is checkpointed.

    Args:
        base_weights: fixed weight of each loss (order defines the loss order).
        window: steps per window.
        temperature: softmax temperature T (large -> uniform).
    """

    def __init__(self, base_weights: list[float], window: int = 50, temperature: float = 2.0) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"DWA window must be >= 1, got {window}")
        self.window = window
        self.temperature = temperature
        base = torch.tensor(base_weights, dtype=torch.float32)
        self.register_buffer("base", base)
        self.register_buffer("weights", base.clone())
        self.register_buffer("window_sum", torch.zeros_like(base))
        self.register_buffer("previous_mean", torch.zeros_like(base))
        self.register_buffer("steps_in_window", torch.zeros((), dtype=torch.long))
        self.register_buffer("windows_done", torch.zeros((), dtype=torch.long))

    def update(self, losses: Tensor, reduce_mean: Callable[[Tensor], Tensor] = all_reduce_mean) -> Tensor:
        """Records this step's (detached) losses and returns the weights to use for this step.

        Args:
            losses: (K,) loss values of this step.
            reduce_mean: averages a tensor over ranks, so every rank derives the same weights.
        """
        self.window_sum += losses.detach().float().to(self.window_sum.device)
        self.steps_in_window += 1
        if int(self.steps_in_window) == self.window:
            window_sum = reduce_mean(self.window_sum)
            mean = window_sum / self.window
            if int(self.windows_done) >= 1:
                ratio = mean / self.previous_mean.clamp_min(1e-12)
                k = ratio.numel()
                self.weights.copy_(self.base * k * torch.softmax(ratio / self.temperature, dim=0))
            self.previous_mean.copy_(mean)
            self.window_sum.zero_()
            self.steps_in_window.zero_()
            self.windows_done += 1
        return self.weights


def weighted_sum(terms: dict[str, Tensor], weights: Mapping[str, Any]) -> Tensor:
    """The loss terms' sum, each times the weight of its name (1 when it has none), in the terms' order.

    Args:
        terms: scalar loss terms by name (``itc``, ``itm``, a loss's own).
        weights: weight by name (floats, or tensors such as DWA's).
    """
    items = iter(terms.items())
    name, term = next(items)
    total = weights.get(name, 1.0) * term
    for name, term in items:
        total = total + weights.get(name, 1.0) * term
    return total
