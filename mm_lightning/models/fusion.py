"""Cross-attention fusion of image and text token sequences (ALBEF/BLIP-style, feeding the ITM head)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class _CrossAttentionBlock(nn.Module):
    """Queries attend to a context sequence; post-norm residual attention + residual MLP."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, num_heads, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim)
        )
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, queries: Tensor, context: Tensor, context_padding: Tensor | None) -> Tensor:
        attended, _ = self.attn(
            queries, context, context, key_padding_mask=context_padding, need_weights=False
        )
        x = self.norm1(queries + attended)
        return self.norm2(x + self.mlp(x))


class CrossAttentionFusion(nn.Module):
    """Fuses image tokens with text tokens.

    Each layer lets image tokens attend to the text tokens (padding masked out through ``key_padding_mask``)
    and, with ``bidirectional``, text tokens attend to the image tokens. The fused vector is the mean of the
    image tokens, concatenated with the masked mean of the text tokens when bidirectional, so padding never
    changes it.

    Args:
        dim: token width (both inputs must already be projected to it).
        num_heads: attention heads.
        num_layers: stacked fusion layers.
        bidirectional: also run the text -> image direction.
        mlp_ratio: MLP hidden width / dim.
        dropout: dropout in attention and MLP.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        num_layers: int = 1,
        bidirectional: bool = False,
        mlp_ratio: float = 2.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"fusion dim {dim} must be divisible by num_heads {num_heads}")
        self.image_blocks = nn.ModuleList(
            _CrossAttentionBlock(dim, num_heads, mlp_ratio, dropout) for _ in range(num_layers)
        )
        self.text_blocks = (
            nn.ModuleList(_CrossAttentionBlock(dim, num_heads, mlp_ratio, dropout) for _ in range(num_layers))
            if bidirectional
            else None
        )
        self.out_dim = dim * (2 if bidirectional else 1)

    def forward(self, image_tokens: Tensor, text_tokens: Tensor, text_mask: Tensor) -> Tensor:
        """Returns the fused (B, out_dim) vector.

        Args:
            image_tokens: (B, N, dim).
            text_tokens: (B, L, dim).
            text_mask: (B, L), nonzero/True for real tokens.
        """
        text_mask = text_mask.bool()
        padding = ~text_mask
        img, txt = image_tokens, text_tokens
        for i, image_block in enumerate(self.image_blocks):
            new_img = image_block(img, txt, padding)
            if self.text_blocks is not None:
                # image tokens carry no padding; text queries at padding positions are ignored by the pooling
                txt = self.text_blocks[i](txt, img, None)
            img = new_img
        fused = img.mean(dim=1)
        if self.text_blocks is None:
            return fused
        weights = text_mask.unsqueeze(-1).to(txt.dtype)
        text_fused = (txt * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return torch.cat([fused, text_fused], dim=-1)
