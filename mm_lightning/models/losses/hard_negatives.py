"""Hard-negative sampling for image-text matching (ALBEF): negatives drawn in proportion to similarity."""

from __future__ import annotations

import torch
from torch import Tensor


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
