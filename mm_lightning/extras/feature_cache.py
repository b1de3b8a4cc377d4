"""LockedImageFeatures: a locked image tower's features computed once and served by the data instead of pixels.

Add it to a LiT run (``model.image.freeze: true``, ``model.objective.itm_weight: 0``)::

    image_features:
      class_path: mm_lightning.extras.LockedImageFeatures
      init_args: {views: 0}

Before the loaders start it computes every missing row (keys and views: below) with the tower, in float32, and
switches the JSONL splits of the stage to serve them: an epoch then costs the text tower, the projections and the
loss, not a decode, a crop and an image tower forward per sample.

A tower whose weights never change gives the same features for the same pixels at every step, so a LiT-style
run (locked image tower, trained text tower) can compute them once and train on them: the loader then reads a
row per sample instead of decoding and cropping a photo, and the step runs the text tower only.

What a cached row depends on is its key: the *table* (a folder) is named by a fingerprint of the tower's
weights and class, the transform (crop, size, resize, normalization, reduced decode) and the views; a *row* by
the image's bytes (SHA-1) and the view. So changing the weights, the transform or an image never serves a stale
row: a new table is made, or the changed image gets a row of its own. Tables live in a folder beside the run
(or one the user names) as ``.npy`` parts, written atomically and kept across restarts; with several processes
each computes its share of the missing rows into a part of its own.

Views: ``views = 0`` caches the evaluation crop (no augmentation of the locked tower); ``views = K`` caches K
random training crops per image, view ``v`` of an image drawn from a generator seeded by the run's seed, the
image's key and ``v``; each visit of an image then draws one of its K views (seeded per visit, like the caption).

The model side only needs to accept a (B, D) batch of features where it takes (B, 3, H, W) images
(:meth:`mm_lightning.models.DualEncoder.encode_images` does).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from tqdm import tqdm
from typing_extensions import override

from mm_lightning import ExplainedError
from mm_lightning.data.datamodule import STAGE_SPLITS, MultimodalDataModule
from mm_lightning.data.images import ImageDecodeError, read_image_bytes
from mm_lightning.data.records import Record, RecordError
from mm_lightning.data.seeding import derive_seed, global_seed

Encoder = Callable[[torch.Tensor], torch.Tensor]  # normalized (B, 3, H, W) images -> (B, D) features


def image_key(record: Record) -> str:
    """SHA-1 of the record's image bytes (file or shard member); a ``RecordError`` if it cannot be read."""
    try:
        return hashlib.sha1(read_image_bytes(record.image)).hexdigest()
    except ImageDecodeError as err:
        raise record.error(str(err), "missing_image") from err


def view_seed(seed: int, key: str, view: int) -> int:
    """The crop seed of view ``view`` of the image with key ``key``: the same in every run with this seed."""
    return derive_seed(seed, [int(key[:15], 16), view])


