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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mm_lightning.distributed import gather_no_grad, world
from mm_lightning.evaluation.metrics import l2_normalize
from mm_lightning.models.losses.base import PairLogits, ScaledPairLoss


def _exchange(tensor: Tensor, step: int) -> Tensor:
    """Sends ``tensor`` to rank ``rank + step`` and returns the one rank ``rank - step`` sent (no gradient)."""
    rank, size = world()
    received = torch.empty_like(tensor)
    # both directions posted before waiting, so no rank blocks on a send its neighbour has not received yet
    requests = [
        dist.isend(tensor.contiguous(), (rank + step) % size),
        dist.irecv(received, (rank - step) % size),
    ]
    for request in requests:
        request.wait()
    return received


def ring_shift(tensor: Tensor) -> Tensor:
    """Sends ``tensor`` to the next rank and returns the previous rank's (no gradient)."""
    return _exchange(tensor, 1)


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
        return _exchange(grad, -1)


class SigLipLoss(ScaledPairLoss):
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
        super().__init__(temperature_init, learnable_temperature, max_logit_scale, global_negatives)
        self.logit_bias = nn.Parameter(torch.tensor(float(bias_init)), requires_grad=learnable_bias)

    def _block(self, img: Tensor, txt: Tensor, row_ids: Tensor, col_ids: Tensor) -> Tensor:
        """Per-row loss of ``img`` against one block of captions, summed over the block's columns."""
        logits = self.scale() * img @ txt.T + self.logit_bias
        signs = (row_ids[:, None] == col_ids[None, :]).float() * 2 - 1
        return -F.logsigmoid(signs * logits).sum(dim=1)

    def _global_ids(self, image_ids: Tensor | None, batch: int, device: torch.device) -> Tensor:
        """All ranks' image ids (rank-major), after checking that every rank holds ``batch`` rows."""
        size = world()[1]
        sizes = gather_no_grad(torch.tensor([batch], device=device)) if size > 1 else None
        if sizes is not None and bool((sizes != batch).any()):
            raise ValueError(
                f"SigLipLoss with global negatives needs the same batch size on every rank, got {sizes.tolist()} "
                "(use a DistributedSampler, which pads ranks to equal length, or drop_last=True)"
            )
        if image_ids is None:  # every pair its own image: the global row index identifies it
            return torch.arange(size * batch, device=device)
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
            img, txt = l2_normalize(image_emb), l2_normalize(text_emb)
            rank, size = world()
            batch = img.shape[0]
            distributed = self.global_negatives and size > 1
            if distributed:
                all_ids = self._global_ids(image_ids, batch, img.device).view(size, batch)
            else:
                all_ids = (image_ids if image_ids is not None else torch.arange(batch, device=img.device))[
                    None
                ]
            own_ids = all_ids[rank if distributed else 0]
            per_row = self._block(img, txt, own_ids, own_ids)
            if distributed:
                passing = txt
                for step in range(1, size):
                    passing = _RingShiftWithGrad.apply(passing)
                    per_row = per_row + self._block(img, passing, own_ids, all_ids[(rank - step) % size])
            return _weighted_mean(per_row, sample_weights)

    def loss_and_logits(
        self,
        image_emb: Tensor,
        text_emb: Tensor,
        image_ids: Tensor | None = None,
        sample_weights: Tensor | None = None,
    ) -> tuple[Tensor, PairLogits]:
        """The ring-exchanged loss, and detached logits for hard-negative mining.

        Args:
            image_emb: (B, D) local image embeddings (need not be normalized).
            text_emb: (B, D) local text embeddings, row i paired with image row i.
            image_ids: (B,) image ids; pairs sharing an id are positives.
            sample_weights: (B,) optional per-image weights.
        """
        loss = self(image_emb, text_emb, image_ids, sample_weights)
        return loss, self.logits(image_emb, text_emb, image_ids)

    def logits(self, image_emb: Tensor, text_emb: Tensor, image_ids: Tensor | None = None) -> PairLogits:
        """Logits of local rows vs. candidates, for hard-negative mining; global candidates carry no gradient.

        With global negatives the columns are gathered without gradient (mining only needs the ranking); the
        loss itself never gathers: call the loss module, not :meth:`loss_from_logits`, to train.

        Args:
            image_emb: (B, D) local image embeddings (need not be normalized).
            text_emb: (B, D) local text embeddings, row i paired with image row i.
            image_ids: (B,) image ids; pairs sharing an id are positives.
        """
        with torch.autocast(device_type=image_emb.device.type, enabled=False):
            img, txt = l2_normalize(image_emb), l2_normalize(text_emb)
            rank, size = world()
            is_global = self.global_negatives and size > 1
            all_img, all_txt, offset = img, txt, 0
            if is_global:
                all_img, all_txt = gather_no_grad(img.detach()), gather_no_grad(txt.detach())
                offset = rank * img.shape[0]
            all_ids = None
            if image_ids is not None:
                all_ids = gather_no_grad(image_ids) if is_global else image_ids
            scale, bias = self.scale(), self.logit_bias
            targets = torch.arange(img.shape[0], device=img.device) + offset
            i2t, t2i = scale * img @ all_txt.T + bias, scale * txt @ all_img.T + bias
        return PairLogits(i2t, t2i, targets, all_ids, is_global)

    def loss_from_logits(self, logits: PairLogits, sample_weights: Tensor | None = None) -> Tensor:
        """The sigmoid loss from local logits (image rows; same-id columns are positives).

        Args:
            logits: what :meth:`logits` returned for local candidates.
            sample_weights: (B,) optional per-image weights.
        """
        if logits.global_candidates:
            raise ValueError(
                "SigLipLoss exchanges captions over a ring to compute the global loss; global logits() are for "
                "hard-negative mining only (no gradient). Call the loss module itself to train."
            )
        with torch.autocast(device_type=logits.i2t.device.type, enabled=False):
            rows = torch.arange(logits.i2t.shape[0], device=logits.i2t.device)
            if logits.candidate_ids is None:
                positive = rows[:, None] == torch.arange(logits.i2t.shape[1], device=rows.device)[None, :]
            else:
                positive = logits.candidate_ids[logits.targets][:, None] == logits.candidate_ids[None, :]
            signs = positive.float() * 2 - 1
            per_row = -F.logsigmoid(signs * logits.i2t).sum(dim=1)
            return _weighted_mean(per_row, sample_weights)


def _weighted_mean(per_row: Tensor, sample_weights: Tensor | None) -> Tensor:
    if sample_weights is None:
        return per_row.mean()
    w = sample_weights.float()
    return (per_row * w).sum() / w.sum()
