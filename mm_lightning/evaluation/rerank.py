"""Retrieval re-ranked by the image-text matching head, as ALBEF and BLIP evaluate (LAVIS's ``compute_sim_matrix``).

Each query's top ``k`` candidates by cosine similarity are re-scored with the head's "match" logit plus the cosine;
the other candidates keep their cosine order below them. Recall@n for n <= k is LAVIS's figure; ranks beyond k stay
defined. Every process scores every query (the work is not split over processes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from mm_lightning import ExplainedError
from mm_lightning.evaluation.metrics import Ranks, l2_normalize
from mm_lightning.recorded import Recorded

if TYPE_CHECKING:  # the models import this module (the reranker slot): no import back at load time
    from mm_lightning.models.itm import ImageTextMatching

BELOW_TOP_K = (
    1000.0  # subtracted from the cosine of candidates outside the top k: they rank after every top k one
)


class NoMatchingHead(ExplainedError, ValueError):
    """Re-ranking was asked of a model without the matching head."""


class Reranker(Recorded):
    """Keeps an epoch's unique rows (embeddings and projected tokens) and ranks them with re-scored top-k lists.

    Args:
        k: candidates re-scored per query.
        pairs_per_forward: image-text pairs per forward of the matching head.
    """

    def __init__(self, k: int, pairs_per_forward: int = 256) -> None:
        if k < 1:
            raise ValueError(f"re-ranking needs k >= 1, got {k}")
        self.k, self.pairs_per_forward = k, pairs_per_forward
        self.reset()

    def reset(self) -> None:
        self.rows: list[dict[str, Tensor]] = []
        self.images: dict[int, tuple[Tensor, Tensor]] = {}  # image id -> (embedding, projected tokens)

    def add(self, itm: ImageTextMatching | None, rows: dict[str, Tensor]) -> None:
        """Adds a global batch's unique valid rows (``index``, ``ids``, embeddings, token sequences)."""
        if itm is None:
            raise NoMatchingHead(
                "re-ranking needs the image-text matching head, which this model does not have (it was trained"
                " with objective.itm_weight: 0)"
            )
        rows = {k: v.float() if v.is_floating_point() else v for k, v in rows.items()}
        with torch.no_grad(), torch.autocast(rows["index"].device.type, enabled=False):  # fp32 (see ranks)
            self.rows.append(
                {
                    "index": rows["index"],
                    "ids": rows["ids"],
                    "text": l2_normalize(rows["text_emb"].float()),
                    "tokens": itm.text_proj(rows["text_tokens"]),
                    "mask": rows["text_mask"].bool(),
                }
            )
            for row, image_id in enumerate(rows["ids"].tolist()):
                if image_id not in self.images:
                    image = l2_normalize(rows["image_emb"][row].float())
                    self.images[image_id] = (image, itm.image_proj(rows["image_tokens"][row]))

    @torch.no_grad()
    def ranks(self, itm: ImageTextMatching, alignment_gap: Tensor, chunk_size: int = 256) -> Ranks:
        """The epoch's re-ranked ranks, both directions (``alignment_gap`` is passed through).

        In fp32: it runs at the epoch's end, outside the steps' autocast."""
        device = self.rows[0]["index"].device
        with torch.autocast(device.type, enabled=False):
            return self._ranks(itm, alignment_gap, chunk_size)

    def _ranks(self, itm: ImageTextMatching, alignment_gap: Tensor, chunk_size: int) -> Ranks:
        length = max(r["tokens"].shape[1] for r in self.rows)
        index = torch.cat([r["index"] for r in self.rows])
        order = index.argsort()
        text = torch.cat([r["text"] for r in self.rows])[order]
        tokens = torch.cat([F.pad(r["tokens"], (0, 0, 0, length - r["tokens"].shape[1])) for r in self.rows])
        mask = torch.cat([F.pad(r["mask"], (0, length - r["mask"].shape[1])) for r in self.rows])
        tokens, mask = tokens[order], mask[order]
        image_ids = sorted(self.images)
        images = torch.stack([self.images[i][0] for i in image_ids])
        image_tokens = torch.stack([self.images[i][1] for i in image_ids])
        ids = torch.cat([r["ids"] for r in self.rows])[order]
        sorted_ids = torch.tensor(image_ids, device=ids.device)
        column = torch.searchsorted(sorted_ids, ids)

        def match(image_rows: Tensor, text_rows: Tensor) -> Tensor:
            out = []
            for start in range(0, len(image_rows), self.pairs_per_forward):
                i = image_rows[start : start + self.pairs_per_forward]
                t = text_rows[start : start + self.pairs_per_forward]
                out.append(itm.match_logits(image_tokens[i], tokens[t], mask[t]).float())
            return torch.cat(out)

        t2i = torch.empty(len(text), dtype=torch.long, device=text.device)
        for start in range(0, len(text), chunk_size):
            queries = torch.arange(start, min(start + chunk_size, len(text)), device=text.device)
            similarity = text[queries] @ images.T
            top = self._top(similarity)
            scores = rescored(similarity, top, match(top.flatten(), queries.repeat_interleave(top.shape[1])))
            col = column[queries, None]
            wrong = torch.ones_like(scores, dtype=torch.bool).scatter_(1, col, False)
            t2i[queries] = ((scores >= scores.gather(1, col)) & wrong).sum(1)
        i2t = torch.empty(len(images), dtype=torch.long, device=text.device)
        for start in range(0, len(images), chunk_size):
            queries = torch.arange(start, min(start + chunk_size, len(images)), device=text.device)
            similarity = images[queries] @ text.T
            top = self._top(similarity)
            scores = rescored(similarity, top, match(queries.repeat_interleave(top.shape[1]), top.flatten()))
            positive = column[None, :] == queries[:, None]
            best = scores.masked_fill(~positive, float("-inf")).amax(1, keepdim=True)
            i2t[queries] = ((scores >= best) & ~positive).sum(1)
        return Ranks(t2i, i2t, alignment_gap, column, index[order], sorted_ids)

    def _top(self, similarity: Tensor) -> Tensor:
        return similarity.topk(min(self.k, similarity.shape[1]), dim=1).indices


def rescored(similarity: Tensor, top: Tensor, logits: Tensor) -> Tensor:
    """``similarity`` (queries x candidates) with each row's ``top`` columns scored match logit + cosine."""
    return (similarity - BELOW_TOP_K).scatter(1, top, logits.view_as(top) + similarity.gather(1, top))
