"""LockedImageFeatures: a locked image tower's features computed once and served by the data instead of pixels.

Add it to a LiT run (``model.image.freeze: true``, ``model.objective.itm_weight: 0``)::

    image_features:
      class_path: mm_lightning.callbacks.LockedImageFeatures
      init_args: {views: 0}

Before the loaders start it computes every missing row (see :mod:`mm_lightning.data.features` for the keys and
the views) with the tower, in float32, and switches the JSONL splits of the stage to serve them: an epoch then
costs the text tower, the projections and the loss, not a decode, a crop and an image tower forward per sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from mm_lightning import ExplainedError
from mm_lightning.data.datamodule import MultimodalDataModule
from mm_lightning.data.dataset import STAGE_SPLITS
from mm_lightning.data.features import CachedFeatures, FeatureTable, build_rows, fingerprint
from mm_lightning.data.loader import global_seed


class FeatureCacheError(ExplainedError, ValueError):
    """The run's data cannot serve cached features; the message names the fix."""


class LockedImageFeatures(pl.Callback):
    """Computes a locked image tower's features once per distinct image (and view) and serves them as the batch.

    Args:
        cache_dir: folder of the feature tables (default: ``<trainer.default_root_dir>/feature_cache``); one
            table per tower weights + transform + views, so several runs and restarts share it safely.
        views: training views per image: 0 caches the evaluation crop (no augmentation of the locked tower);
            K caches K random training crops and each visit draws one. Evaluation splits use the evaluation crop.
        batch_size: images per tower call while building.
    """

    def __init__(self, cache_dir: str | None = None, views: int = 0, batch_size: int = 64) -> None:
        if views < 0:
            raise ValueError(f"views must be >= 0, got {views}")
        self.cache_dir, self.views, self.batch_size = cache_dir, views, batch_size
        self.computed: dict[str, int] = {}  # split -> rows this process computed (for the logs and tests)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        model = pl_module.model
        if not model.image_config.freeze:
            raise ValueError(
                "LockedImageFeatures: the image tower trains (model.image.freeze is false), so its features change"
                " at every step; lock it (model.image.freeze true) or drop the LockedImageFeatures callback"
            )
        objective = getattr(pl_module, "objective", None)
        if objective is not None and objective.sample_weighting != "none":
            raise ValueError(
                "LockedImageFeatures: objective.sample_weighting 'complexity' measures image detail on the pixels,"
                " which cached features replace; set model.objective.sample_weighting none or drop the"
                " LockedImageFeatures callback"
            )
        if model.itm is not None:
            raise ValueError(
                "LockedImageFeatures: image-text matching reads the image tower's token sequences, which are not"
                " cached; set model.objective.itm_weight 0 (as LiT does) or drop the LockedImageFeatures callback"
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.serve(trainer, pl_module, "fit")

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self.serve(trainer, pl_module, "validate")

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.serve(trainer, pl_module, "test")

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.serve(trainer, pl_module, "predict")

    def serve(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Builds the missing rows of the stage's splits (each process its share) and serves them."""
        dm = trainer.datamodule
        if not isinstance(dm, MultimodalDataModule):
            given = "no data module" if dm is None else f"a {type(dm).__name__}"
            raise ValueError(
                "LockedImageFeatures serves cached features through the data module's JSONL splits: run with a"
                f" MultimodalDataModule (this run has {given})"
            )
        folder = Path(self.cache_dir or Path(trainer.default_root_dir) / "feature_cache")
        tower = pl_module.model.image_encoder
        weights = {"tower": type(tower).__qualname__, "state": tower.state_dict()}
        for split in STAGE_SPLITS[stage]:
            try:
                dataset = dm.image_feature_split(split)
            except ValueError as err:  # e.g. a split read from shards
                raise FeatureCacheError(
                    f"LockedImageFeatures: {err}. Train from the JSONL files (--data.class_path"
                    " mm_lightning.data.MultimodalDataModule --data.init_args.train_file ...), or without the cache"
                    " (the default callbacks without LockedImageFeatures: --trainer.callbacks"
                    " configs/callbacks/default.yaml): the locked tower then runs every step"
                ) from None
            if dataset is None:
                continue
            views = self.views if split == "train" else 0
            builder = dm.sample_builder(split if views else "val", dataset.builder.confine_root)
            transform = {k: repr(v) for k, v in vars(builder.transform).items()}
            normalize = (dm.normalize.mean, dm.normalize.std)
            seed = global_seed()
            name = fingerprint(weights=weights["state"], tower=weights["tower"], transform=transform,
                               normalize=normalize, views=views, seed=seed if views else None)  # fmt: skip
            table = FeatureTable(folder / name)

            def pixels(record: Any, builder: Any = builder) -> torch.Tensor:
                return dm.normalize(builder(record, "", 0, 0)["image"])

            def encode(images: torch.Tensor) -> torch.Tensor:
                return pl_module.model.encode_images(images.to(pl_module.device))[0].pooled

            records = dataset.image_records()
            skip = dm.hparams.on_bad_record == "skip"
            self.computed[split] = build_rows(
                records, pixels, encode, table, views, seed, (trainer.global_rank, trainer.world_size),
                self.batch_size, on_error=(lambda err: None) if skip else None,
                progress=f"caching {split} image features" if trainer.is_global_zero else None,
            )  # fmt: skip
            trainer.strategy.barrier("image_features")
            table.reload()  # every process's share
            dataset.serve_features(CachedFeatures(table, views))
            rank_zero_info(
                f"LockedImageFeatures: {split}: {len(table)} cached rows in {table.folder} "
                f"({self.computed[split]} computed here, {views or 'evaluation-crop'} view(s) per image)"
            )
