"""SigLIP: the pairwise sigmoid image-text loss (Zhai et al., "Sigmoid Loss for Language Image Pre-Training").

Every image-caption pair is an independent binary problem, ``-log sigmoid(z_ij * (t * <x_i, y_j> + b))`` with
``z_ij = +1`` for matching pairs and ``-1`` otherwise, summed over the columns and averaged over the images.
No softmax normalizes over the batch, so the loss needs no global view of a row: under data parallelism each
rank scores its images against its own captions, then against each other rank's captions as they pass by on
a ring (the paper's "chunked" implementation, as in open_clip's ``SigLipLoss``), and never materializes the
global similarity matrix or the gathered embeddings.

The exchange carries gradient: the gradient of a caption that was scored on another rank travels back along
the ring, so the mean of the ranks' losses and the (DDP-averaged) gradients equal the single-process loss
and gradients on the concatenated batch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mm_lightning.models.losses import distributed_world, gather_no_grad


def ring_shift(tensor: Tensor) -> Tensor:
    """Sends ``tensor`` to the next rank and returns the previous rank's (no gradient)."""
    rank, world = distributed_world()
    received = torch.empty_like(tensor)
    # both directions posted before waiting, so no rank blocks on a send its neighbour has not received yet
    requests = [
        dist.isend(tensor.contiguous(), (rank + 1) % world),
        dist.irecv(received, (rank - 1) % world),
    ]
    for request in requests:
        request.wait()
    return received


def _ring_unshift(tensor: Tensor) -> Tensor:
    """The reverse of :func:`ring_shift`: to the previous rank, from the next one."""
    rank, world = distributed_world()
    received = torch.empty_like(tensor)
    requests = [
        dist.isend(tensor.contiguous(), (rank - 1) % world),
        dist.irecv(received, (rank + 1) % world),
    ]
    for request in requests:
        request.wait()
    return received


