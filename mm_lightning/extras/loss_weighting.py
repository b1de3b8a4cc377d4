"""Loss weighting beyond fixed weights: Dynamic Weight Averaging of the itc and itm terms
(``model.term_weighting``) and per-pair weights by sample complexity (``model.sample_weighting``).

    model:
      term_weighting: {class_path: mm_lightning.extras.DynamicWeightAveraging, init_args: {window: 50}}
      sample_weighting: {class_path: mm_lightning.extras.ComplexityWeighting}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mm_lightning.distributed import all_reduce_mean
from mm_lightning.models.losses.objective import SampleWeighting, TermWeighting


def complexity_weights(images: Tensor, attention_mask: Tensor) -> Tensor:
    """Per-pair weights, mean 1 per batch, from image detail and caption length."""
    with torch.no_grad():
        img = images.float()
        detail = (img[..., 1:, :] - img[..., :-1, :]).abs().mean((1, 2, 3)) + (
            img[..., :, 1:] - img[..., :, :-1]
        ).abs().mean((1, 2, 3))
        length = attention_mask.float().sum(1)
        return 0.5 * (detail / detail.mean().clamp_min(1e-12) + length / length.mean().clamp_min(1e-12))


class ComplexityWeighting(SampleWeighting):
    """Weights each pair by its image's detail and its caption's length (mean 1 per batch)."""

    reads_pixels = True

    def __call__(self, batch: dict[str, Tensor]) -> Tensor:
        return complexity_weights(batch["image"], batch["attention_mask"])


class DynamicWeightAveraging(TermWeighting):
    """Dynamic Weight Averaging (Liu et al., 2019) of the itc and itm terms over windows of training steps; its
    state lives in buffers (saved with the model). A loss's other terms keep their fixed weights.

    Per window: w_k = fixed_k * K * softmax_k(r_k / temperature), r_k = its mean loss / the previous window's;
    the fixed weights until two windows are done.

    Args:
        window: steps per window.
        temperature: softmax temperature (large: uniform weights)."""

    TERMS = ("itc", "itm")

    def __init__(self, window: int = 50, temperature: float = 2.0) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"DynamicWeightAveraging: window must be >= 1, got {window}")
        self.window = window
        self.temperature = temperature
        size = len(self.TERMS)
        self.register_buffer("factors", torch.ones(size))  # of the fixed weights
        self.register_buffer("window_sum", torch.zeros(size))
        self.register_buffer("previous_mean", torch.zeros(size))
        self.register_buffer("steps_in_window", torch.zeros((), dtype=torch.long))
        self.register_buffer("windows_done", torch.zeros((), dtype=torch.long))

    def forward(self, terms: dict[str, Tensor], fixed: dict[str, Any]) -> dict[str, Any]:
        zero = torch.zeros_like(next(iter(terms.values())))
        factors = self.update(torch.stack([terms.get(name, zero) for name in self.TERMS]))
        return {**fixed, **{name: fixed[name] * factors[i] for i, name in enumerate(self.TERMS)}}

    def update(self, losses: Tensor, reduce_mean: Callable[[Tensor], Tensor] = all_reduce_mean) -> Tensor:
        """Records this step's (K,) losses; returns the factors of the fixed weights (the same on every rank)."""
        self.window_sum += losses.detach().float().to(self.window_sum.device)
        self.steps_in_window += 1
        if int(self.steps_in_window) == self.window:
            window_sum = reduce_mean(self.window_sum)
            mean = window_sum / self.window
            if int(self.windows_done) >= 1:
                ratio = mean / self.previous_mean.clamp_min(1e-12)
                self.factors.copy_(ratio.numel() * torch.softmax(ratio / self.temperature, dim=0))
            self.previous_mean.copy_(mean)
            self.window_sum.zero_()
            self.steps_in_window.zero_()
            self.windows_done += 1
        return self.factors
