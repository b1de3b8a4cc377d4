"""MultimodalDataModule: JSONL image-caption files -> normalized image batches + dynamically padded tokens
(line -> record: :mod:`~mm_lightning.data.jsonl`; record -> sample: :mod:`~mm_lightning.data.samples`; samples ->
batch: :mod:`~mm_lightning.data.collate`; the options: :mod:`~mm_lightning.data.config`)."""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from mm_lightning.data.collate import MultimodalCollate
from mm_lightning.data.config import (
    DEFAULT_IMAGES,
    DEFAULT_LOADER,
    ImageOptions,
    LoaderOptions,
)
from mm_lightning.data.images import decode_image_bytes
from mm_lightning.data.jsonl import JsonlIndex, RecordParser
from mm_lightning.data.order import TrainOrder
from mm_lightning.data.records import EmptySplitError, NoTrainingBatch
from mm_lightning.data.resume import ResumableDataLoader, TrainPosition
from mm_lightning.data.samples import BadRecordPolicy, ImageTextDataset, SampleBuilder
from mm_lightning.data.seeding import global_seed
from mm_lightning.data.skips import SkipLog, SkippedRecords
from mm_lightning.data.transforms import (
    DEFAULT_IMAGE_SIZE,
    IMAGENET_MEAN,
    IMAGENET_STD,
    INTERPOLATIONS,
    Normalize,
    eval_transform,
    train_transform,
)
from mm_lightning.option_groups import as_config, as_record

Split = Literal["train", "val", "test", "predict"]

