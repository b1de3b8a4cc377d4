"""Image-text contrastive loss (exact under data parallelism), ITM hard-negative sampling, loss weighting.

The distributed contrastive loss follows open_clip's ``ClipLoss(local_loss=True, gather_with_grad=True)``:
each rank scores its local rows against the globally gathered columns, and the all-gather carries gradient.
The mean of the ranks' losses then equals the single-process loss on the concatenated batch, and each rank's
feature gradient is world_size x the single-process one, so DDP's gradient averaging yields the exact
gradient. A gather without gradient would drop the other ranks' terms.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


def distributed_world() -> tuple[int, int]:
    """(rank, world_size) of the default process group, (0, 1) when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_with_grad(tensor: Tensor) -> Tensor:
    """Concatenates every rank's ``tensor`` along dim 0; the gradient flows back to the owning rank.

    The backward sums the gradients of all ranks for each slice (a reduce-scatter), which is what makes the
    global contrastive loss exact. All ranks must pass tensors of the same shape.
    """
    if distributed_world()[1] == 1:
        return tensor
    return _GatherWithGrad.apply(tensor)


class _GatherWithGrad(torch.autograd.Function):
    """All-gather whose backward sums each slice's gradient over the ranks (a reduce-scatter).

    Hand-written because torch's public ``torch.distributed.nn.functional.all_gather`` is deprecated and its
    suggested replacement, ``_functional_collectives.all_gather_single``, returns lazily-waited tensors: on gloo a
    2-process CLI run crashed with SIGSEGV and "unwaited collective calls" at exit. Here every collective is
    synchronous.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: Tensor) -> Tensor:
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(out, tensor.contiguous())
        return torch.cat(out, dim=0)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        grad = grad.contiguous()
        if dist.get_backend() == "nccl":
            local = torch.empty_like(grad.chunk(world)[rank])
            dist.reduce_scatter_tensor(local, grad)
            return local
        # gloo has no reduce-scatter: sum the whole gradient, keep this rank's slice
        total = grad.clone()
        dist.all_reduce(total)
        return total.chunk(world)[rank].contiguous()


def gather_no_grad(tensor: Tensor) -> Tensor:
    """Concatenates every rank's ``tensor`` along dim 0 without gradient (ids, masks, sampling weights)."""
    world = distributed_world()[1]
    if world == 1:
        return tensor
    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor.contiguous())
    return torch.cat(out, dim=0)


