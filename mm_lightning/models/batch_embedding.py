"""How ``MultimodalModule`` embeds a training batch: in one forward (:class:`WholeBatch`), or in chunks with exact
gradient caching (``model.grad_cache.chunks > 1``: :mod:`mm_lightning.models.chunked_embedding`, loaded only
then). The training step calls ``embed`` and, from Lightning's ``backward``,
``backward``; it has no branch for either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from mm_lightning.models.towers.base import EncoderOutput

if TYPE_CHECKING:
    from mm_lightning.models.chunked_embedding import GradientCaching

Batch = dict[str, Any]
Embedded = tuple[EncoderOutput, Tensor, EncoderOutput, Tensor]


class WholeBatch:
    """Embeds a training batch in one forward of each tower (the default; see :class:`GradientCaching`)."""

    def setup(self, trainer_strategy: object, model: Any) -> None:
        """Checks at fit start (none needed)."""

    def check_wrapper(self, wrapped: object) -> None:
        """Checks the model as the strategy wrapped it, when training starts (none needed)."""

    def embed(self, model: Any, batch: Batch) -> Embedded:
        """``(image_out, image_emb, text_out, text_emb)`` of the batch, with their graphs."""
        image_out, image_emb = model.encode_images(batch["image"])
        text_out, text_emb = model.encode_text(batch)
        return image_out, image_emb, text_out, text_emb

    def backward(self, loss: Tensor) -> bool:
        """Back-propagates ``loss`` itself when it must (False: the ordinary backward is right)."""
        return False


def batch_embedding(chunks: int) -> WholeBatch | GradientCaching:
    """How to embed training batches: in one forward (``chunks`` 1) or with gradient caching."""
    if chunks < 1:
        raise ValueError(f"grad_cache.chunks must be >= 1, got {chunks}")
    if chunks == 1:
        return WholeBatch()
    from mm_lightning.models.chunked_embedding import GradientCaching

    return GradientCaching(chunks)