STAGE_SPLITS: dict[str, tuple[str, ...]] = {
    "fit": ("train", "val"),
    "validate": ("val",),
    "test": ("test",),
    "predict": ("predict",),
}
# the split a loop of the Trainer reads (its ``state.stage``)
LOOP_SPLITS = {
    "train": "train",
    "sanity_check": "val",
    "validate": "val",
    "test": "test",
    "predict": "predict",
}


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
        batch_size: batch size per device.
        num_workers: DataLoader worker processes per device.
        on_bad_record: ``"raise"`` stops with file, line and reason; ``"skip"`` swaps in a valid sample.
        images: image size, normalization, augmentation and checks (:class:`ImageOptions`).
        loader: caption sampling, batching and DataLoader options (:class:`LoaderOptions`).
        train_order: how the training split's epoch order is drawn (default :class:`TrainOrder`: shuffled).
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
        batch_size: PositiveInt = 32,
        num_workers: int = 0,
        on_bad_record: Literal["raise", "skip"] = "raise",
        images: ImageOptions = DEFAULT_IMAGES,
        loader: LoaderOptions = DEFAULT_LOADER,
        train_order: TrainOrder | None = None,
        image_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if isinstance(self.hparams.get("train_order"), TrainOrder):  # the CLI records class_path + init_args
            self.save_hyperparameters(ignore=["train_order"])  # built in Python: a checkpoint holds no object
        self.train_order = train_order or TrainOrder()
        files = (train_file, val_file, test_file, predict_file)
        self.files: dict[str, str | None] = dict(zip(("train", "val", "test", "predict"), files, strict=True))
        self.image_options = image = as_config(ImageOptions, images, "data.images")
        self.loader_options = as_config(LoaderOptions, loader, "data.loader")
        # every option recorded, as plain data: a resume compares them, a checkpoint loads with weights_only
        self.hparams.update(images=as_record(image), loader=as_record(self.loader_options))
        self.normalize = Normalize(image.mean or IMAGENET_MEAN, image.std or IMAGENET_STD)
        self.image_size, self.interpolation = image.size or DEFAULT_IMAGE_SIZE, "bilinear"
        self.collate = MultimodalCollate(tokenizer, max_length, self.loader_options.pad_to_multiple_of)
        self.datasets: dict[str, ImageTextDataset] = {}
        self._collates: dict[bool, MultimodalCollate] = {}
        self.train_position = TrainPosition()
        self.skipped = SkippedRecords()  # this process's, until a stage ends; then every process's
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
        return RecordParser(file, hp.image_key, hp.text_key, root, self.image_options.confine_to_root)

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
        image = self.image_options
        train = split == "train"
        reduced = image.reduced_decode and not full_size
        # Reduced JPEG decoding only down to a size the crop never has to upsample from.
        scale_min = image.train_scale[0] if train else 1.0
        min_side = int(self.image_size / scale_min**0.5) + 1 if reduced else None
        max_pixels = image.max_pixels
        options = {"reduced_decode": reduced, "max_pixels": max_pixels, "interpolation": self.interpolation}
        transform = (
            train_transform(self.image_size, tuple(image.train_scale), image.horizontal_flip, **options)
            if train
            else eval_transform(self.image_size, **options)
        )
        decode = partial(decode_image_bytes, max_pixels=max_pixels, min_side=min_side)
        return SampleBuilder(transform, max_pixels, min_side, confine_root, decode_bytes=decode)

    def bad_record_policy(self) -> BadRecordPolicy:
        """What a bad record costs (``on_bad_record``), seeded by the run's seed."""
        replacements = self.loader_options.max_replacements
        return BadRecordPolicy(self.hparams.on_bad_record, replacements, global_seed())

    def jsonl_dataset(
        self, split: Split, file: str | None = None, image_root: str | None = None
    ) -> ImageTextDataset:
        """The dataset of one JSONL file (default: the split's ``<split>_file``)."""
        parser = self.record_parser(split, file, image_root)
        label = f"{split}_file" if file is None else f"{split} source"
        return ImageTextDataset(
            self.build_index(parser, label),
            self.sample_builder(split, parser.confine_root),
            caption_sampling=self.loader_options.caption_sampling if split == "train" else "all",
            policy=self.bad_record_policy(),
            seed=global_seed(),
        )

    def build_dataset(self, split: Split) -> Dataset:
        """The dataset of one split (here: its JSONL file)."""
        return self.jsonl_dataset(split)

    def follow_image_tower(self, data_config: dict[str, Any] | None) -> None:
        """Takes the interpolation and unset ``images`` size, mean and std from the tower (before setup)."""
        image = self.image_options
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
        if image.size is None and side is not None:
            self.image_size = side
        elif side is not None and image.size != side:
            rank_zero_warn(
                f"data.images.size {image.size} differs from the image tower's input size {side}: images are "
                f"prepared at {image.size} as set; leave data.images.size unset to follow the tower"
            )
        given = {k: tuple(getattr(image, k)) for k in ("mean", "std") if getattr(image, k) is not None}
        differ = [k for k, v in given.items() if list(v) != list(data_config.get(k, v))]
        if differ and data_config.get("pretrained"):
            found = "; ".join(
                f"data.images.{k} {list(given[k])}, the tower's {list(data_config[k])}" for k in differ
            )
            rank_zero_warn(
                f"{found}: they differ from what the pretrained image tower's weights expect; the set values are"
                " used, leave them unset to follow the tower"
            )
        if len(given) == 2:
            return
        mean = tuple(given.get("mean") or data_config.get("mean", IMAGENET_MEAN))
        std = tuple(given.get("std") or data_config.get("std", IMAGENET_STD))
        if [*mean, *std] != [*self.normalize.mean, *self.normalize.std]:
            self.normalize = Normalize(mean, std)
            rank_zero_info(
                f"Normalizing images as the image tower expects: mean {list(mean)}, std {list(std)}"
            )

    def image_source_split(self, split: Split) -> ImageTextDataset | None:
        """The built ``split`` dataset whose images precomputed features may replace (:meth:`ImageTextDataset.
        replace_images`), or None if not built."""
        dataset = self.datasets.get(split)
        if dataset is not None and not isinstance(dataset, ImageTextDataset):
            raise ValueError(
                f"precomputed image features replace the images of JSONL splits (MultimodalDataModule's files); the {split}"
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
        if self.loader_options.normalize_on != "auto":
            return self.loader_options.normalize_on == "worker"
        # Device even on CPU: float32 (4x uint8) in fresh shared memory page-faults more; no Trainer, no hook.
        return self.trainer is None

    def _collate(self) -> MultimodalCollate:
        in_workers = self.normalizes_in_workers()
        if in_workers not in self._collates:  # one per decision, so the tokenizer loads once per process
            self._collates[in_workers] = self.collate.with_normalize(self.normalize if in_workers else None)
        return self._collates[in_workers]

    def _loader_kwargs(self, batch_size: int | None = None) -> dict[str, Any]:
        hp, loader = self.hparams, self.loader_options
        batch_size = batch_size or hp.batch_size
        slots = None
        if hp.num_workers > 0 and loader.batch_slots:  # slots exist for worker processes only
            from mm_lightning.data.batch_slots import slots_for

            in_workers = self.normalizes_in_workers()
            slots = slots_for(hp.num_workers, batch_size, self.image_size, loader, normalized=in_workers)
        kwargs: dict[str, Any] = {
            "batch_size": batch_size,
            "num_workers": hp.num_workers,
            "pin_memory": loader.pin_memory and torch.accelerator.is_available(),  # nothing to pin on a CPU
            "collate_fn": self._collate().for_queue(slots),
        }
        if hp.num_workers > 0:
            kwargs["persistent_workers"] = loader.persistent_workers
            kwargs["multiprocessing_context"] = loader.multiprocessing_context
            if loader.prefetch_factor is not None:
                kwargs["prefetch_factor"] = loader.prefetch_factor
        return kwargs

    def _dataset(self, split: str) -> ImageTextDataset:
        if split not in self.datasets:
            raise RuntimeError(f"no {split} data: set {split}_file and call setup() first")
        return self.datasets[split]

    def _rank_info(self) -> tuple[int, int]:
        """(readers of the training stream, this process's place among them): Lightning's sampler arguments,
        which a strategy that splits the processes into groups (one per tower, say) sets to its own group."""
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    def processes(self) -> int:
        """The run's processes (the global batch is ``batch_size`` x these)."""
        return self.trainer.world_size if self.trainer is not None else 1

    def reader_batch_size(self) -> int:
        """Training samples each reader takes per step: the global batch (``batch_size`` x processes) over the
        readers, which is ``batch_size`` unless a strategy groups the processes."""
        processes = self.processes()
        readers = self._rank_info()[0]
        if self.hparams.batch_size * processes % readers:
            raise ValueError(
                f"data.batch_size {self.hparams.batch_size} x {processes} processes does not split over the"
                f" strategy's {readers} readers of each batch; choose a multiple of {readers}"
            )
        return self.hparams.batch_size * processes // readers

    def check_a_batch(self, per_rank: int, where: str) -> None:
        """Refuses a training split without one full batch per device (:class:`NoTrainingBatch`)."""
        batch_size = self.reader_batch_size()
        if per_rank < batch_size:
            raise NoTrainingBatch(where, per_rank, batch_size, self._rank_info()[0])

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        """This rank's share of each global batch of the epoch's order; its position is saved with the data
        module, and a resume on any number of processes continues it (:mod:`mm_lightning.data.resume`)."""
        dataset = self._dataset("train")
        world, rank = self._rank_info()
        rows = "images" if dataset.caption_sampling == "random" else "caption rows"
        where = f"{dataset.index.file}: {dataset.index.lines} non-blank lines, {dataset.index.skips.count} dropped"
        where += f" while reading, {len(dataset)} {rows} left"
        batch_size = self.reader_batch_size()
        sampler = self.train_order.sampler(dataset, batch_size, world, rank, global_seed())
        self.check_a_batch(sampler.stream_length() // world, where)
        kwargs = self._loader_kwargs(batch_size)
        batches = ResumableDataLoader(dataset, sampler, self.processes(), drop_last=True, **kwargs)
        return self.train_position.track(batches, self.trainer)

    @override
    def val_dataloader(self) -> DataLoader | list:
        if not self.has_split("val"):
            return []  # Lightning skips validation when there is no loader
        return DataLoader(self._dataset("val"), shuffle=False, **self._loader_kwargs())

    @override
    def test_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset("test"), shuffle=False, **self._loader_kwargs())

    @override
    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset("predict"), shuffle=False, **self._loader_kwargs())

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # skipped records travel from the workers inside the batches; count them here, whatever callbacks run
        if self.trainer is not None and self.trainer.state.stage is not None:
            self.skipped.add_batch(batch, LOOP_SPLITS.get(self.trainer.state.stage.value, "train"))
        return batch

    @override
    def teardown(self, stage: str) -> None:
        """At a stage's end: join every process's skipped records of its splits (a collective: Lightning calls
        it on every process) and, if any, print a summary."""
        splits = STAGE_SPLITS.get(stage, ())
        for split in splits:
            dataset = self.datasets.get(split)
            for part in getattr(dataset, "datasets", [dataset] if dataset is not None else []):
                if hasattr(part, "index"):  # lines dropped while indexing (shards find theirs while reading)
                    self.skipped.join(split, [part.index.skipped.found.get("index", {})])
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                every_process: list = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(every_process, self.skipped.found.get(split, {}))
                self.skipped.join(split, every_process)
        summary = self.skipped.summary(splits)
        if summary:
            rank_zero_warn(f"{stage}: {summary}")

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # uint8 images cross the host-device link (4x fewer bytes than float32); convert where it is cheap.
        if isinstance(batch, dict) and "image" in batch and not self.normalizes_in_workers():
            batch["image"] = self.normalize(batch["image"])
        return batch

    def normalize_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """For use outside a Trainer: the same conversion Lightning applies after transfer."""
        return self.on_after_batch_transfer(batch, 0)
