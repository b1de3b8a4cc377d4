"""Built-in towers and losses are chosen by class: LightningCLI finds each by its short class name (what
``--model.image_tower TimmTower`` relies on), passes its ``init_args`` to it, and refuses an unknown name."""

from __future__ import annotations

from argparse import ArgumentError
from importlib import import_module

import pytest
from lightning.pytorch.cli import LightningArgumentParser

from mm_lightning.models import MultimodalModule
from mm_lightning.models.losses import ContrastiveLoss, SigLipLoss
from mm_lightning.models.towers import (
    CLIPImageTower,
    CLIPTextTower,
    HFTextTower,
    HFVisionTower,
    OpenCLIPImageTower,
    OpenCLIPTextTower,
    TimmTower,
    TorchvisionTower,
)

# the built-in tower each group gets unless the case names another (parsed only, so any name is fine)
DEFAULT_PARTS = ["--model.image_tower", "TorchvisionTower", "--model.text_tower", "HFTextTower"]
CASES = [
    ("image_tower", TorchvisionTower),
    ("image_tower", TimmTower),
    ("image_tower", HFVisionTower),
    ("image_tower", CLIPImageTower),
    ("image_tower", OpenCLIPImageTower),
    ("text_tower", HFTextTower),
    ("text_tower", CLIPTextTower),
    ("text_tower", OpenCLIPTextTower),
    ("loss", ContrastiveLoss),
    # open_clip has a SigLipLoss too: once open_clip is imported the short name is ambiguous and jsonargparse asks
    # for the full class path (tested below)
]


def _parser() -> LightningArgumentParser:
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(MultimodalModule, "model")
    return parser


def _class_of(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(import_module(module), name)


@pytest.mark.parametrize(("group", "cls"), CASES, ids=[cls.__name__ for _, cls in CASES])
def test_a_builtin_class_is_found_by_its_short_name(group: str, cls: type) -> None:
    args = [*DEFAULT_PARTS, f"--model.{group}", cls.__name__]
    if group != "loss":
        args += [f"--model.{group}.init_args.name", "some-model"]  # some towers' name has no default
    config = _parser().parse_args(args)
    assert _class_of(config.model[group].class_path) is cls


def test_short_names_build_the_builtin_classes_with_their_init_args() -> None:
    parser = _parser()
    config = parser.parse_args(
        [
            "--model.image_tower", "TorchvisionTower",
            "--model.image_tower.init_args.name", "resnet_custom",
            "--model.image_tower.init_args.image_size", "32",
            "--model.image_tower.init_args.kwargs", "{widths: [8]}",
            "--model.text_tower", "HFTextTower",
            "--model.text_tower.init_args.name", "mm-lightning/demo-bert",
            "--model.text_tower.init_args.pretrained", "false",
            "--model.text_tower.init_args.config_overrides", "{num_hidden_layers: 1}",
            "--model.text_tower.init_args.pooling", "mean",
            "--model.loss", "mm_lightning.models.losses.SigLipLoss",
            "--model.loss.init_args.bias_init", "-5",
            "--model.embed_dim", "16",
            "--model.fusion.heads", "2",
        ]
    )  # fmt: skip
    model = parser.instantiate_classes(config).model
    image, text, loss = model.model.image_encoder, model.model.text_encoder, model.model.contrastive
    assert isinstance(image, TorchvisionTower) and image.image_size == 32 and image.pooled_dim == 8
    assert isinstance(text, HFTextTower) and text.model.config.num_hidden_layers == 1
    assert isinstance(loss, SigLipLoss) and loss.logit_bias.item() == -5.0


def test_an_ambiguous_short_name_asks_for_the_full_class_path() -> None:
    pytest.importorskip("open_clip.loss")  # defines a SigLipLoss of its own
    with pytest.raises(ArgumentError, match="Give the full class path"):
        _parser().parse_args([*DEFAULT_PARTS, "--model.loss", "SigLipLoss"])


def test_an_unknown_class_name_is_refused_naming_it() -> None:
    with pytest.raises(ArgumentError, match="NoSuchTower"):
        _parser().parse_args(["--model.image_tower", "NoSuchTower", "--model.text_tower", "HFTextTower"])