class _RingShiftWithGrad(torch.autograd.Function):
    """:func:`ring_shift` whose backward returns each gradient to the rank the tensor came from.

    Hand-written rather than imported from ``open_clip.loss`` (which has the same exchange) because open_clip
    is an optional dependency and importing it loads its whole model zoo.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: Tensor) -> Tensor:
        return ring_shift(tensor)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        return _ring_unshift(grad)


class SigLipLoss(nn.Module):
    """Sigmoid pairwise image-text loss with a learnable temperature and bias, exact across ranks.

    The logit of a pair is ``exp(t') * cos(x_i, y_j) + b``; the paper initializes ``t' = log 10`` and
    ``b = -10`` so that the many negatives do not dominate the first steps. Pairs that share an image id
    (several captions of one image) are positives of each other, which the sigmoid loss handles naturally.
    Math runs in fp32 with autocast disabled.

    Args:
        temperature_init: initial temperature ``1 / exp(t')`` (0.1: the paper's ``t' = log 10``).
        bias_init: initial bias ``b``.
        learnable_temperature: train ``t'``.
        learnable_bias: train ``b``.
        max_logit_scale: upper clamp of ``exp(t')``.
        global_negatives: when distributed, also score the other ranks' captions (ring exchange);
            False uses only the local batch.
    """

    def __init__(
        self,
        temperature_init: float = 0.1,
        bias_init: float = -10.0,
        learnable_temperature: bool = True,
        learnable_bias: bool = True,
        max_logit_scale: float = 100.0,
        global_negatives: bool = True,
    ) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(
            torch.tensor(math.log(1.0 / temperature_init)), requires_grad=learnable_temperature
        )
        self.logit_bias = nn.Parameter(torch.tensor(float(bias_init)), requires_grad=learnable_bias)
        self.max_log_scale = math.log(max_logit_scale)
        self.global_negatives = global_negatives

    @property
    def temperature(self) -> Tensor:
        """Current temperature (1 / clamped logit scale)."""
        return 1.0 / self.scale()

    def scale(self) -> Tensor:
        """Clamped logit scale ``exp(t')``."""
        return self.logit_scale.clamp(max=self.max_log_scale).exp()

    def _block(self, img: Tensor, txt: Tensor, row_ids: Tensor, col_ids: Tensor) -> Tensor:
        """Per-row loss of ``img`` against one block of captions, summed over the block's columns."""
        logits = self.scale() * img @ txt.T + self.logit_bias
        signs = (row_ids[:, None] == col_ids[None, :]).float() * 2 - 1
        return -F.logsigmoid(signs * logits).sum(dim=1)

    def _global_ids(self, image_ids: Tensor | None, batch: int, device: torch.device) -> Tensor:
        """All ranks' image ids (rank-major), after checking that every rank holds ``batch`` rows."""
        rank, world = distributed_world()
        sizes = gather_no_grad(torch.tensor([batch], device=device)) if world > 1 else None
        if sizes is not None and bool((sizes != batch).any()):
            raise ValueError(
                f"SigLipLoss with global negatives needs the same batch size on every rank, got {sizes.tolist()} "
                "(use a DistributedSampler, which pads ranks to equal length, or drop_last=True)"
            )
        if image_ids is None:  # every pair its own image: the global row index identifies it
            return torch.arange(world * batch, device=device)
        return gather_no_grad(image_ids)

    def forward(
        self,
        image_emb: Tensor,
        text_emb: Tensor,
        image_ids: Tensor | None = None,
        sample_weights: Tensor | None = None,
    ) -> Tensor:
        """Loss of the local images against all (global) captions, averaged over the local images.

        Args:
            image_emb: (B, D) local image embeddings (need not be normalized).
            text_emb: (B, D) local text embeddings, row i paired with image row i.
            image_ids: (B,) image ids; pairs sharing an id are positives. None: only row i matches row i.
            sample_weights: (B,) optional per-image weights (weighted mean over the local rows).
        """
        with torch.autocast(device_type=image_emb.device.type, enabled=False):
            img = F.normalize(image_emb.float(), dim=-1)
            txt = F.normalize(text_emb.float(), dim=-1)
            rank, world = distributed_world()
            batch = img.shape[0]
            distributed = self.global_negatives and world > 1
            if distributed:
                all_ids = self._global_ids(image_ids, batch, img.device).view(world, batch)
            else:
                all_ids = (image_ids if image_ids is not None else torch.arange(batch, device=img.device))[
                    None
                ]
            own_ids = all_ids[rank if distributed else 0]
            per_row = self._block(img, txt, own_ids, own_ids)
            if distributed:
                passing = txt
                for step in range(1, world):
                    passing = _RingShiftWithGrad.apply(passing)
                    per_row = per_row + self._block(img, passing, own_ids, all_ids[(rank - step) % world])
            if sample_weights is None:
                return per_row.mean()
            w = sample_weights.float()
            return (per_row * w).sum() / w.sum()

    def logits(
        self, image_emb: Tensor, text_emb: Tensor, image_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Detached logits of local rows vs. (global) columns, for hard-negative mining (not for the loss).

        Returns:
            ``(logits_i2t, logits_t2i, targets)``: (B, N) each, targets (B,) = column of each row's own pair.
        """
        with torch.no_grad(), torch.autocast(device_type=image_emb.device.type, enabled=False):
            img = F.normalize(image_emb.float(), dim=-1)
            txt = F.normalize(text_emb.float(), dim=-1)
            rank, world = distributed_world()
            offset = 0
            all_img, all_txt = img, txt
            if self.global_negatives and world > 1:
                all_img, all_txt, offset = gather_no_grad(img), gather_no_grad(txt), rank * img.shape[0]
            scale, bias = self.scale(), self.logit_bias
            targets = torch.arange(img.shape[0], device=img.device) + offset
            return scale * img @ all_txt.T + bias, scale * txt @ all_img.T + bias, targets
