"""Image-text matching (ITM) on hard negatives, trained through the cross-attention fusion (ALBEF)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mm_lightning.distributed import gather_no_grad, gather_with_grad, pad_to_global_length
from mm_lightning.models.fusion import CrossAttentionFusion
from mm_lightning.models.losses import PairLogits


class ImageTextMatching(nn.Module):
    """Projects both token sequences to the fusion width, fuses them and classifies match / no match.

    For every local pair it adds one hard-negative caption for the image and one hard-negative image for the
    caption, drawn with probability softmax(similarity) among pairs of *other* images. When the loss's logits
    cover the global batch (``PairLogits.global_candidates``), the negatives come from the global batch: token
    sequences are gathered with gradient, so a negative drawn from another rank still trains that rank's
    encoders.

    Args:
        image_token_dim: width of the image encoder's tokens.
        text_token_dim: width of the text encoder's tokens.
        dim: fusion width.
        num_layers: fusion layers.
        num_heads: fusion attention heads.
        bidirectional: also let text attend to image in the fusion.
    """

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
        """ITM loss and accuracy over positives + sampled negatives.

        Args:
            image_tokens: (B, N, Di) local image tokens.
            text_tokens: (B, L, Dt) local text tokens.
            text_mask: (B, L) True for real tokens.
            logits: the pair loss's logits of the local rows vs. its (local or global) candidates.
            image_ids: (B,) local image ids.
            sample_weights: (B,) optional per-pair weights.
        """
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
        neg_text = sample_hard_negatives(logits.i2t.detach(), same_image)
        neg_image = sample_hard_negatives(logits.t2i.detach(), same_image)
        has_t, has_i = neg_text >= 0, neg_image >= 0
        images = torch.cat([img, img[has_t], all_img[neg_image[has_i]]])
        texts = torch.cat([txt, all_txt[neg_text[has_t]], txt[has_i]])
        masks = torch.cat([mask, all_mask[neg_text[has_t]], mask[has_i]])
        labels = torch.cat(
            [
                torch.ones(batch, dtype=torch.long, device=img.device),
                torch.zeros(int(has_t.sum()) + int(has_i.sum()), dtype=torch.long, device=img.device),
            ]
        )
        scores = self.head(self.fusion(images, texts, masks))
        per_pair = F.cross_entropy(scores.float(), labels, reduction="none")
        accuracy = (scores.argmax(-1) == labels).float().mean()
        if sample_weights is None:
            return per_pair.mean(), accuracy
        w = sample_weights.float()
        weights = torch.cat([w, w[has_t], w[has_i]])
        return (per_pair * weights).sum() / weights.sum(), accuracy


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