def fingerprint(**parts: Any) -> str:
    """SHA-256 of JSON-able parts and tensors (a tower's state dict): the name of a feature table."""
    digest = hashlib.sha256()
    for name in sorted(parts):
        value = parts[name]
        digest.update(name.encode())
        if isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
            for key in sorted(value):
                tensor = value[key].detach().to("cpu").contiguous()
                digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(json.dumps(value, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


class FeatureTable:
    """Rows of features by ``"<image key>:<view>"``, stored in a folder as ``.npy`` parts with their key lists.

    Args:
        folder: the table's folder (created if missing); every part in it is loaded.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rows: dict[str, tuple[int, int]] = {}
        self.parts: list[np.ndarray] = []
        self.reload()

    def reload(self) -> None:
        """Reads every complete part of the folder (memory-mapped)."""
        self.rows, self.parts = {}, []
        for keys_file in sorted(self.folder.glob("part-*.json")):
            array_file = keys_file.with_suffix(".npy")
            if not array_file.is_file():
                continue  # a part being written (its keys are renamed in last)
            keys = json.loads(keys_file.read_text())
            self.parts.append(np.load(array_file, mmap_mode="r"))
            for row, key in enumerate(keys):
                self.rows.setdefault(key, (len(self.parts) - 1, row))

    def __getstate__(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder)
        }  # a loader worker maps the parts itself instead of receiving copies

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"])  # type: ignore[misc]

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, key: str) -> torch.Tensor:
        """The row of ``key`` as a float32 tensor (a copy: the loader may pin or send it)."""
        part, row = self.rows[key]
        return torch.from_numpy(np.array(self.parts[part][row], dtype=np.float32))

    def add(self, keys: list[str], features: np.ndarray, writer: str) -> None:
        """Writes a part atomically (array, then its key list, each renamed into place) and loads it.

        Args:
            keys: the rows' keys.
            features: (len(keys), D) float32.
            writer: what names the part (e.g. the rank); a random suffix keeps parts of restarts apart.
        """
        if not keys:
            return
        stem = self.folder / f"part-{writer}-{uuid.uuid4().hex[:8]}"
        for suffix, write in ((".npy", lambda f: np.save(f, features.astype(np.float32))),
                              (".json", lambda f: f.write(json.dumps(keys).encode()))):  # fmt: skip
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, stem.with_suffix(suffix))
        self.reload()


class CachedFeatures:
    """What a sample builder serves in place of an image: the cached row of the record's image (and a view).

    Args:
        table: the split's feature table.
        views: 0: the one evaluation-crop row; K: one of the image's K training views, drawn from torch's RNG
            (seeded per visit by the dataset).
    """

    def __init__(self, table: FeatureTable, views: int) -> None:
        self.table, self.views = table, views

    def __call__(self, record: Record) -> torch.Tensor:
        key = image_key(record)
        view = int(torch.randint(self.views, ()).item()) if self.views else 0
        row = f"{key}:{view}"
        if row not in self.table:
            raise record.error("no cached feature for this image (it failed when the cache was built)",
                               "undecodable_image")  # fmt: skip
        return self.table.get(row)


def build_rows(
    records: list[Record],
    pixels: Callable[[Record], torch.Tensor],
    encode: Encoder,
    table: FeatureTable,
    views: int,
    seed: int,
    share: tuple[int, int] = (0, 1),
    batch_size: int = 64,
    on_error: Callable[[RecordError], None] | None = None,
    progress: str | None = None,
) -> int:
    """Computes the rows of ``records`` that ``table`` lacks (this process's share of them) and adds them.

    Args:
        records: one record per distinct image.
        pixels: record -> its normalized (3, H, W) image as the split's transform makes it.
        encode: the locked tower, normalized images -> features.
        table: the split's table.
        views: see :class:`CachedFeatures`.
        seed: the run's seed (view crops).
        share: ``(rank, world size)``: this process computes every ``world``-th missing row from ``rank``.
        batch_size: images per tower call.
        on_error: what to do with an image that fails (default: raise its ``RecordError``).
        progress: a progress bar's title (with the total and the time left), or ``None`` for none.

    Returns:
        The rows this process computed.
    """
    wanted: dict[str, Record] = {}
    for record in records:
        try:
            key = image_key(record)
        except RecordError as err:
            if on_error is None:
                raise
            on_error(err)
            continue
        for view in range(max(views, 1)):
            if f"{key}:{view}" not in table:
                wanted.setdefault(f"{key}:{view}", record)
    rank, world = share
    mine = sorted(wanted)[rank::world]
    keys: list[str] = []
    chunks: list[np.ndarray] = []
    bar = tqdm(total=len(mine), desc=progress, unit=" images", disable=progress is None)
    for batch_keys, images in _batches(mine, wanted, pixels, seed, views, batch_size, on_error):
        with torch.no_grad():
            chunks.append(encode(images).float().cpu().numpy())
        keys += batch_keys
        bar.update(len(batch_keys))
    bar.close()
    table.add(keys, np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32), f"r{rank}")
    return len(keys)


def _batches(
    keys: list[str],
    records: dict[str, Record],
    pixels: Callable[[Record], torch.Tensor],
    seed: int,
    views: int,
    batch_size: int,
    on_error: Callable[[RecordError], None] | None,
) -> Iterator[tuple[list[str], torch.Tensor]]:
    done: list[str] = []
    images: list[torch.Tensor] = []
    for row in keys:
        key, view = row.rsplit(":", 1)
        try:
            with torch.random.fork_rng(devices=[]):
                if views:
                    torch.manual_seed(view_seed(seed, key, int(view)))
                images.append(pixels(records[row]))
        except RecordError as err:
            if on_error is None:
                raise
            on_error(err)
            continue
        done.append(row)
        if len(done) == batch_size:
            yield done, torch.stack(images)
            done, images = [], []
    if done:
        yield done, torch.stack(images)


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
        weighting = pl_module.objective.sample_weighting
        if getattr(weighting, "reads_pixels", False):
            raise ValueError(
                f"LockedImageFeatures: model.sample_weighting {type(weighting).__name__} reads the images' pixels,"
                " which cached features replace; drop model.sample_weighting or the LockedImageFeatures callback"
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
                dataset = dm.image_source_split(split)
            except ValueError as err:  # e.g. a split read from shards
                raise FeatureCacheError(
                    f"LockedImageFeatures: {err}. Train from the JSONL files (--data.class_path"
                    " mm_lightning.data.MultimodalDataModule --data.init_args.train_file ...), or without the cache"
                    " (the default callbacks and a long run's: --trainer.callbacks mm_lightning/callbacks/default.yaml"
                    " --trainer.callbacks+ configs/callbacks/long_run.yaml): the locked tower then runs every step"
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
            # every process lists the missing rows before any writes its share: splits with the same fingerprint
            # share a folder, and a share taken after another's write would leave rows to no one
            trainer.strategy.barrier("image_features_listed")

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
            dataset.replace_images(CachedFeatures(table, views))
            rank_zero_info(
                f"LockedImageFeatures: {split}: {len(table)} cached rows in {table.folder} "
                f"({self.computed[split]} computed here, {views or 'evaluation-crop'} view(s) per image)"
            )
