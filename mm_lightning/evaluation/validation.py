"""Evaluation epochs (validation, test): retrieval metrics over the whole split and the loss on its unique rows.

Each valid record counts once per epoch, whatever the world size: stand-ins for bad records and a distributed
sampler's padding are dropped, as rows and as negatives; the loss is scored on fixed chunks of records in file
order (:class:`ChunkedLoss`). Loaded only when a run evaluates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from mm_lightning.data.records import STAND_IN_KEY
from mm_lightning.distributed import gather_rows, pad_to_global_length, single_process, world
from mm_lightning.evaluation.metrics import Ranks, RetrievalMetrics, first_occurrence, l2_normalize
from mm_lightning.evaluation.rerank import Reranker
from mm_lightning.models.losses.base import weighted_sum
from mm_lightning.models.towers.contract import EncoderOutput


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
    ) -> dict[str, Tensor] | None:
        """The global batch (same on each rank) restricted to its unique valid rows, in file order, or None if
        none is left. ``tokens``: with the token sequences (for the ITM head)."""
        index = batch["index"]
        stand_in = batch.get(STAND_IN_KEY)
        if stand_in is None:
            stand_in = torch.zeros_like(index, dtype=torch.bool)
        fields: dict[str, Tensor | None] = {
            "index": index,
            "stand_in": stand_in.to(index.device),
            "ids": batch["image_id"],
            "weights": weights,
            "image_emb": image_emb,
            "text_emb": text_emb,
        }
        if tokens:
            text_tokens, text_mask = pad_to_global_length(text_out.tokens, text_out.mask)
            fields |= {
                "image_tokens": image_out.tokens,
                "image_mask": image_out.mask,
                "text_tokens": text_tokens,
                "text_mask": text_mask,
            }
        if world()[1] > 1:  # evaluation: no gradient; ranks may hold different row counts
            fields = {k: None if v is None else _gather(v) for k, v in fields.items()}
        keep = self.keep(fields["index"], fields.pop("stand_in"))  # type: ignore[arg-type]
        if not bool(keep.any()):
            return None
        order = fields["index"][keep].argsort()  # type: ignore[index]
        return {k: v[keep][order] for k, v in fields.items() if v is not None}


def _concat(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    if len(parts) == 1:
        return parts[0]
    parts = [dict(p) for p in parts]
    if "text_tokens" in parts[0]:  # captions of different batches are padded to different lengths
        length = max(p["text_tokens"].shape[1] for p in parts)
        for p in parts:
            extra = length - p["text_tokens"].shape[1]
            p["text_tokens"] = F.pad(p["text_tokens"], (0, 0, 0, extra))
            p["text_mask"] = F.pad(p["text_mask"], (0, extra), value=False)
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


class ChunkedLoss:
    """The training objective (fixed weights) over consecutive chunks of valid records in file order.

    A chunk holds as many records as the epoch's first batch on a rank (the last one fewer), so the value does
    not depend on where skipped records or batch boundaries fell, nor on the number of processes. Each rank
    scores the same gathered rows as a single process would.
    """

    def __init__(self) -> None:
        self.size = 0
        self.pending: list[dict[str, Tensor]] = []
        self.total: Tensor | float = 0.0
        self.count = 0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def add(
        self, model: Any, rows: dict[str, Tensor], term_weights: Mapping[str, Any], batch_rows: int
    ) -> None:
        """Queues a batch's unique valid rows; scores every chunk that is complete."""
        self.size = self.size or batch_rows
        self.pending.append(rows)
        while sum(len(p["index"]) for p in self.pending) >= self.size:
            held = _concat(self.pending)
            self._score(model, {k: v[: self.size] for k, v in held.items()}, term_weights)
            rest = {k: v[self.size :] for k, v in held.items()}
            self.pending = [rest] if len(rest["index"]) else []

    def finish(self, model: Any, term_weights: Mapping[str, Any]) -> float | None:
        """Scores the last, shorter chunk; the mean over all records (None if there were none)."""
        if self.pending:
            self._score(model, _concat(self.pending), term_weights)
        mean = float(self.total) / self.count if self.count else None
        self.reset()
        return mean

    def _score(self, model: Any, rows: dict[str, Tensor], term_weights: Mapping[str, Any]) -> None:
        # in fp32 wherever it runs (a step under autocast, or the epoch's end outside it)
        rows = {k: v.float() if v.is_floating_point() else v for k, v in rows.items()}
        # the losses read the token sequences (ITM) and the embeddings, never the pooled outputs
        unread = rows["image_emb"][:, :0]
        none = unread[:, None]
        no_mask = torch.zeros(none.shape[:2], dtype=torch.bool, device=none.device)
        image_out = EncoderOutput(unread, rows.get("image_tokens", none), rows.get("image_mask", no_mask))
        text_out = EncoderOutput(unread, rows.get("text_tokens", none), rows.get("text_mask", no_mask))
        with single_process(), torch.autocast(rows["index"].device.type, enabled=False):
            terms, _ = model.losses(
                rows["ids"], rows.get("weights"), image_out, rows["image_emb"], text_out, rows["text_emb"]
            )
        self.total = self.total + weighted_sum(terms, term_weights).detach() * len(rows["index"])
        self.count += len(rows["index"])