def pad_to_global_length(tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Pads (B, L, D) tokens and (B, L) mask along L to the longest L over all ranks (for gathering)."""
    if distributed_world()[1] == 1:
        return tokens, mask
    length = torch.tensor([tokens.shape[1]], device=tokens.device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    extra = int(length.item()) - tokens.shape[1]
    if extra == 0:
        return tokens, mask
    return F.pad(tokens, (0, 0, 0, extra)), F.pad(mask, (0, extra), value=False)


class ContrastiveLoss(nn.Module):
    """Symmetric InfoNCE on L2-normalized embeddings with a learnable temperature.

    The similarity and loss math always runs in fp32 (autocast disabled) so bf16/fp16 training does not
    round the logits.

    Args:
        temperature_init: initial temperature (logit scale = 1 / temperature).
        learnable_temperature: train the temperature.
        max_logit_scale: upper clamp of the logit scale (CLIP uses 100).
        global_negatives: when distributed, score local rows against the gathered global batch; False uses
            only the local batch as negatives.
    """

    def __init__(
        self,
        temperature_init: float = 0.07,
        learnable_temperature: bool = True,
        max_logit_scale: float = 100.0,
        global_negatives: bool = True,
    ) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(
            torch.tensor(math.log(1.0 / temperature_init)), requires_grad=learnable_temperature
        )
        self.max_log_scale = math.log(max_logit_scale)
        self.global_negatives = global_negatives

    @property
    def temperature(self) -> Tensor:
        """Current temperature (1 / clamped logit scale)."""
        return 1.0 / self.scale()

    def scale(self) -> Tensor:
        """Clamped logit scale."""
        return self.logit_scale.clamp(max=self.max_log_scale).exp()

    def logits(
        self, image_emb: Tensor, text_emb: Tensor, image_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Scaled fp32 logits of local rows vs. (global) columns, with same-image non-diagonal pairs masked.

        Returns:
            ``(logits_i2t, logits_t2i, targets)``: (B, N) each, targets (B,) = column of each row's own pair.
        """
        with torch.autocast(device_type=image_emb.device.type, enabled=False):
            img = F.normalize(image_emb.float(), dim=-1)
            txt = F.normalize(text_emb.float(), dim=-1)
            rank, world = distributed_world()
            if self.global_negatives and world > 1:
                all_img, all_txt = gather_with_grad(img), gather_with_grad(txt)
                offset = rank * img.shape[0]
            else:
                all_img, all_txt, offset = img, txt, 0
            scale = self.scale()
            logits_i2t = scale * img @ all_txt.T
            logits_t2i = scale * txt @ all_img.T
            targets = torch.arange(img.shape[0], device=img.device) + offset
            if image_ids is not None:
                all_ids = gather_no_grad(image_ids) if all_img is not img else image_ids
                same = image_ids[:, None] == all_ids[None, :]
                same[torch.arange(img.shape[0], device=img.device), targets] = False
                logits_i2t = logits_i2t.masked_fill(same, float("-inf"))
                logits_t2i = logits_t2i.masked_fill(same, float("-inf"))
        return logits_i2t, logits_t2i, targets

    def forward(
        self,
        image_emb: Tensor,
        text_emb: Tensor,
        image_ids: Tensor | None = None,
        sample_weights: Tensor | None = None,
    ) -> Tensor:
        """Loss of the local rows (average of image->text and text->image cross-entropy).

        Args:
            image_emb: (B, D) local image embeddings (need not be normalized).
            text_emb: (B, D) local text embeddings, row i paired with image row i.
            image_ids: (B,) image ids; pairs sharing an id are not negatives of each other.
            sample_weights: (B,) optional per-pair weights (weighted mean over the local rows).
        """
        logits_i2t, logits_t2i, targets = self.logits(image_emb, text_emb, image_ids)
        return self.loss_from_logits(logits_i2t, logits_t2i, targets, sample_weights)

    @staticmethod
    def loss_from_logits(
        logits_i2t: Tensor, logits_t2i: Tensor, targets: Tensor, sample_weights: Tensor | None = None
    ) -> Tensor:
        """Mean (or ``sample_weights``-weighted mean) over local rows of the two directions' cross-entropy."""
        with torch.autocast(device_type=logits_i2t.device.type, enabled=False):
            per_row = 0.5 * (
                F.cross_entropy(logits_i2t, targets, reduction="none")
                + F.cross_entropy(logits_t2i, targets, reduction="none")
            )
            if sample_weights is None:
                return per_row.mean()
            w = sample_weights.float()
            return (per_row * w).sum() / w.sum()


def sample_hard_negatives(
    scores: Tensor, positive: Tensor, generator: torch.Generator | None = None
) -> Tensor:
    """Draws one negative column per row with probability softmax(score) over non-positive columns (ALBEF).

    Args:
        scores: (B, N) similarity logits.
        positive: (B, N) bool, True where a column must not be drawn (the pair itself, same image).
        generator: optional RNG.

    Returns:
        (B,) column indices; -1 for rows that have no admissible negative.
    """
    with torch.no_grad():
        logits = scores.float().masked_fill(positive, float("-inf"))
        has_negative = (~positive).any(dim=1)
        probs = torch.softmax(logits[has_negative], dim=1)
        # softmax can underflow to all-zero for very peaked rows; fall back to uniform over admissible columns
        dead = probs.sum(dim=1) <= 0
        probs[dead] = (~positive[has_negative][dead]).float()
        drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        out = torch.full((scores.shape[0],), -1, dtype=torch.long, device=scores.device)
        out[has_negative] = drawn
    return out


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

    def update(self, losses: Tensor, reduce_mean: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Records this step's (detached) losses and returns the weights to use for this step.

        Args:
            losses: (K,) loss values of this step.
            reduce_mean: averages a tensor over ranks, so every rank derives the same weights.
        """
        self.window_sum += losses.detach().float().to(self.window_sum.device)
        self.steps_in_window += 1
        if int(self.steps_in_window) == self.window:
            window_sum = reduce_mean(self.window_sum) if reduce_mean is not None else self.window_sum
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
