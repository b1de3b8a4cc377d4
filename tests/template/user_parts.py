"""Towers and losses as a user would write them (plain modules, not the package's base classes), for the tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


class TinyPatchTower(nn.Module):
    """Pooled features only, widths found by a dry forward; ``image_size`` the input size the data follows."""

    def __init__(self, width: int = 12, patch: int = 8, image_size: int = 32) -> None:
        super().__init__()
        self.image_size = image_size
        self.embed = nn.Conv2d(3, width, patch, stride=patch)
        self.norm = nn.BatchNorm1d(width)
        self.dry_calls = 0

    def forward(self, images: Tensor) -> Tensor:
        self.dry_calls += not torch.is_grad_enabled()
        return self.norm(self.embed(images).flatten(2).mean(2))


class TinyWordTower(nn.Module):
    """Mean of word embeddings over real tokens; ``tokenizer`` names the tokenizer its input ids come from."""

    def __init__(
        self, vocab_size: int = 36, width: int = 10, tokenizer: str = "mm-lightning/demo-bert"
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.embed = nn.Embedding(vocab_size, width)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        mask = attention_mask.unsqueeze(-1).float()
        return (self.embed(input_ids) * mask).sum(1) / mask.sum(1)


class DeclaredWidthTower(nn.Module):
    """Declares its widths and data config; the dry forward reads the declared input size (a 3x32x32 batch would
    fail)."""

    pooled_dim = 6

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3 * 48 * 48, 6)
        self.data_config = {"input_size": (3, 48, 48), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}

    def forward(self, images: Tensor) -> Tensor:
        return self.linear(images.flatten(1))


class UnpooledTower(nn.Module):
    """Breaks the contract: returns a feature map."""

    image_size = 32  # the size of the dry batch it is checked with

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 4, 8, stride=8)

    def forward(self, images: Tensor) -> Tensor:
        return self.embed(images)


class TupleTower(UnpooledTower):
    """Breaks the contract: returns a tuple."""

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        pooled = self.embed(images).flatten(2).mean(2)
        return pooled, pooled


class IdsOnlyTower(nn.Module):
    """Breaks the contract: a text tower without the attention mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(36, 4)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.embed(input_ids).mean(1)


class NotATower:
    """Not an nn.Module."""

    def __init__(self, width: int = 3) -> None:
        self.width = width


class CosineLoss(nn.Module):
    """A plain loss (no logits for the matching head): 1 - cosine of each pair, plus a named extra term."""

    def __init__(self, extra: float = 0.25) -> None:
        super().__init__()
        self.extra = extra

    def forward(
        self,
        image_emb: Tensor,
        text_emb: Tensor,
        image_ids: Tensor | None = None,
        sample_weights: Tensor | None = None,
    ) -> dict[str, Tensor]:
        cosine = nn.functional.cosine_similarity(image_emb, text_emb, dim=-1)
        return {"itc": (1 - cosine).mean(), "norm": self.extra * image_emb.pow(2).mean()}


class PerPairLoss(nn.Module):
    """Breaks the contract: one value per pair instead of a scalar."""

    def forward(self, image_emb: Tensor, text_emb: Tensor, image_ids=None, sample_weights=None) -> Tensor:  # noqa: ANN001
        return 1 - nn.functional.cosine_similarity(image_emb, text_emb, dim=-1)


def halve(x: Tensor) -> Tensor:
    return x / 2


class ActivatedPatchTower(TinyPatchTower):
    """Takes a function: a checkpoint that records it may name only one of torch's (its own default is fine)."""

    def __init__(self, activation: Callable = halve, width: int = 12) -> None:
        super().__init__(width=width)
        self.activation = activation

    def forward(self, images: Tensor) -> Tensor:
        return self.activation(super().forward(images))
