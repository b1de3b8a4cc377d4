"""Writes the embeddings of ``predict`` to one file per rank (``embeddings_rank{R}.pt`` or ``.npz``).

Each holds ``image_embeddings`` and ``text_embeddings`` ((N, D) float32, L2-normalized), ``image_id`` and
``index`` ((N,) int64, line in the predict JSONL); each valid record is written once over all rank files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor
from typing_extensions import override

from mm_lightning import ExplainedError

FIELDS = ("image_embeddings", "text_embeddings", "image_id", "index")


class OutputFolderError(ExplainedError, FileExistsError):
    """The prediction folder cannot be written as asked (a file, or a folder holding earlier results)."""


class EmbeddingWriter(BasePredictionWriter):
    """Collects ``predict_step`` outputs on CPU and writes them once per rank at the end of predict.

    Args:
        output_dir: folder for the files (created if missing; must be empty unless ``overwrite``).
        file_format: ``pt`` (``torch.save`` of a dict of tensors) or ``npz`` (``numpy.savez``).
        overwrite: write into a non-empty folder, deleting the ``embeddings_rank*`` files of earlier runs.
    """

    def __init__(
        self,
        output_dir: str = "predictions",
        file_format: Literal["pt", "npz"] = "pt",
        overwrite: bool = False,
    ) -> None:
        super().__init__(write_interval="batch")
        if file_format not in ("pt", "npz"):
            raise ValueError(f"file_format must be 'pt' or 'npz', got {file_format!r}")
        self.output_dir = Path(output_dir)
        self.file_format = file_format
        self.overwrite = overwrite
        self._rows: dict[str, list[Tensor]] = {k: [] for k in FIELDS}

    def path_for_rank(self, rank: int) -> Path:
        """File written by ``rank``."""
        return self.output_dir / f"embeddings_rank{rank}.{self.file_format}"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise OutputFolderError(
                f"EmbeddingWriter's output_dir {self.output_dir} is a file, not a folder: give a folder path in"
                " the run's trainer.callbacks (it is created if missing; each rank writes embeddings_rank<R>.pt"
                " into it)."
            )
        existing = sorted(self.output_dir.iterdir()) if self.output_dir.is_dir() else []
        if existing and not self.overwrite:
            names = ", ".join(p.name for p in existing[:5]) + (" ..." if len(existing) > 5 else "")
            raise OutputFolderError(
                f"Prediction folder {self.output_dir} is not empty ({len(existing)} entries: {names}). Give"
                " EmbeddingWriter another output_dir in the run's trainer.callbacks, or overwrite: true to replace"
                " the earlier embeddings_rank* files."
            )
        if existing and trainer.is_global_zero:
            for path in (p for ext in ("pt", "npz") for p in self.output_dir.glob(f"embeddings_rank*.{ext}")):
                path.unlink()  # earlier runs' files, either format, any rank
        trainer.strategy.barrier("prediction folder cleared")  # no rank writes before rank 0 has cleared

    @override
    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rows = {k: [] for k in FIELDS}

    @override
    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        missing = [k for k in FIELDS if k not in prediction]
        if missing:
            raise KeyError(f"predict_step must return {FIELDS}; missing {missing}")
        keep = ~prediction["stand_in"].cpu().bool() if "stand_in" in prediction else None
        for key in FIELDS:
            rows = prediction[key].detach().cpu()
            self._rows[key].append(rows if keep is None else rows[keep])

    @override
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._rows["index"]:
            return
        data = {k: torch.cat(v) for k, v in self._rows.items()}
        data["image_embeddings"] = data["image_embeddings"].float()
        data["text_embeddings"] = data["text_embeddings"].float()
        data["image_id"], data["index"] = data["image_id"].long(), data["index"].long()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.path_for_rank(trainer.global_rank)
        if self.file_format == "pt":
            torch.save(data, path)
        else:
            np.savez(path, **{k: v.numpy() for k, v in data.items()})
        self._rows = {k: [] for k in FIELDS}
        files = (
            f"{self.path_for_rank(0).name}" if trainer.world_size == 1 else f"one file per rank, {path.name}"
        )
        print(f"predict: {len(data['index'])} rows written to {self.output_dir} ({files})", flush=True)
