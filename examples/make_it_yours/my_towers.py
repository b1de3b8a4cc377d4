"""A user's own towers (see README "Make it yours"): plain ``nn.Module``s, chosen in YAML by ``class_path``.

The tower contract (mm_lightning/models/towers/contract.py): an image tower's ``forward(images)`` and a text
tower's ``forward(input_ids, attention_mask)`` return (B, D) pooled features, or an ``EncoderOutput`` when they
also give token sequences to the fusion (ITM). Widths are read from one dry forward; ``data_config`` is optional.
An image tower's ``image_size`` is the side the data prepares images at (and the dry forward's); a text tower's
``tokenizer`` names the tokenizer its input ids come from (the data uses it).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mm_lightning.models.towers import EncoderOutput


class PatchMLP(nn.Module):
    """Non-overlapping patches, embedded and mixed by an MLP: every patch a token, their mean the pooled vector.

    Args:
        width: embedding width.
        patch: patch side in pixels.
        image_size: the image side in pixels (the data prepares images at this size).
    """

    def __init__(self, width: int = 128, patch: int = 8, image_size: int = 64) -> None:
        super().__init__()
        self.image_size = image_size
        self.embed = nn.Conv2d(3, width, patch, stride=patch)
        self.mlp = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, images: Tensor) -> EncoderOutput:
        patches = self.embed(images).flatten(2).transpose(1, 2)  # (B, N, width)
        tokens = patches + self.mlp(patches)
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        return EncoderOutput(pooled=tokens.mean(1), tokens=tokens, mask=mask)


class MeanOfWords(nn.Module):
    """Word embeddings averaged over a caption's real tokens: pooled features only (the fusion gets one token).

    Args:
        vocab_size: the tokenizer's vocabulary size.
        width: embedding width.
        tokenizer: the tokenizer the input ids come from (a Hugging Face name or directory; the data uses it).
    """

    def __init__(
        self, vocab_size: int = 30522, width: int = 128, tokenizer: str = "mm-lightning/demo-bert"
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        mask = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        mean = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return mean + self.mix(mean)
