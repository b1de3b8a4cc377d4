"""Evaluation epochs (validation, test): retrieval metrics over the whole split and the loss on its unique rows.

The loss counts each valid record once per epoch, whatever the world size: stand-ins for bad records and a
distributed sampler's padding are dropped, as rows and as negatives. Loaded only when a run evaluates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from mm_lightning.data.records import STAND_IN_KEY
from mm_lightning.distributed import gather_rows, pad_to_global_length, single_process, world
from mm_lightning.metrics import Ranks, RetrievalMetrics, first_occurrence
from mm_lightning.models.losses.base import l2_normalize, weighted_sum
from mm_lightning.models.towers.base import EncoderOutput


@dataclass
class EvalBatch:
    """The unique valid rows of a (global) evaluation batch."""

    ids: Tensor
    weights: Tensor | None
    image_out: EncoderOutput
    image_emb: Tensor
    text_out: EncoderOutput
    text_emb: Tensor

    @property
    def count(self) -> int:
        return int(self.ids.shape[0])


def _gather(tensor: Tensor) -> Tensor:
    if tensor.dtype == torch.bool:  # sent as bytes: not every backend all-gathers bool
        return gather_rows(tensor.to(torch.uint8)).bool()
    return gather_rows(tensor)


class EvalRows:
    """Remembers the records scored this epoch (on all ranks) and selects each batch's new valid rows."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def reset(self) -> None:
        """Start of an evaluation epoch."""
        self.seen.clear()

    def keep(self, index: Tensor, stand_in: Tensor) -> Tensor:
        """(N,) bool: not a stand-in and the first row of its record this epoch (in rank-major order)."""
        out = []
        for i, copy in zip(index.tolist(), stand_in.tolist(), strict=True):
            new = not copy and i not in self.seen
            if new:
                self.seen.add(i)
            out.append(new)
        return torch.tensor(out, dtype=torch.bool, device=index.device)

    def gather_unique(
        self,
        batch: dict[str, Tensor],
        image_out: EncoderOutput,
        image_emb: Tensor,
        text_out: EncoderOutput,
        text_emb: Tensor,
        weights: Tensor | None,
        tokens: bool,
    ) -> EvalBatch | None:
        """The global batch (same on each rank) restricted to its unique valid rows, or None if none is left.

        ``tokens``: also gather the token sequences (for the ITM head).
        """
        index = batch["index"]
        stand_in = batch.get(STAND_IN_KEY)
        if stand_in is None:
            stand_in = torch.zeros_like(index, dtype=torch.bool)
        text_tokens, text_mask = text_out.tokens, text_out.mask
        if tokens:
            text_tokens, text_mask = pad_to_global_length(text_tokens, text_mask)
        fields: dict[str, Tensor | None] = {
            "index": index,
            "stand_in": stand_in.to(index.device),
            "ids": batch["image_id"],
            "weights": weights,
            "image_emb": image_emb,
            "text_emb": text_emb,
            "image_pooled": image_out.pooled,
            "text_pooled": text_out.pooled,
        }
        if tokens:
            fields |= {
                "image_tokens": image_out.tokens,
                "image_mask": image_out.mask,
                "text_tokens": text_tokens,
                "text_mask": text_mask,
            }
        if world()[1] > 1:  # evaluation: no gradient; ranks may hold different row counts
            fields = {k: None if v is None else _gather(v) for k, v in fields.items()}
        keep = self.keep(fields.pop("index"), fields.pop("stand_in"))  # type: ignore[arg-type]
        if not bool(keep.any()):
            return None
        rows = {k: None if v is None else v[keep] for k, v in fields.items()}
        if tokens:
            image_out = EncoderOutput(rows["image_pooled"], rows["image_tokens"], rows["image_mask"])
            text_out = EncoderOutput(rows["text_pooled"], rows["text_tokens"], rows["text_mask"])
        else:  # the loss reads only the pooled outputs; the token fields are left as they are
            image_out = EncoderOutput(rows["image_pooled"], image_out.tokens, image_out.mask)
            text_out = EncoderOutput(rows["text_pooled"], text_out.tokens, text_out.mask)
        return EvalBatch(
            rows["ids"], rows["weights"], image_out, rows["image_emb"], text_out, rows["text_emb"]
        )  # type: ignore[arg-type]


