"""A tiny LightningModule with BatchNorm, frozen, rank-local and never-used parameters, plus its data."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from mm_lightning.models import ContrastiveLoss


def tiny_loader(n: int = 96, batch_size: int = 4, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    y = torch.randn(n, 4, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class TinyNet(pl.LightningModule):
    """MLP with BatchNorm; two param groups in one SGD (momentum + weight decay make ``None`` vs 0 grads differ).

    Args:
        rank0_only_head: add a head whose output enters the loss on rank 0 only, and a never-used layer.
        overflow_rank1_steps: global steps at which rank 1 multiplies its loss by 1e6 (fp16 overflow there only).
        manual: manual optimization with two optimizers (body, head) and an explicit reduce per optimizer.
        manual_reduce: in manual optimization, call ``strategy.reduce_gradients`` (False: forget to).
        loss_scale: multiplies the loss (large values make gradient clipping bite).
        contrastive: add the project's ContrastiveLoss (global negatives through a gradient-carrying all-gather)
            between the head output and a projection of the targets.
        lr: SGD learning rate of the body (the head gets half).
    """

    def __init__(
        self,
        rank0_only_head: bool = False,
        overflow_rank1_steps: tuple[int, ...] = (),
        manual: bool = False,
        manual_reduce: bool = True,
        loss_scale: float = 1.0,
        contrastive: bool = False,
        lr: float = 0.1,
    ) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU()
        )
        self.head = nn.Linear(16, 4)
        self.frozen = nn.Linear(8, 4).requires_grad_(False)
        self.rank0_only_head = nn.Linear(16, 4) if rank0_only_head else None
        self.never_used = nn.Linear(3, 3) if rank0_only_head else None
        self.contrastive = ContrastiveLoss() if contrastive else None
        self.target_proj = nn.Linear(4, 4) if contrastive else None
        self.overflow_rank1_steps = overflow_rank1_steps
        self.lr = lr
        self.loss_scale = loss_scale
        self.manual_reduce = manual_reduce
        self.automatic_optimization = not manual
        self.pre_clip_grad_norms: list[float] = []

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        features = self.body(x)
        out = self.head(features)
        loss = self.loss_scale * nn.functional.mse_loss(out + self.frozen(x), y)
        if self.contrastive is not None and self.target_proj is not None:
            loss = loss + self.contrastive(out, self.target_proj(y))
        if self.rank0_only_head is not None and self.global_rank == 0:
            loss = loss + self.rank0_only_head(features).pow(2).mean()
        if self.global_rank == 1 and self.global_step in self.overflow_rank1_steps:
            loss = loss * 1e6
        return loss

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        if self.automatic_optimization:
            return self.loss(batch)
        # Stock DDP reduces inside manual_backward; ExplicitAllReduceDDPStrategy wants the explicit call.
        reduce_gradients = (
            getattr(self.trainer.strategy, "reduce_gradients", None) if self.manual_reduce else None
        )
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(self.loss(batch))
            if reduce_gradients is not None:
                reduce_gradients(opt)
            opt.step()
        return None

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Runs after the reduction (and unscaling) but before clipping: records what clipping will see.
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.pre_clip_grad_norms.append(
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        )

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        body = list(self.body.parameters())
        rest = [p for n, p in self.named_parameters() if not n.startswith("body.") and p.requires_grad]
        if not self.automatic_optimization:
            return [torch.optim.SGD(body, lr=self.lr, momentum=0.9), torch.optim.SGD(rest, lr=self.lr / 2)]
        groups = [{"params": body[:2], "lr": self.lr}, {"params": body[2:] + rest, "lr": self.lr / 2}]
        return torch.optim.SGD(groups, lr=self.lr, momentum=0.9, weight_decay=1e-2)