def loader_batch_size(module: LightningModule, stage: str, batch: dict[str, Tensor]) -> int:
    """The evaluation loader's batch size (one process's), or this batch's size outside a trainer."""
    trainer = module.running_trainer()  # type: ignore[operator]
    loaders = (
        None if trainer is None else trainer.val_dataloaders if stage == "val" else trainer.test_dataloaders
    )
    return getattr(loaders, "batch_size", None) or len(batch["index"])


class Evaluation(nn.Module):
    """One evaluation epoch's state (the retrieval metrics, the rows scored) and its step.

    Args:
        reranker: also rank with each query's top k re-scored by the matching head (none: off)."""

    def __init__(self, reranker: Reranker | None = None) -> None:
        super().__init__()
        self.retrieval = RetrievalMetrics()
        self.rows = EvalRows()
        self.loss = ChunkedLoss()
        self.reranker = reranker
        # the last epoch's, for a report (``evaluate``)
        self.last_ranks: Ranks | None = None
        self.last_reranked: Ranks | None = None

    @classmethod
    def of(cls, module: LightningModule) -> Evaluation:
        """The evaluation ``module`` asks for (its ``reranker``), on its device."""
        return cls(getattr(module, "reranker", None)).to(module.device)

    def start_epoch(self) -> None:
        self.rows.reset()
        self.loss.reset()
        if self.reranker is not None:
            self.reranker.reset()

    def step(self, module: LightningModule, batch: dict[str, Tensor], stage: str) -> dict[str, Tensor]:
        """Adds the batch to the metrics and the loss, returns its normalized embeddings (per pair).

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
        weights = module.objective.sample_weighting(batch)
        # the ITM head needs the token sequences of the global batch too
        rows = self.rows.gather_unique(batch, *outputs, weights, tokens=module.model.itm is not None)
        if rows is not None:
            self.loss.add(
                module.model, rows, module.objective.fixed_weights, loader_batch_size(module, stage, batch)
            )
            if self.reranker is not None:
                self.reranker.add(module.model.itm, rows)
        self.retrieval.update(unique_emb, image_ids, text_emb, batch["image_id"], batch["index"])
        return {
            "image_embeddings": l2_normalize(unique_emb[column].float()),
            "text_embeddings": l2_normalize(text_emb.float()),
        }

    def end_epoch(self, module: LightningModule, stage: str) -> None:
        """Logs ``<stage>/loss``, ``<stage>/r{1,5,10}_{t2i,i2t}`` and ``alignment_gap`` over the epoch's unique
        rows."""
        loss = self.loss.finish(module.model, module.objective.fixed_weights)
        if self.retrieval.update_count == 0:
            return
        # gathered over ranks by torchmetrics: identical on every rank
        self.last_ranks = self.retrieval.compute_ranks()
        self.retrieval.reset()
        metrics = {"loss": loss} | {
            k: float(v) for k, v in self.last_ranks.metrics(self.retrieval.ks).items()
        }
        if self.reranker is not None and self.reranker.rows:
            self.last_reranked = self.reranker.ranks(module.model.itm, self.last_ranks.alignment_gap)
            self.reranker.reset()  # its tokens would stay in memory through the next training epoch
            reranked = self.last_reranked.metrics(self.retrieval.ks)
            metrics |= {f"reranked_{k}": float(v) for k, v in reranked.items() if k != "alignment_gap"}
        # already equal on every rank: the max keeps each value exact (a mean over 3 ranks may not) and tells
        # Lightning the value is global (else it warns about sync_dist once per metric)
        module.log_dict(
            {f"{stage}/{k}": v for k, v in metrics.items() if v is not None}, sync_dist=True, reduce_fx="max"
        )