def unique_rows_loss(
    eval_rows: EvalRows,
    model: Any,
    batch: dict[str, Tensor],
    outputs: tuple[EncoderOutput, Tensor, EncoderOutput, Tensor],
    weights: Tensor | None,
    term_weights: Mapping[str, Any],
) -> tuple[Tensor, int]:
    """The training objective (fixed weights) over the batch's unique valid rows, and their number.

    Distributed, every rank computes the same value on the gathered global batch (a single process's value).
    """
    # the ITM head needs the token sequences of the global batch too (each rank then scores all its rows)
    rows = eval_rows.gather_unique(batch, *outputs, weights, tokens=model.itm is not None)
    if rows is None:  # nothing new in this global batch
        return torch.zeros((), device=outputs[1].device), 0
    with single_process():
        terms, _ = model.losses(
            rows.ids, rows.weights, rows.image_out, rows.image_emb, rows.text_out, rows.text_emb
        )
    return weighted_sum(terms, term_weights), rows.count


class Evaluation(nn.Module):
    """One evaluation epoch's state (the retrieval metrics, the rows scored) and its step."""

    def __init__(self) -> None:
        super().__init__()
        self.retrieval = RetrievalMetrics()
        self.rows = EvalRows()
        self.last_ranks: Ranks | None = None  # the last epoch's, for a report (``evaluate``)

    def start_epoch(self) -> None:
        self.rows.reset()

    def step(self, module: LightningModule, batch: dict[str, Tensor], stage: str) -> dict[str, Tensor]:
        """Logs ``<stage>/loss``, adds the batch to the metrics, returns its normalized embeddings (per pair).

        Each distinct image is encoded once; the embeddings serve callbacks without a second forward.
        """
        image_ids, first, column = first_occurrence(batch["image_id"])
        unique_out, unique_emb = module.model.encode_images(batch["image"][first])
        text_out, text_emb = module.model.encode_text(batch)
        # the loss sees one row per pair (caption), as in training
        image_out = EncoderOutput(
            unique_out.pooled[column], unique_out.tokens[column], unique_out.mask[column]
        )
        outputs = (image_out, unique_emb[column], text_out, text_emb)
        weights = module.sample_weights(batch)
        loss, rows = unique_rows_loss(self.rows, module.model, batch, outputs, weights, module.term_weights)
        # weighted by the rows that count, so the epoch value is the mean over unique valid records
        module.log(f"{stage}/loss", loss, batch_size=rows, sync_dist=True)
        self.retrieval.update(unique_emb, image_ids, text_emb, batch["image_id"], batch["index"])
        return {
            "image_embeddings": l2_normalize(unique_emb[column].float()),
            "text_embeddings": l2_normalize(text_emb.float()),
        }

    def end_epoch(self, module: LightningModule, stage: str) -> None:
        """Logs ``<stage>/r{1,5,10}_{t2i,i2t}`` and ``alignment_gap`` over the epoch's unique rows."""
        if self.retrieval.update_count == 0:
            return
        # gathered over ranks by torchmetrics: identical on every rank
        self.last_ranks = self.retrieval.compute_ranks()
        self.retrieval.reset()
        metrics = self.last_ranks.metrics(self.retrieval.ks)
        # already equal on every rank: the max keeps each value exact (a mean over 3 ranks may not) and tells
        # Lightning the value is global (else it warns about sync_dist once per metric)
        module.log_dict(
            {f"{stage}/{k}": float(v) for k, v in metrics.items()}, sync_dist=True, reduce_fx="max"
        )
