"""Loss weighting beyond fixed weights, loaded when chosen: per-pair weights by sample complexity
(``objective.sample_weighting: complexity``) and Dynamic Weight Averaging (``objective.weighting: dwa``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mm_lightning.distributed import all_reduce_mean


def complexity_weights(images: Tensor, attention_mask: Tensor) -> Tensor:
    """Per-pair weights, mean 1 per batch, from image detail and caption length."""
    with torch.no_grad():
        img = images.float()
        detail = (img[..., 1:, :] - img[..., :-1, :]).abs().mean((1, 2, 3)) + (
            img[..., :, 1:] - img[..., :, :-1]
        ).abs().mean((1, 2, 3))
        length = attention_mask.float().sum(1)
        return 0.5 * (detail / detail.mean().clamp_min(1e-12) + length / length.mean().clamp_min(1e-12))


class DynamicWeightAveraging(nn.Module):
    """Dynamic Weight Averaging (Liu et al., 2019) over windows of training steps; state lives in buffers.

    Per window: w_k = base_k * K * softmax_k(r_k / temperature), r_k = its mean loss / the previous window's;
    base weights until two windows are done.

    Args:
        base_weights: fixed weight of each loss (their order is the losses' order).
        window: steps per window.
        temperature: softmax temperature (large: uniform weights)."""

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
        """Records this step's (K,) losses and returns this step's weights (same on every rank)."""
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
