"""MultimodalDataModule: records, multi-caption protocol, batches, tokenization, workers, normalization."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from mm_lightning.data import MultimodalDataModule
from mm_lightning.data.config import DEFAULT_IMAGES, DEFAULT_LOADER
from mm_lightning.data.order import Visit
from mm_lightning.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from tests.data.helpers import TOKENIZER, coco_style, save_image, write_jsonl


def _dm(train: Path, images: dict | None = None, **kwargs: object) -> MultimodalDataModule:
    args = {"val_file": str(train), "tokenizer": TOKENIZER, "batch_size": 4} | kwargs
    return MultimodalDataModule(train_file=str(train), images={"size": 32, **(images or {})}, **args)


def test_option_groups_keep_their_defaults_and_refuse_unknown_keys() -> None:
    dm = MultimodalDataModule(tokenizer=TOKENIZER, images={"horizontal_flip": True})
    assert dm.image_options == dataclasses.replace(DEFAULT_IMAGES, horizontal_flip=True)
    assert dm.loader_options == DEFAULT_LOADER and dm.image_size == 224
    assert dm.hparams["images"] == {
        **dataclasses.asdict(DEFAULT_IMAGES),
        "horizontal_flip": True,
    }  # plain data
    with pytest.raises(
        ValueError, match=r"data.loader \(LoaderOptions\): unknown option\(s\) \['pin_memroy'\]"
    ):
        MultimodalDataModule(tokenizer=TOKENIZER, loader={"pin_memroy": True})


def test_batch_contract(tmp_path: Path) -> None:
    dm = _dm(coco_style(tmp_path, num_images=4, captions_per_image=2), loader={"normalize_on": "device"})
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (4, 3, 32, 32) and batch["image"].dtype == torch.uint8
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert batch[key].dtype == torch.long and batch[key].shape[0] == 4
    assert batch["image_id"].shape == batch["index"].shape == (4,)
    # dynamic padding: the longest caption in the batch has no padding at all
    assert batch["attention_mask"].sum(1).max() == batch["input_ids"].shape[1]


def test_padding_multiple_and_truncation(tmp_path: Path) -> None:
    train = coco_style(tmp_path, num_images=4, captions_per_image=1)
    dm = _dm(train, loader={"pad_to_multiple_of": 8})
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    assert batch["input_ids"].shape[1] % 8 == 0
    dm_short = _dm(train, max_length=5)
    dm_short.setup("fit")
    assert next(iter(dm_short.val_dataloader()))["input_ids"].shape[1] == 5


def test_multi_caption_train_draws_one_caption_per_image(tmp_path: Path) -> None:
    dm = _dm(coco_style(tmp_path, num_images=3, captions_per_image=4), loader={"caption_sampling": "random"})
    dm.setup("fit")
    train, val = dm.datasets["train"], dm.datasets["val"]
    assert len(train) == 3 and len(val) == 12
    seen = {train[Visit(0, epoch, 0)]["caption"] for epoch in range(40)}  # a caption drawn per visit
    assert len(seen) > 1 and all(c.startswith("a red circle number 0 ") for c in seen)
    expanded = _dm(tmp_path / "split.jsonl", loader={"caption_sampling": "all"})
    expanded.setup("fit")
    assert len(expanded.datasets["train"]) == 12


def test_eval_keeps_every_caption_with_image_ids(tmp_path: Path) -> None:
    dm = _dm(coco_style(tmp_path, num_images=3, captions_per_image=2))
    dm.setup("validate")
    rows = [
        r for b in dm.val_dataloader() for r in zip(b["image_id"].tolist(), b["index"].tolist(), strict=True)
    ]
    assert [i for _, i in rows] == list(range(6))
    assert [img for img, _ in rows] == [0, 0, 1, 1, 2, 2]


def test_same_image_on_several_lines_gets_one_id(tmp_path: Path) -> None:
    save_image(tmp_path / "images" / "a.jpg")
    save_image(tmp_path / "images" / "b.jpg", seed=1)
    rows = [
        {"image_path": "images/a.jpg", "caption": "first a"},
        {"image_path": "images/b.jpg", "caption": "only b"},
        {"image_path": "./images/../images/a.jpg", "caption": "second a"},
    ]
    train = write_jsonl(tmp_path / "seeds.jsonl", rows)
    dm = _dm(train, image_key="image_path", text_key="caption", loader={"caption_sampling": "random"})
    dm.setup("fit")
    ids = dm.datasets["val"].index.image_ids.tolist()
    assert ids[0] == ids[2] != ids[1]
    assert len(dm.datasets["train"]) == 2  # one item per image in training
    visits = [Visit(ids[0], epoch, 0) for epoch in range(30)]
    assert {dm.datasets["train"][v]["caption"] for v in visits} == {"first a", "second a"}


def test_image_root_option(tmp_path: Path) -> None:
    save_image(tmp_path / "pics" / "a.jpg")
    train = write_jsonl(tmp_path / "meta" / "train.jsonl", [{"image": "a.jpg", "text": "a cat"}])
    dm = _dm(train, image_root=str(tmp_path / "pics"))
    dm.setup("fit")
    assert dm.datasets["train"][0]["image"].shape == (3, 32, 32)


def test_eval_transform_is_deterministic_train_is_random(tmp_path: Path) -> None:
    dm = _dm(
        coco_style(tmp_path, num_images=1, captions_per_image=1, size=(80, 40)),
        images={"train_scale": (0.3, 1.0)},
    )
    dm.setup("fit")
    assert torch.equal(dm.datasets["val"][0]["image"], dm.datasets["val"][0]["image"])
    crops = [dm.datasets["train"][Visit(0, epoch, 0)]["image"] for epoch in range(5)]
    assert any(not torch.equal(crops[0], c) for c in crops[1:])
    again = dm.datasets["train"][Visit(0, 3, 0)]["image"]
    assert torch.equal(again, crops[3])  # the same visit draws the same crop


class _Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.images: list[torch.Tensor] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.images.append(batch["image"])
        return self.w * batch["image"].mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("normalize_on", ["device", "worker", "auto"])
def test_model_receives_normalized_float_images(tmp_path: Path, normalize_on: str) -> None:
    dm = _dm(
        coco_style(tmp_path, num_images=4, captions_per_image=1),
        loader={"normalize_on": normalize_on},
        val_file=None,
    )
    model = _Recorder()
    trainer = pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    image = model.images[0]
    assert image.dtype == torch.float32
    # normalized with the ImageNet statistics: maps back onto the uint8 pixel grid exactly
    pixels = image * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(
        1, 3, 1, 1
    )
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
    assert torch.allclose(pixels * 255, (pixels * 255).round(), atol=1e-3)
    assert dm.normalizes_in_workers() == (normalize_on == "worker")  # auto under a Trainer: after transfer


@pytest.mark.parametrize("normalize_on", ["device", "worker", "auto"])
def test_from_python_without_trainer(tmp_path: Path, normalize_on: str) -> None:
    dm = _dm(coco_style(tmp_path, num_images=4, captions_per_image=1), loader={"normalize_on": normalize_on})
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    # auto outside a Trainer normalizes in the workers, so a plain loop feeds the model float images
    assert batch["image"].dtype == (torch.uint8 if normalize_on == "device" else torch.float32)
    assert dm.normalize_batch(batch)["image"].dtype == torch.float32


def test_collate_and_dataset_pickle_without_tokenizer(tmp_path: Path) -> None:
    dm = _dm(coco_style(tmp_path, num_images=4, captions_per_image=1))
    dm.setup("fit")
    next(iter(dm.train_dataloader()))  # loads the tokenizer in this process
    blob = pickle.dumps(dm.collate)
    assert b"WordPiece" not in blob and len(blob) < 10_000
    restored = pickle.loads(pickle.dumps(dm.datasets["train"]))
    assert restored.index._fh is None  # the open JSONL handle never travels to workers
    assert (
        restored[1]["caption"] == dm.datasets["train"][1]["caption"] == "a red circle number 1 version 0 left"
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
# forkserver pickles the loader as spawn does (and is Python 3.14's default on Linux)
@pytest.mark.parametrize("context", ["forkserver", "fork"])
def test_workers_with_each_start_method(tmp_path: Path, context: str) -> None:
    dm = _dm(
        coco_style(tmp_path, num_images=8, captions_per_image=1),
        num_workers=2,
        loader={
            "multiprocessing_context": context,
            "persistent_workers": True,
            "batch_slots": True,
            "prefetch_factor": 2,
            "normalize_on": "device",
        },
    )
    dm.setup("fit")
    loader = dm.val_dataloader()
    batches = list(loader)
    assert sorted(i for b in batches for i in b["index"].tolist()) == list(range(8))
    # the workers (spawned too) stacked the images into the loader's shared slots
    assert all(loader.collate_fn.slots.owns(b["image"]) for b in batches)


def test_loaders_with_persistent_workers_have_slots_of_their_own(tmp_path: Path) -> None:
    train = coco_style(tmp_path, num_images=8, captions_per_image=1)
    slots = {"normalize_on": "device"}  # batch slots are on by default
    dm = _dm(train, num_workers=2, loader={**slots, "persistent_workers": True})
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == 2 and all(loader.collate_fn.slots.owns(b["image"]) for b in batches)
    assert dm.val_dataloader().collate_fn.slots is not loader.collate_fn.slots  # workers alive side by side
    # controls: workers restarted every epoch get none, nor do loaders that turn slots off
    dm = _dm(train, num_workers=2, loader={**slots, "persistent_workers": False})
    dm.setup("fit")
    assert dm.train_dataloader().collate_fn.slots is None
    dm = _dm(train, num_workers=2, loader={"persistent_workers": True, "batch_slots": False})
    dm.setup("fit")
    assert dm.train_dataloader().collate_fn.slots is None


def test_a_missing_jsonl_file_is_named_with_what_to_do(tmp_path: Path) -> None:
    missing = tmp_path / "my_dataset" / "train.jsonl"
    dm = MultimodalDataModule(train_file=str(missing), tokenizer=TOKENIZER, batch_size=2)
    with pytest.raises(
        FileNotFoundError, match=r"my_dataset/train.jsonl: no such JSONL file .*demo_data.yaml"
    ):
        dm.setup("fit")
