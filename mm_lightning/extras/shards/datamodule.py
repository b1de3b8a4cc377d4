"""ShardDataModule: train (and evaluate) from WebDataset shards, JSONL files, or a weighted mix of both.

    python -m mm_lightning fit --config configs/base.yaml \\
        --data.class_path mm_lightning.extras.ShardDataModule \\
        --data.init_args.train_shards 's3://bucket/laion/{00000..00127}.tar' \\
        --data.init_args.storage_options '{"endpoint_url": "http://127.0.0.1:9000"}'

Everything else (decode, transforms, tokenization, multi-caption, ``on_bad_record``) is the JSONL path's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset
from typing_extensions import override

from mm_lightning import ExplainedError
from mm_lightning.data.datamodule import MultimodalDataModule, Split
from mm_lightning.data.demo import demo_generator_args, generate_demo_dataset
from mm_lightning.data.order import TrainOrder
from mm_lightning.data.resume import ResumableDataLoader
from mm_lightning.data.seeding import global_seed
from mm_lightning.extras.shards.dataset import ShardDataset
from mm_lightning.extras.shards.files import list_shards
from mm_lightning.extras.shards.mixing import MixedDataset, ShardOrderSampler, SourcePlan
from mm_lightning.extras.shards.writer import DESCRIPTOR, write_shards

ShardSpec = str | list[str]


class UnorderableMix(ExplainedError, ValueError):
    """A training order other than the shuffle, asked of shards or a mix."""


@dataclass
class Source:
    """One training source of a mix: shards or a JSONL file, with its weight.

    Args:
        shards: shard pattern/list/descriptor (``a/{00000..00009}.tar``, ``s3://b/x.json``).
        file: a JSONL file instead (images resolved against ``image_root`` or the file's folder).
        weight: upsampling per epoch: 2.0 = each item twice, 0.5 = half of them (a different half each
            epoch); with ``epoch_samples``, the source's share is ``weight * size`` over the total.
        image_root: image folder of a JSONL source.
    """

    shards: ShardSpec | None = None
    file: str | None = None
    weight: float = 1.0
    image_root: str | None = None


class ShardDataModule(MultimodalDataModule):
    """:class:`MultimodalDataModule` whose splits can come from WebDataset shards (img2dataset's layout).

    Args:
        train_shards: training shards (pattern, list or ``shards.json`` descriptor); local, ``http(s)://``,
            ``s3://``, any fsspec URL, or ``pipe:<command>``.
        val_shards: validation shards (every caption is a query, like the JSONL path).
        test_shards: test shards.
        predict_shards: prediction shards.
        sources: a weighted training mix (replaces ``train_shards``/``train_file``), e.g.
            ``[{"shards": "laion/{0..9}.tar", "weight": 1}, {"file": "coco.jsonl", "weight": 3}]``.
        storage_options: fsspec options for remote shards (``{"endpoint_url": ...}``, credentials, ...).
            S3 also reads the usual ``AWS_*`` environment variables, ``AWS_ENDPOINT_URL`` included.
        cache_dir: local folder remote shards are fetched to (each is deleted when evicted).
        shuffle_shards: training shards whose samples are shuffled together (more: better mixing, more open).
        open_shards: shards kept open per loader process.
        epoch_samples: fixed samples per epoch (all ranks), drawn by weight with resampling; ``None``: an epoch
            is one weighted pass over the sources.
        **kwargs: every :class:`MultimodalDataModule` argument (batch size, workers, JSONL files, ...).
    """

    def __init__(
        self,
        train_shards: ShardSpec | None = None,
        val_shards: ShardSpec | None = None,
        test_shards: ShardSpec | None = None,
        predict_shards: ShardSpec | None = None,
        sources: list[Source] | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | None = None,
        shuffle_shards: int = 4,
        open_shards: int = 8,
        epoch_samples: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.shard_specs: dict[str, ShardSpec | None] = {
            "train": train_shards,
            "val": val_shards,
            "test": test_shards,
            "predict": predict_shards,
        }
        self.sources = [s if isinstance(s, Source) else Source(**s) for s in sources or []]

    def _shard_dataset(self, spec: ShardSpec, split: str) -> ShardDataset:
        hp = self.hparams
        train = split == "train"
        dataset = ShardDataset(
            list_shards(spec, hp.storage_options, hp.cache_dir),
            self.sample_builder(split),  # type: ignore[arg-type]
            text_key=hp.text_key,
            caption_sampling=self.loader_options.caption_sampling if train else "all",
            policy=self.bad_record_policy(),
            storage_options=hp.storage_options,
            cache_dir=hp.cache_dir,
            open_shards=max(hp.open_shards, hp.shuffle_shards + 2),
        )
        if len(dataset) == 0:
            raise ValueError(f"{split} shards {spec!r}: 0 samples listed; there is nothing to read.")
        return dataset

    def _train_mix(self) -> MixedDataset | None:
        if self.sources:
            parts: list[Dataset] = []
            for source in self.sources:
                if (source.shards is None) == (source.file is None):
                    raise ValueError(f"a source needs exactly one of 'shards' or 'file': {source}")
                if source.shards is not None:
                    parts.append(self._shard_dataset(source.shards, "train"))
                else:
                    parts.append(self.jsonl_dataset("train", source.file, source.image_root))
            return MixedDataset(parts, [str(s.shards or s.file) for s in self.sources])
        if self.shard_specs["train"] is not None:
            return MixedDataset([self._shard_dataset(self.shard_specs["train"], "train")])
        return None

    @override
    def build_dataset(self, split: Split) -> Dataset:  # type: ignore[override]
        if split == "train":
            mix = self._train_mix()
            if mix is not None:
                return mix
        elif self.shard_specs[split] is not None:
            return self._shard_dataset(self.shard_specs[split], split)  # type: ignore[arg-type]
        return super().build_dataset(split)

    @override
    def has_split(self, split: Split) -> bool:
        """A split has data when its JSONL file or shards are set (training also from ``sources``)."""
        has_data = self.files[split] is not None or self.shard_specs[split] is not None
        return has_data or (split == "train" and bool(self.sources))

    def sampler_plans(self, dataset: MixedDataset) -> list[SourcePlan]:
        weights = [s.weight for s in self.sources] or [1.0]
        plans = []
        for s, (part, weight) in enumerate(zip(dataset.datasets, weights, strict=True)):
            offset = int(dataset.offsets[s])
            if isinstance(part, ShardDataset):
                plans.append(SourcePlan(tuple(part.item_counts()), weight, offset, locality=True))
            else:
                plans.append(SourcePlan((len(part),), weight, offset, locality=False))  # type: ignore[arg-type]
        return plans

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        dataset = self._dataset("train")
        if not isinstance(dataset, MixedDataset):
            return super().train_dataloader()
        if type(self.train_order) is not TrainOrder:
            raise UnorderableMix(
                f"data.init_args.train_order: {type(self.train_order).__name__} orders a JSONL training split;"
                " shards and mixes are read in their own order (shuffle_shards, the sources' weights)"
            )
        world, rank = self._rank_info()
        sampler = ShardOrderSampler(
            self.sampler_plans(dataset),
            num_replicas=world,
            rank=rank,
            seed=global_seed(),
            shuffle_shards=self.hparams.shuffle_shards,
            epoch_samples=self.hparams.epoch_samples,
            batch_size=self.reader_batch_size(),
        )
        self.check_a_batch(sampler.stream_length() // world, f"{len(dataset)} samples")
        kwargs = self._loader_kwargs(self.reader_batch_size())
        loader = ResumableDataLoader(dataset, sampler, self.processes(), drop_last=True, **kwargs)
        return self.train_position.track(loader, self.trainer)


class DemoShardDataModule(ShardDataModule):
    """The synthetic demo, converted to shards on first use (``<data_dir>/shards/<split>/``) and read from them.

    Args:
        data_dir: cache folder of the generated demo (JSONL + PNG) and its shards.
        render_size: side of the generated images.
        train_renders: renders of each training attribute combination.
        num_val: validation images.
        num_test: test images.
        demo_seed: seed of the generator.
        samples_per_shard: shard size (the demo's last training shard is smaller: shards are uneven).
        **kwargs: any :class:`ShardDataModule` argument.
    """

    def __init__(
        self,
        data_dir: str = "data/demo",
        render_size: int = 64,
        train_renders: int = 4,
        num_val: int = 150,
        num_test: int = 150,
        demo_seed: int = 0,
        samples_per_shard: int = 500,
        **kwargs: Any,
    ) -> None:
        shards = Path(data_dir) / "shards"
        for split in ("train", "val", "test"):
            if kwargs.get(f"{split}_shards") is None:  # the CLI passes every argument, unset ones as None
                kwargs[f"{split}_shards"] = str(shards / split / DESCRIPTOR)
        super().__init__(**kwargs)
        self.data_dir, self.samples_per_shard = Path(data_dir), samples_per_shard
        self.generator_args = demo_generator_args(render_size, train_renders, num_val, num_test, demo_seed)

    @override
    def prepare_data(self) -> None:
        generate_demo_dataset(self.data_dir, **self.generator_args)
        for split in ("train", "val", "test"):
            parser = self.record_parser(split, str(self.data_dir / f"{split}.jsonl"), str(self.data_dir))
            # Resumable and fingerprinted: a rerun reuses finished shards; new demo data rewrites them.
            write_shards(
                parser,
                str(self.data_dir / "shards" / split),
                self.samples_per_shard,
                workers=1,
                progress=False,
            )
