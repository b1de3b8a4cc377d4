"""Exact gradient caching for ``MultimodalModule`` (``model.grad_cache.chunks > 1``): each training batch is embedded
in chunks without graph, then back-propagated chunk by chunk (the algorithm: :mod:`mm_lightning.models.gradcache`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from mm_lightning.models.gradcache import (
    Batch,
    GradientCache,
    check_ddp_wrapper,
    check_strategy,
    warn_if_inexact,
)
from mm_lightning.models.towers.base import EncoderOutput

Embedded = tuple[EncoderOutput, Tensor, EncoderOutput, Tensor]


class GradientCaching:
    """Embeds a training batch in ``chunks`` chunks with exact gradient caching .

    Args:
        chunks: chunks per batch (> 1).
    """

    def __init__(self, chunks: int) -> None:
        if chunks < 2:
            raise ValueError(f"gradient caching needs grad_cache.chunks >= 2, got {chunks}")
        self.chunks = chunks
        self.cache: GradientCache | None = None

    def _cache(self, model: Any) -> GradientCache:
        if self.cache is None:
            parts = [model.image_encoder, model.text_encoder, model.image_proj, model.text_proj]
            self.cache = GradientCache(parts, self.chunks)
        return self.cache

    def setup(self, trainer_strategy: object, model: Any) -> None:
        """Refuses a strategy it cannot be exact under; names the towers' layers that make it inexact."""
        check_strategy(trainer_strategy)
        warn_if_inexact(
            self.chunks,
            {
                "image_encoder": (model.image_encoder, model.image_config),
                "text_encoder": (model.text_encoder, model.text_config),
            },
        )

    def check_wrapper(self, wrapped: object) -> None:
        """Refuses a DDP wrapper that would reduce the towers' gradients before pass 2 computes them."""
        check_ddp_wrapper(wrapped)

    def embed(self, model: Any, batch: Batch) -> Embedded:
        """Pass 1: the whole batch's outputs, chunk by chunk without graph."""
        return embed_in_chunks(
            self._cache(model), model.encode_images, model.encode_text, batch, tokens=model.itm is not None
        )

    def backward(self, loss: Tensor) -> bool:
        """The heads' backward, then pass 2 into the towers."""
        if self.cache is None or not self.cache.pending:
            return False
        self.cache.backward(loss)
        return True


def embed_in_chunks(
    cache: GradientCache,
    encode_images: Callable[[Tensor], tuple[EncoderOutput, Tensor]],
    encode_text: Callable[[Batch], tuple[EncoderOutput, Tensor]],
    batch: Batch,
    tokens: bool,
) -> tuple[EncoderOutput, Tensor, EncoderOutput, Tensor]:
    """Pass 1 for a two-tower model: ``(image_out, image_emb, text_out, text_emb)`` of the whole batch.

    Args:
        cache: the gradient cache (its ``backward`` then runs pass 2).
        encode_images: images -> (tower output, projected embedding).
        encode_text: batch -> (tower output, projected embedding).
        batch: the whole batch.
        tokens: keep the token sequences (an ITM head reads them); without, only the embeddings are kept.
    """

    def encode(chunk: Batch) -> dict[str, Tensor]:
        image_out, image_emb = encode_images(chunk["image"])
        text_out, text_emb = encode_text(chunk)
        out = {"image_emb": image_emb, "text_emb": text_emb}
        if tokens:
            out |= {"image_tokens": image_out.tokens, "image_mask": image_out.mask}
            out |= {"text_tokens": text_out.tokens, "text_mask": text_out.mask}
        return out

    out = cache.embed(encode, batch)
    none = out["image_emb"].new_empty(0)  # placeholders where no head reads tokens
    image_out = EncoderOutput(out["image_emb"], out.get("image_tokens", none), out.get("image_mask", none))
    text_out = EncoderOutput(out["text_emb"], out.get("text_tokens", none), out.get("text_mask", none))
    return image_out, out["image_emb"], text_out, out["text_emb"]
