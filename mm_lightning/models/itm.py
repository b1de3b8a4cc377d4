"""Image-text matching (ITM) on hard negatives, through the cross-attention fusion defined here (ALBEF)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mm_lightning.distributed import gather_no_grad, gather_with_grad, pad_to_global_length
from mm_lightning.models.losses import PairLogits


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
    """Fuses ``dim``-wide image and text tokens: image attends to text (both ways if ``bidirectional``).

    The fused vector is the image tokens' mean (+ text tokens' masked mean), so padding never changes it."""

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
        """The fused (B, out_dim) vector of (B, N, dim) image and (B, L, dim) text tokens, masked."""
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


class ImageTextMatching(nn.Module):
    """Projects both token sequences to the fusion width, fuses them and classifies match / no match.

    Per pair, hard-negative caption + image ~ softmax(similarity) over other images; global if logits are."""

    def __init__(
        self,
        image_token_dim: int,
        text_token_dim: int,
        dim: int,
        num_layers: int = 1,
        num_heads: int = 8,
        bidirectional: bool = False,
    ) -> None:
        super().__init__()
        self.image_proj = nn.Linear(image_token_dim, dim)
        self.text_proj = nn.Linear(text_token_dim, dim)
        self.fusion = CrossAttentionFusion(dim, num_heads, num_layers, bidirectional)
        self.head = nn.Linear(self.fusion.out_dim, 2)

    def forward(
        self,
        image_tokens: Tensor,
        text_tokens: Tensor,
        text_mask: Tensor,
        logits: PairLogits,
        image_ids: Tensor,
        sample_weights: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """ITM loss and accuracy over the local positives + negatives sampled from the pair loss's logits."""
        img = self.image_proj(image_tokens)
        txt = self.text_proj(text_tokens)
        mask = text_mask.bool()
        batch = img.shape[0]
        if logits.candidate_ids is None:
            raise ValueError("ITM needs the candidates' image ids: pass image_ids to the loss's logits()")
        all_ids = logits.candidate_ids
        if logits.global_candidates:
            # the candidates' token sequences live on every rank: gather them, with gradient
            txt, mask = pad_to_global_length(txt, mask)
            all_img, all_txt, all_mask = gather_with_grad(img), gather_with_grad(txt), gather_no_grad(mask)
        else:
            all_img, all_txt, all_mask = img, txt, mask
        same_image = image_ids[:, None] == all_ids[None, :]
        neg_text, has_t = sample_hard_negatives(logits.i2t.detach(), same_image)
        neg_image, has_i = sample_hard_negatives(logits.t2i.detach(), same_image)
        # Fixed shapes (B positives, B negative captions, B negative images): nothing waits for the device to
        # count the rows that have a negative; a row without one is scored and weighted 0.
        images = torch.cat([img, img, all_img[neg_image]])
        texts = torch.cat([txt, all_txt[neg_text], txt])
        masks = torch.cat([mask, all_mask[neg_text], mask])
        labels = torch.cat(
            [torch.ones(batch, dtype=torch.long, device=img.device), img.new_zeros(2 * batch).long()]
        )
        scores = self.head(self.fusion(images, texts, masks))
        per_pair = F.cross_entropy(scores.float(), labels, reduction="none")
        counted = torch.cat([torch.ones_like(has_t), has_t, has_i]).float()
        correct = (scores.argmax(-1) == labels).float()
        accuracy = (correct * counted).sum() / counted.sum()
        w = counted if sample_weights is None else sample_weights.float().repeat(3) * counted
        return (per_pair * w).sum() / w.sum(), accuracy

    def match_logits(self, image_tokens: Tensor, text_tokens: Tensor, text_mask: Tensor) -> Tensor:
        """Each pair's "match" logit (the head's class 1, as LAVIS re-ranks) from tokens already projected by
        ``image_proj`` and ``text_proj``."""
        return self.head(self.fusion(image_tokens, text_tokens, text_mask))[:, 1]


def sample_hard_negatives(
    scores: Tensor, positive: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Per row, one non-``positive`` column drawn ~ softmax(score), without waiting for the device.

    Returns:
        (B,) column indices and (B,) bools, False for a row whose columns are all positive (its index is then
        any column, to be weighted 0)."""
    with torch.no_grad():
        has_negative = (~positive).any(dim=1)
        # a row without a negative draws from a uniform row instead of an all -inf (NaN) softmax
        logits = scores.float().masked_fill(positive, float("-inf"))
        logits = torch.where(has_negative[:, None], logits, 0.0)
        probs = torch.softmax(logits, dim=1)
        # a row of NaN or inf scores gives no usable softmax: uniform over its admissible columns
        usable = probs.sum(dim=1, keepdim=True) > 0
        probs = torch.where(usable, probs, (~positive).float())
        # torch.multinomial's own draw for one sample (argmax of p / Exp(1)), without its checks that wait
        # for the device: the same columns from the same generator state
        noise = torch.empty_like(probs).exponential_(1, generator=generator)
        drawn = (probs / noise).argmax(dim=1)
    return drawn, has_negative
