"""The data's normalization follows the image tower's weights unless the user sets it."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Trainer

from mm_lightning.data import MultimodalDataModule
from mm_lightning.data.transforms import IMAGENET_MEAN
from mm_lightning.extras import ShardDataModule
from mm_lightning.models import MultimodalModule
from mm_lightning.models.towers import TimmTower, TorchvisionTower
from tests.data.helpers import TOKENIZER
from tests.models.helpers import tiny_kwargs

HALF = (0.5, 0.5, 0.5)


def _tiny_resnet(weights: str | None = None) -> TorchvisionTower:
    """The image tower of tests/models/helpers.py's TINY_MODEL, random init or from ``weights``."""
    return TorchvisionTower(
        "resnet_custom", weights=weights, image_size=32, kwargs={"widths": [8, 16], "layers": [1, 1]}
    )


def _normalized_grey(dm: MultimodalDataModule) -> torch.Tensor:
    return dm.normalize(torch.full((1, 3, 2, 2), 204, dtype=torch.uint8))[0, :, 0, 0]


def test_unset_statistics_follow_the_tower_and_explicit_ones_win() -> None:
    follows = MultimodalDataModule(tokenizer=TOKENIZER)
    assert follows.normalize.mean == list(IMAGENET_MEAN)  # no model yet
    follows.follow_image_tower({"mean": HALF, "std": HALF})
    assert torch.allclose(_normalized_grey(follows), torch.full((3,), 0.6))  # (0.8 - 0.5) / 0.5
    explicit = MultimodalDataModule(
        tokenizer=TOKENIZER, images={"mean": (0.1, 0.2, 0.3), "std": (1.0, 1.0, 1.0)}
    )
    explicit.follow_image_tower({"mean": HALF, "std": HALF})
    assert explicit.normalize.mean == [0.1, 0.2, 0.3] and explicit.normalize.std == [1.0, 1.0, 1.0]
    only_mean = MultimodalDataModule(tokenizer=TOKENIZER, images={"mean": (0.1, 0.2, 0.3)})
    only_mean.follow_image_tower({"mean": HALF, "std": HALF})
    assert only_mean.normalize.mean == [0.1, 0.2, 0.3] and only_mean.normalize.std == list(HALF)


@pytest.mark.parametrize("datamodule", [MultimodalDataModule, ShardDataModule])
@pytest.mark.parametrize("tower_mean", [HALF, None])
def test_the_data_follows_the_image_config_it_is_given(tower_mean: tuple | None, datamodule: type) -> None:
    pytest.importorskip("timm")
    config = tiny_kwargs(image_tower=TimmTower("test_resnet", image_size=32, mean=tower_mean, std=tower_mean))
    module = MultimodalModule(**config)
    dm = datamodule(tokenizer=TOKENIZER, image_config=module.data_config["image"])
    expected = module.data_config["image"]
    assert dm.normalize.mean == pytest.approx(list(expected["mean"]))
    assert dm.normalize.std == pytest.approx(list(expected["std"]))
    assert dm.normalize.mean != list(
        IMAGENET_MEAN
    )  # both timm's config and the override differ from the default


@pytest.mark.parametrize("datamodule", [MultimodalDataModule, ShardDataModule])
def test_the_data_follows_the_towers_input_size_and_interpolation(datamodule: type, tmp_path) -> None:
    pytest.importorskip("timm")
    module = MultimodalModule(**tiny_kwargs(image_tower=TimmTower("test_efficientnet", image_size=40)))
    tower = module.data_config["image"]
    assert tower["interpolation"] == "bicubic" and tower["input_size"][-1] == 40  # what timm's config says
    unlinked = datamodule(tokenizer=TOKENIZER, val_file=str(tmp_path / "val.jsonl"))
    assert (unlinked.image_size, unlinked.interpolation) == (224, "bilinear")  # no image config: the defaults
    dm = datamodule(tokenizer=TOKENIZER, val_file=str(tmp_path / "val.jsonl"), image_config=tower)
    assert (dm.image_size, dm.interpolation) == (40, "bicubic")
    # setup never reads the model the trainer holds: a trainer with another tower changes nothing
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(MultimodalModule(**tiny_kwargs(image_tower=_tiny_resnet())))
    dm.trainer = trainer
    dm.setup("predict")
    assert (dm.image_size, dm.interpolation) == (40, "bicubic")
    transform = dm.sample_builder("val")
    image = torch.randint(0, 256, (3, 50, 60), dtype=torch.uint8)
    out = transform.transform(image)
    window = image[None, :, :, 5:55]  # the center square of the shorter side
    want = torch.nn.functional.interpolate(window, size=(40, 40), mode="bicubic", antialias=True)[0]
    assert torch.equal(out, want)
    # control: the bilinear resize (what the data did before following the tower) differs
    bilinear = torch.nn.functional.interpolate(window, size=(40, 40), mode="bilinear", antialias=True)[0]
    assert not torch.equal(out, bilinear)


def test_set_statistics_that_differ_from_a_pretrained_tower_are_used_with_a_warning() -> None:
    pretrained = {"mean": HALF, "std": HALF, "input_size": (3, 224, 224), "pretrained": True}
    explicit = MultimodalDataModule(tokenizer=TOKENIZER, images={"mean": (0.1, 0.2, 0.3), "std": HALF})
    with pytest.warns(
        UserWarning,
        match=r"^data.images.mean \[0.1, 0.2, 0.3\], the tower's \[0.5, 0.5, 0.5\]: they differ from what the"
        r" pretrained image tower's weights expect",
    ):
        explicit.follow_image_tower(pretrained)
    assert explicit.normalize.mean == [0.1, 0.2, 0.3]  # the user's values win
    # controls: no warning for a tower whose statistics are only defaults, nor for values that agree
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultimodalDataModule(tokenizer=TOKENIZER, images={"mean": (0.1, 0.2, 0.3)}).follow_image_tower(
            {**pretrained, "pretrained": False}
        )
        MultimodalDataModule(tokenizer=TOKENIZER, images={"mean": HALF, "std": HALF}).follow_image_tower(
            pretrained
        )


def test_the_model_says_whether_its_image_statistics_come_from_trained_weights(tmp_path) -> None:
    random_init = MultimodalModule(**tiny_kwargs(image_tower=_tiny_resnet()))
    assert random_init.data_config["image"]["pretrained"] is False
    weights = tmp_path / "tower.pth"
    torch.save(random_init.model.image_encoder.backbone.state_dict(), weights)
    loaded = MultimodalModule(**tiny_kwargs(image_tower=_tiny_resnet(weights=str(weights))))
    assert loaded.data_config["image"]["pretrained"] is True
