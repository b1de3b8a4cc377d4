"""MultimodalDataModule: JSONL image-caption files -> normalized image batches + dynamically padded tokens."""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from mm_lightning.data.collate import MultimodalCollate
from mm_lightning.data.dataset import (
    STAGE_SPLITS,
    CaptionSampling,
    EmptySplitError,
    ImageTextDataset,
    NoTrainingBatch,
    Split,
)
from mm_lightning.data.images import DEFAULT_MAX_PIXELS, decode_image_bytes
from mm_lightning.data.jsonl import JsonlIndex, RecordParser
from mm_lightning.data.loader import (
    ResumableDataLoader,
    TrainPosition,
    WorkerSafeDataLoader,
    global_seed,
    ignore_stop_signals,
)
from mm_lightning.data.records import SkipLog
from mm_lightning.data.samples import BadRecordPolicy, SampleBuilder
from mm_lightning.data.transforms import (
    DEFAULT_IMAGE_SIZE,
    IMAGENET_MEAN,
    IMAGENET_STD,
    INTERPOLATIONS,
    Normalize,
    eval_transform,
    train_transform,
)


class MultimodalDataModule(pl.LightningDataModule):
    """Image-text pairs from JSONL files, read in :meth:`setup` (so ``prepare_data`` may create them).

    Args:
        train_file: training JSONL.
        val_file: validation JSONL (every caption kept, ground truth by ``image_id``).
        test_file: test JSONL (same protocol as validation).
        predict_file: prediction JSONL.
        image_root: folder relative image paths resolve against (default: each JSONL's folder).
        image_key: record key of the image path (e.g. ``"image_path"``).
        text_key: record key of the caption, a string or a list of strings.
        tokenizer: HF tokenizer name or local path (the CLI links it to ``model.text_tower``).
        max_length: truncate captions to this many tokens.
        pad_to_multiple_of: pad each batch's token length to a multiple of this (e.g. 8), or ``None``.
        image_size: output image side; null follows ``image_config`` (else 224); if set, it wins.
        batch_size: batch size per device.
        num_workers: DataLoader worker processes per device.
        pin_memory: pin host memory for faster host-to-device copies.
        persistent_workers: keep workers (and their shared-memory image slots) alive across epochs.
        prefetch_factor: batches each worker prepares ahead (only with ``num_workers > 0``).
        multiprocessing_context: ``"fork"``, ``"spawn"``, ``"forkserver"`` or ``None`` (platform default).
        on_bad_record: ``"raise"`` stops with file, line and reason; ``"skip"`` swaps in a valid sample.
        max_replacements: under ``"skip"``, bad candidates tried for one replacement before the run stops.
        caption_sampling: training: ``"random"`` (one caption per image per visit) or ``"all"`` (every pair).
        length_grouping: batch training captions of similar length together (less padding).
        length_window: global batches per length-sorting window when ``length_grouping`` is on.
        train_scale: area range of the training random resized crop.
        horizontal_flip: random horizontal flips in training (off: captions say "left"/"right").
        mean: normalization mean per channel (0-1 units); null: the image tower's, else ImageNet's.
        std: normalization std per channel; null follows the image tower like ``mean``.
        normalize_on: "device" (after transfer), "worker" (collate), "auto" (device in Trainer, else worker).
        reduced_decode: let JPEGs decode at 1/2, 1/4 or 1/8 size when the crop still needs no upsampling.
        confine_to_root: reject image paths (absolute, ``..``, links) that leave ``image_root``.
        max_image_pixels: refuse images above this many pixels (decompression bombs); ``None`` disables.
        image_config: the image tower's ``data_config``, which unset options follow (the CLI passes it).
    """

    def __init__(
        self,
        train_file: str | None = None,
        val_file: str | None = None,
        test_file: str | None = None,
        predict_file: str | None = None,
        image_root: str | None = None,
        image_key: str = "image",
        text_key: str = "text",
        tokenizer: str = "bert-base-uncased",
        max_length: int = 64,
        pad_to_multiple_of: int | None = None,
        image_size: int | None = None,
        batch_size: PositiveInt = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        prefetch_factor: int | None = None,
        multiprocessing_context: str | None = None,
        on_bad_record: Literal["raise", "skip"] = "raise",
        max_replacements: int = 64,
        caption_sampling: CaptionSampling = "random",
        length_grouping: bool = False,
        length_window: int = 32,
        train_scale: tuple[float, float] = (0.9, 1.0),
        horizontal_flip: bool = False,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        normalize_on: Literal["auto", "device", "worker"] = "auto",
        reduced_decode: bool = True,
        confine_to_root: bool = False,
        max_image_pixels: int | None = DEFAULT_MAX_PIXELS,
        image_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        files = (train_file, val_file, test_file, predict_file)
        self.files: dict[str, str | None] = dict(zip(("train", "val", "test", "predict"), files, strict=True))
        self.normalize = Normalize(mean or IMAGENET_MEAN, std or IMAGENET_STD)
        self.image_size, self.interpolation = image_size or DEFAULT_IMAGE_SIZE, "bilinear"
        self.collate = MultimodalCollate(tokenizer, max_length, pad_to_multiple_of)
        self.datasets: dict[str, ImageTextDataset] = {}
        self._collates: dict[bool, MultimodalCollate] = {}
        self.train_position = TrainPosition()
        self.follow_image_tower(image_config)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.train_position.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_position.load_state_dict(state_dict)

    @property
    def index_skips(self) -> SkipLog:
        """Lines dropped while indexing JSONL (bad JSON, missing keys, bad captions, bad paths), by split."""
        log = SkipLog()
        for split, ds in self.datasets.items():
            for part in getattr(ds, "datasets", [ds]):  # a training mix's sources, or the one dataset
                if hasattr(part, "index"):  # shards have no index: their bad records are found while reading
                    log.update(part.index.skips, split=split)
        return log

    def record_parser(
        self, split: Split, file: str | None = None, image_root: str | None = None
    ) -> RecordParser:
        """The line parser of one JSONL file (default: the split's ``<split>_file``), also for the audit."""
        hp = self.hparams
        file = file or self.files[split]
        if file is None:
            raise ValueError(f"{split}_file is not set")
        root = image_root or hp.image_root or os.path.dirname(os.path.abspath(file))
        return RecordParser(file, hp.image_key, hp.text_key, root, hp.confine_to_root)

    def build_index(self, parser: RecordParser, label: str) -> JsonlIndex:
        """Indexes one JSONL file, validating every line; ``label`` names the file if none is valid."""
        index = JsonlIndex(parser, self.hparams.on_bad_record)
        if index.num_captions == 0:
            raise EmptySplitError(label, index)
        return index

    def sample_builder(
        self, split: Split, confine_root: str | None = None, full_size: bool = False
    ) -> SampleBuilder:
        """Record -> sample for one split and every source (``full_size``: no reduced decode, the audit)."""
        hp = self.hparams
        train = split == "train"
        reduced = hp.reduced_decode and not full_size
        # Reduced JPEG decoding only down to a size the crop never has to upsample from.
        scale_min = hp.train_scale[0] if train else 1.0
        min_side = int(self.image_size / scale_min**0.5) + 1 if reduced else None
        options = {
            "reduced_decode": reduced,
            "max_pixels": hp.max_image_pixels,
            "interpolation": self.interpolation,
        }
        transform = (
            train_transform(self.image_size, tuple(hp.train_scale), hp.horizontal_flip, **options)
            if train
            else eval_transform(self.image_size, **options)
        )
        decode = partial(decode_image_bytes, max_pixels=hp.max_image_pixels, min_side=min_side)
        return SampleBuilder(transform, hp.max_image_pixels, min_side, confine_root, decode_bytes=decode)

    def bad_record_policy(self) -> BadRecordPolicy:
        """What a bad record costs (``on_bad_record``), seeded by the run's seed."""
        return BadRecordPolicy(self.hparams.on_bad_record, self.hparams.max_replacements, global_seed())

    def jsonl_dataset(
        self, split: Split, file: str | None = None, image_root: str | None = None
    ) -> ImageTextDataset:
        """The dataset of one JSONL file (default: the split's ``<split>_file``)."""
        parser = self.record_parser(split, file, image_root)
        label = f"{split}_file" if file is None else f"{split} source"
        return ImageTextDataset(
            self.build_index(parser, label),
            self.sample_builder(split, parser.confine_root),
            caption_sampling=self.hparams.caption_sampling if split == "train" else "all",
            policy=self.bad_record_policy(),
            seed=global_seed(),
        )

    def build_dataset(self, split: Split) -> Dataset:
        """The dataset of one split (here: its JSONL file)."""
        return self.jsonl_dataset(split)

    def follow_image_tower(self, data_config: dict[str, Any] | None) -> None:
        """Takes the interpolation and unset ``image_size``/``mean``/``std`` from the tower (before setup)."""
        hp = self.hparams
        if not data_config:
            return
        if self.datasets:
            raise RuntimeError("follow_image_tower: the datasets are built already; call it before setup")
        side = int(data_config["input_size"][-1]) if data_config.get("input_size") else None
        interpolation = data_config.get("interpolation", "bilinear")
        if interpolation not in INTERPOLATIONS:
            rank_zero_warn(f"the image tower asks for {interpolation!r} resizing; resizing bilinear instead")
            interpolation = "bilinear"
        self.interpolation = interpolation
        if hp.image_size is None and side is not None:
            self.image_size = side
        elif side is not None and hp.image_size != side:
            rank_zero_warn(
                f"data.image_size {hp.image_size} differs from the image tower's input size {side}: images are "
                f"prepared at {hp.image_size} as set; leave data.image_size unset to follow the tower"
            )
        given = {k: tuple(v) for k, v in (("mean", hp.mean), ("std", hp.std)) if v is not None}
        differ = [k for k, v in given.items() if k in data_config and list(v) != list(data_config[k])]
        if differ and data_config.get("pretrained"):
            rank_zero_warn(
                "data."
                + " and data.".join(differ)
                + " differ from what the pretrained image tower's weights expect "
                f"({', '.join(f'{k} {list(data_config[k])}' for k in differ)}): the set values are used; leave "
                "them unset to follow the tower"
            )
        if hp.mean is not None and hp.std is not None:
            return
        mean = tuple(hp.mean if hp.mean is not None else data_config.get("mean", IMAGENET_MEAN))
        std = tuple(hp.std if hp.std is not None else data_config.get("std", IMAGENET_STD))
        if [*mean, *std] != [*self.normalize.mean, *self.normalize.std]:
            self.normalize = Normalize(mean, std)
            rank_zero_info(
                f"Normalizing images as the image tower expects: mean {list(mean)}, std {list(std)}"
            )

    def image_feature_split(self, split: Split) -> ImageTextDataset | None:
        """The built ``split`` dataset whose images cached features may replace, or None if not built."""
        dataset = self.datasets.get(split)
        if dataset is not None and not isinstance(dataset, ImageTextDataset):
            raise ValueError(
                f"cached image features are served for JSONL splits (MultimodalDataModule's files); the {split}"
                f" split is read from {type(dataset).__name__}"
            )
        return dataset

    def has_split(self, split: Split) -> bool:
        """Whether ``split`` has data to read (here: its JSONL file is set)."""
        return self.files[split] is not None

    @override
    def setup(self, stage: str) -> None:
        for split in STAGE_SPLITS.get(stage, ()):
            if self.has_split(split) and split not in self.datasets:  # type: ignore[arg-type]
                self.datasets[split] = self.build_dataset(split)  # type: ignore[arg-type]

    def normalizes_in_workers(self) -> bool:
        """Whether the collate normalizes images in the workers (else ``on_after_batch_transfer`` does)."""
        if self.hparams.normalize_on != "auto":
            return self.hparams.normalize_on == "worker"
        # Device even on CPU: float32 (4x uint8) in fresh shared memory page-faults more; no Trainer, no hook.
        return self.trainer is None

    def _collate(self) -> MultimodalCollate:
        in_workers = self.normalizes_in_workers()
        if in_workers not in self._collates:  # one per decision, so the tokenizer loads once per process
            self._collates[in_workers] = self.collate.with_normalize(self.normalize if in_workers else None)
        return self._collates[in_workers]

    def _loader_kwargs(self) -> dict[str, Any]:
        hp = self.hparams
        slots = None
        if hp.num_workers > 0:  # shared-memory image slots exist for worker processes only: load them then
            from mm_lightning.data.batch_slots import slots_for

            slots = slots_for(hp, self.image_size, self.normalizes_in_workers())
        kwargs: dict[str, Any] = {
            "batch_size": hp.batch_size,
            "num_workers": hp.num_workers,
            "pin_memory": hp.pin_memory and torch.accelerator.is_available(),  # nothing to pin for on a CPU
            "collate_fn": self._collate().for_queue(slots),
        }
        if hp.num_workers > 0:
            kwargs["worker_init_fn"] = partial(ignore_stop_signals, rank=self._rank_info()[1])
            kwargs["persistent_workers"] = hp.persistent_workers
            kwargs["multiprocessing_context"] = hp.multiprocessing_context
            if hp.prefetch_factor is not None:
                kwargs["prefetch_factor"] = hp.prefetch_factor
        return kwargs

    def _dataset(self, split: str) -> ImageTextDataset:
        if split not in self.datasets:
            raise RuntimeError(f"no {split} data: set {split}_file and call setup() first")
        return self.datasets[split]

    def _rank_info(self) -> tuple[int, int]:
        return (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)

    def check_a_batch(self, per_rank: int, where: str) -> None:
        """Refuses a training split without one full batch per device (:class:`NoTrainingBatch`)."""
        if per_rank < self.hparams.batch_size:
            raise NoTrainingBatch(where, per_rank, self.hparams.batch_size, self._rank_info()[0])

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        """Shuffled, ``drop_last``; a stateful loader so Lightning checkpoints its position."""
        dataset, hp = self._dataset("train"), self.hparams
        world, rank = self._rank_info()
        rows = "images" if dataset.caption_sampling == "random" else "caption rows"
        where = f"{dataset.index.file}: {dataset.index.lines} non-blank lines, {dataset.index.skips.count} dropped"
        where += f" while reading, {len(dataset)} {rows} left"
        # one process: shuffle=True (a checkpointable RandomSampler); several: the sampler Lightning would add
        sampler = DistributedSampler(dataset, world, rank, seed=global_seed()) if world > 1 else None
        if hp.length_grouping:
            from mm_lightning.extras.length_grouping import LengthGroupedSampler

            lengths, seed = dataset.lengths(), global_seed()
            sampler = LengthGroupedSampler(lengths, hp.batch_size, world, rank, seed, hp.length_window)
        self.check_a_batch(len(dataset) if sampler is None else len(sampler), where)
        kwargs = self._loader_kwargs()
        loader = ResumableDataLoader(
            dataset, sampler=sampler, shuffle=sampler is None, drop_last=True, **kwargs
        )
        return self.train_position.track(loader, self.trainer)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if not self.has_split("val"):
            return []  # Lightning skips validation when there is no loader
        return WorkerSafeDataLoader(self._dataset("val"), shuffle=False, **self._loader_kwargs())

    @override
    def test_dataloader(self) -> DataLoader:
        return WorkerSafeDataLoader(self._dataset("test"), shuffle=False, **self._loader_kwargs())

    @override
    def predict_dataloader(self) -> DataLoader:
        return WorkerSafeDataLoader(self._dataset("predict"), shuffle=False, **self._loader_kwargs())

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # uint8 images cross the host-device link (4x fewer bytes than float32); convert where it is cheap.
        if isinstance(batch, dict) and "image" in batch and not self.normalizes_in_workers():
            batch["image"] = self.normalize(batch["image"])
        return batch

    def normalize_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """For use outside a Trainer: the same conversion Lightning applies after transfer."""
        return self.on_after_batch_transfer(batch, 0)
