"""A tiny two-tower model whose forward is a full contrastive training step, with or without gradient caching."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mm_lightning.extras.gradient_caching import GradientCache
from mm_lightning.models.losses import ContrastiveLoss

IN_DIM, EMBED_DIM = 12, 8


def toy_batch(size: int, seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    image_id = torch.arange(size) // 2  # two captions per image: same-image pairs are not negatives
    return {
        "image": torch.randn(size, IN_DIM, generator=g),
        "text": torch.randn(size, IN_DIM, generator=g),
        "image_id": image_id,
    }


class ToyTowers(nn.Module):
    def __init__(self, dropout: float = 0.0, batch_norm: bool = False) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(32) if batch_norm else nn.LayerNorm(32)
        self.image = nn.Sequential(
            nn.Linear(IN_DIM, 32), norm, nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 16)
        )
        self.text = nn.Sequential(nn.Linear(IN_DIM, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 16))

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"image": self.image(batch["image"]), "text": self.text(batch["text"])}


class ToyModel(nn.Module):
    """Towers, a head on the embeddings (projections) and a contrastive loss with a learnable temperature."""

    def __init__(self, chunks: int = 1, loss: nn.Module | None = None, **tower_args) -> None:
        super().__init__()
        self.towers = ToyTowers(**tower_args)
        self.head = nn.Linear(16, EMBED_DIM)
        self.loss = loss if loss is not None else ContrastiveLoss()
        self.cache = GradientCache(self.towers, chunks) if chunks > 1 else None

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        out = self.cache.embed(self.towers, batch) if self.cache is not None else self.towers(batch)
        return self.loss(self.head(out["image"]), self.head(out["text"]), batch["image_id"])

    def backward(self, loss: Tensor) -> None:
        if self.cache is not None:
            self.cache.backward(loss)
        else:
            loss.backward()


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)
