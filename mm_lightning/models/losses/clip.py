"""CLIP's symmetric InfoNCE loss, exact under data parallelism.

As open_clip's ``ClipLoss(local_loss=True, gather_with_grad=True)``: local rows vs. globally gathered columns,
through an all-gather that carries gradient (without it the other ranks' terms would be lost).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mm_lightning.distributed import gather_no_grad, gather_with_grad, world
from mm_lightning.evaluation.metrics import l2_normalize
from mm_lightning.models.losses.base import PairLogits, ScaledPairLoss


class ContrastiveLoss(ScaledPairLoss):
    """Symmetric InfoNCE on L2-normalized embeddings with a learnable temperature.

    Args:
        temperature_init: initial temperature (logit scale = 1 / temperature).
        learnable_temperature: train the temperature.
        max_logit_scale: upper clamp of the logit scale (CLIP uses 100).
        global_negatives: when distributed, score local rows against the global batch (False: local only).
    """

    def __init__(
        self,
        temperature_init: float = 0.07,
        learnable_temperature: bool = True,
        max_logit_scale: float = 100.0,
        global_negatives: bool = True,
    ) -> None:
        super().__init__(temperature_init, learnable_temperature, max_logit_scale, global_negatives)

    def logits(self, image_emb: Tensor, text_emb: Tensor, image_ids: Tensor | None = None) -> PairLogits:
        """Scaled fp32 logits of local rows vs. (global) columns, other same-image pairs masked."""
        with torch.autocast(device_type=image_emb.device.type, enabled=False):
            img, txt = l2_normalize(image_emb), l2_normalize(text_emb)
            rank, size = world()
            is_global = self.global_negatives and size > 1
            if is_global:
                all_img, all_txt = gather_with_grad(img), gather_with_grad(txt)
                offset = rank * img.shape[0]
            else:
                all_img, all_txt, offset = img, txt, 0
            scale = self.scale()
            logits_i2t = scale * img @ all_txt.T
            logits_t2i = scale * txt @ all_img.T
            targets = torch.arange(img.shape[0], device=img.device) + offset
            all_ids = None
            if image_ids is not None:
                all_ids = gather_no_grad(image_ids) if is_global else image_ids
                # other pairs of the same image are no negatives; the row's own pair stays its target
                own = targets[:, None] == torch.arange(all_ids.shape[0], device=img.device)[None, :]
                same = (image_ids[:, None] == all_ids[None, :]) & ~own
                logits_i2t = logits_i2t.masked_fill(same, float("-inf"))
                logits_t2i = logits_t2i.masked_fill(same, float("-inf"))
        return PairLogits(logits_i2t, logits_t2i, targets, all_ids, is_global)

    def loss_from_logits(self, logits: PairLogits, sample_weights: Tensor | None = None) -> Tensor:
        """Mean (or ``sample_weights``-weighted mean) over local rows of the two directions' cross-entropy."""
        with torch.autocast(device_type=logits.i2t.device.type, enabled=False):
            per_row = 0.5 * (
                F.cross_entropy(logits.i2t, logits.targets, reduction="none")
                + F.cross_entropy(logits.t2i, logits.targets, reduction="none")
            )
            if sample_weights is None:
                return per_row.mean()
            w = sample_weights.float()
            return (per_row * w).sum() / w.sum()
