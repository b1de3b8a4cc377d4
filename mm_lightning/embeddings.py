"""Embedding math shared by the losses, the module and the metrics (a leaf module)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def l2_normalize(embeddings: Tensor) -> Tensor:
    """Unit-length fp32 rows: the one place embeddings are normalized before similarities are taken.

    fp32 because cosine similarities of bf16/fp16 vectors are too coarse to rank thousands of candidates.
    """
    return F.normalize(embeddings.float(), dim=-1)
