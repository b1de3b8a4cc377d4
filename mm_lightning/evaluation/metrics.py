"""Image-text retrieval metrics under the multi-caption protocol (COCO/Flickr: any caption in the top k).

Images are deduplicated by ``image_id``, so each is one candidate. Ties count against the query, so constant
embeddings score chance, never 1.0; scoring is chunked to bound memory at chunk x images.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat


def l2_normalize(embeddings: Tensor) -> Tensor:
    """Unit-length fp32 rows (bf16/fp16 cosines are too coarse to rank thousands of candidates)."""
    return torch.nn.functional.normalize(embeddings.float(), dim=-1)


DEFAULT_KS = (1, 5, 10)


def first_occurrence(values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Distinct values (sorted), the position of the first occurrence of each, and each value's slot."""
    unique, inverse = torch.unique(values, sorted=True, return_inverse=True)
    order = torch.arange(values.numel(), device=values.device)
    first = torch.full_like(unique, values.numel(), dtype=torch.long).scatter_reduce(
        0, inverse, order, reduce="amin"
    )
    return unique, first, inverse


def dedup_images(image_emb: Tensor, image_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One embedding per distinct image id: ``(sorted ids, their embeddings, each row's column)``."""
    unique_ids, first, column = first_occurrence(image_ids)
    return unique_ids, image_emb[first], column


@torch.no_grad()
def retrieval_metrics(
    image_emb: Tensor,
    text_emb: Tensor,
    image_ids: Tensor,
    ks: tuple[int, ...] = DEFAULT_KS,
    chunk_size: int = 1024,
) -> dict[str, Tensor]:
    """Recall@k both directions plus the alignment gap, from (N, D) per-row embeddings (cosine similarity).

    ``alignment_gap``: mean positive-pair cosine minus mean cosine of non-matching caption-image pairs.
    """
    img, txt = l2_normalize(image_emb), l2_normalize(text_emb)
    _, images, column = dedup_images(img, image_ids)
    n_text, n_img = txt.shape[0], images.shape[0]
    return retrieval_ranks(lambda s, e: txt[s:e] @ images.T, n_text, n_img, column, chunk_size).metrics(ks)


@torch.no_grad()
def similarity_retrieval_metrics(
    similarity: Tensor, column: Tensor, ks: tuple[int, ...] = DEFAULT_KS, chunk_size: int = 1024
) -> dict[str, Tensor]:
    """The same metrics from a (T, I) captions x distinct images similarity and each caption's ``column``."""
    sim = similarity.float()
    return retrieval_ranks(lambda s, e: sim[s:e], sim.shape[0], sim.shape[1], column, chunk_size).metrics(ks)


@dataclass
class Ranks:
    """Where each query's answer lands: 0 is first. Ties count against the query."""

    t2i: Tensor  # (captions,): candidates of other images scoring >= the caption's own image
    i2t: Tensor  # (images,): captions of other images scoring >= the image's best caption
    alignment_gap: Tensor
    column: Tensor  # (captions,): each caption's image, a position in ``i2t``
    # who the queries are, to pair them with another evaluation's (sorted dataset index; sorted image id)
    caption_index: Tensor | None = None
    image_ids: Tensor | None = None

    def metrics(self, ks: tuple[int, ...] = DEFAULT_KS) -> dict[str, Tensor]:
        """``r{k}_t2i``, ``r{k}_i2t`` (recall@k: the share of queries whose answer ranks below k), ``alignment_gap``."""
        out = {}
        for k in ks:
            out[f"r{k}_t2i"] = (self.t2i < k).float().mean()
            out[f"r{k}_i2t"] = (self.i2t < k).float().mean()
        return out | {"alignment_gap": self.alignment_gap}


def retrieval_ranks(
    scores: Callable[[int, int], Tensor], n_text: int, n_img: int, column: Tensor, chunk_size: int
) -> Ranks:
    """The ranks of both directions from ``scores(start, end)``: captions ``start:end`` x distinct images."""
    device = column.device
    t2i_rank = torch.empty(n_text, dtype=torch.long, device=device)
    best_positive = torch.full((n_img,), float("-inf"), device=device)
    pos_sum = torch.zeros((), device=device)
    total_sum = torch.zeros((), device=device)
    for start in range(0, n_text, chunk_size):
        sim = scores(start, start + chunk_size)  # (c, I)
        col = column[start : start + chunk_size]
        positive = sim.gather(1, col[:, None])  # (c, 1)
        wrong = torch.ones_like(sim, dtype=torch.bool).scatter_(1, col[:, None], False)
        t2i_rank[start : start + chunk_size] = ((sim >= positive) & wrong).sum(1)
        best_positive = best_positive.scatter_reduce(0, col, positive.squeeze(1), reduce="amax")
        pos_sum += positive.sum()
        total_sum += sim.sum()
    # second pass: per image, count captions of other images scoring >= its best caption (needs all captions)
    i2t_rank = torch.zeros(n_img, dtype=torch.long, device=device)
    for start in range(0, n_text, chunk_size):
        sim = scores(start, start + chunk_size)
        col = column[start : start + chunk_size]
        wrong = torch.ones_like(sim, dtype=torch.bool).scatter_(1, col[:, None], False)
        i2t_rank += ((sim >= best_positive[None, :]) & wrong).sum(0)
    n_neg = n_text * n_img - n_text
    neg_mean = (total_sum - pos_sum) / n_neg if n_neg > 0 else torch.zeros((), device=device)
    return Ranks(t2i_rank, i2t_rank, pos_sum / n_text - neg_mean, column)


class RetrievalMetrics(Metric):
    """Recall@k (both directions) and the alignment gap over an evaluation epoch, on any number of ranks.

    Captions are deduplicated by dataset ``index`` and images by ``image_id``, so padding never counts twice.

    Args:
        ks: recall cut-offs.
        chunk_size: captions scored per chunk (bounds memory to chunk_size x images).
        kwargs: ``torchmetrics.Metric`` options.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, ks: tuple[int, ...] = DEFAULT_KS, chunk_size: int = 1024, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ks = tuple(ks)
        self.chunk_size = chunk_size
        for name in ("image", "image_id", "text", "text_image_id", "index"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(
        self, image_emb: Tensor, image_ids: Tensor, text_emb: Tensor, text_image_ids: Tensor, index: Tensor
    ) -> None:
        """Adds one batch: its images and ids, and its caption rows with their image ids and dataset index."""
        self.image.append(l2_normalize(image_emb))
        self.image_id.append(image_ids)
        self.text.append(l2_normalize(text_emb))
        self.text_image_id.append(text_image_ids)
        self.index.append(index)

    def compute(self) -> dict[str, Tensor]:
        """The metrics over the unique caption rows against the unique images they refer to."""
        return self._ranks().metrics(self.ks)

    def compute_ranks(self) -> Ranks:
        """Each unique caption's rank of its image and each image's rank of its best caption (of all processes,
        like :meth:`compute`)."""
        with self.sync_context():
            return self._ranks()

    def _ranks(self) -> Ranks:
        caption_index, keep, _ = first_occurrence(dim_zero_cat(self.index))
        text, text_ids = dim_zero_cat(self.text)[keep], dim_zero_cat(self.text_image_id)[keep]
        stored_ids, images, _ = dedup_images(dim_zero_cat(self.image), dim_zero_cat(self.image_id))
        wanted, column = torch.unique(text_ids, sorted=True, return_inverse=True)
        slot = torch.searchsorted(stored_ids, wanted).clamp_max(max(len(stored_ids) - 1, 0))
        if len(stored_ids) == 0 or not torch.equal(stored_ids[slot], wanted):
            raise ValueError("RetrievalMetrics: some captions refer to images that were never added")
        images = images[slot]
        ranks = retrieval_ranks(
            lambda s, e: text[s:e] @ images.T, text.shape[0], images.shape[0], column, self.chunk_size
        )
        ranks.caption_index, ranks.image_ids = caption_index, wanted
        return ranks
