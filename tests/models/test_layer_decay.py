"""Layer-wise learning-rate decay (``model.param_groups: LayerDecay``): every built-in tower family declares its layer
groups, input to output; each group's rate is the tower's times decay ** (depth - i), as the learning-rate monitor
shows in a CLI run from YAML."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from mm_lightning.cli import main
from mm_lightning.extras import LayerDecay
from mm_lightning.models import MultimodalModule
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
from mm_lightning.models.towers.contract import TowerContractError
from tests.conftest import tiny_demo_args
from tests.models.helpers import TINY_MODEL, tiny_kwargs
from tests.towers.dual_encoders import save_tiny, save_tiny_open_clip
from tests.towers.test_hf_vision import _save as save_hf_vision

DEMO_BERT = {"name": "mm-lightning/demo-bert", "pretrained": False}


def clip_half(tower_class: type) -> Callable[[Path], nn.Module]:
    def build(tmp_path: Path) -> nn.Module:
        save_tiny("clip", tmp_path / "clip")
        return tower_class(str(tmp_path / "clip"))

    return build


def open_clip_half(tower_class: type) -> Callable[[Path], nn.Module]:
    def build(tmp_path: Path) -> nn.Module:
        name, checkpoint, _ = save_tiny_open_clip(tmp_path)
        return tower_class(name, str(checkpoint))

    return build


# tower -> (groups, a parameter of the first group, one of the last)
FAMILIES: dict[str, tuple[Callable[[Path], nn.Module], int, str, str]] = {
    "torchvision-resnet": (lambda _: TorchvisionTower("resnet18", image_size=32), 5, "conv1", "layer4.1"),
    "torchvision-custom": (
        lambda _: TorchvisionTower("resnet_custom", image_size=32, kwargs={"widths": [8, 16], "layers": [1, 1]}),
        3, "backbone.0.", "backbone.2.",
    ),
    "torchvision-vit": (lambda _: TorchvisionTower("vit_b_16", image_size=224), 14, "class_token", "encoder.ln"),
    "torchvision-mobilenet": (lambda _: TorchvisionTower("mobilenet_v3_small", image_size=32), 14, "features.0.", "classifier.0."),
    "timm": (lambda _: TimmTower("resnet10t", image_size=32), 5, "conv1", "layer4"),
    "hf-text": (lambda _: HFTextTower(**DEMO_BERT), 3, "embeddings", "layer.1."),  # mean pooling: no pooler
    "hf-vision-vit": (lambda p: HFVisionTower(str(save_hf_vision(p, "vit", (0.5,) * 3)[0])), 3, "embed", "layernorm"),
    "hf-vision-siglip": (
        lambda p: HFVisionTower(str(save_hf_vision(p, "siglip_vision", (0.5,) * 3)[0])), 3, "embed", "head.",
    ),
    "clip-image": (clip_half(CLIPImageTower), 3, "embeddings", "post_layernorm"),
    "clip-text": (clip_half(CLIPTextTower), 3, "embeddings", "final_layer_norm"),
    "open_clip-image": (open_clip_half(OpenCLIPImageTower), 3, "conv1", "ln_post"),
    "open_clip-text": (open_clip_half(OpenCLIPTextTower), 3, "token_embedding", "ln_final"),
}  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_built_in_family_declares_its_layer_groups_input_to_output(tmp_path: Path, family: str) -> None:
    build, count, first, last = FAMILIES[family]
    tower = build(tmp_path)
    groups = tower.layer_groups()
    names = [name for group in groups for name in group]
    assert sorted(names) == sorted(name for name, _ in tower.named_parameters())  # each parameter once
    assert len(groups) == count, [g[0] for g in groups]
    assert any(first in name for name in groups[0]) and any(last in name for name in groups[-1])


def rates(**groups: dict) -> dict[str, float]:
    torch.manual_seed(0)
    module = MultimodalModule(**tiny_kwargs(**groups))
    module.trainer = pl.Trainer(max_steps=10, logger=False)
    optimizer = module.configure_optimizers()["optimizer"]
    covered = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(covered) == sorted(id(p) for p in module.parameters() if p.requires_grad)  # each once
    return {group["name"]: group["lr"] for group in optimizer.param_groups}


def test_each_layer_group_gets_the_towers_rate_times_decay_to_its_depth() -> None:
    lrs = rates(image={"lr": 1e-2}, param_groups=LayerDecay(image=0.5, text=0.8))
    image = [lrs[f"image_encoder_layer{i}"] for i in range(3)]  # the tiny tower: stem, 2 stages
    assert image == pytest.approx([1e-2 * 0.25, 1e-2 * 0.5, 1e-2])
    assert lrs["image_encoder_layer0_no_decay"] == image[0]
    text = [lrs[f"text_encoder_layer{i}"] for i in range(2)]  # embeddings, 1 layer
    assert text == pytest.approx([1e-3 * 0.8, 1e-3])  # optim.lr when the tower sets none
    assert lrs["heads"] == 1e-3 and "image_encoder" not in lrs  # no parameter left outside the layer groups
    # control: without the option a tower is one group at its rate
    plain = rates(image={"lr": 1e-2})
    assert plain["image_encoder"] == 1e-2 and not any("layer" in name for name in plain)


class NoGroups(TorchvisionTower):
    layer_groups = None  # a user tower that does not declare them


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"param_groups": LayerDecay(image=0.5)}, r"model.param_groups \(LayerDecay's image\)"),
        ({"image": {"train_last": 1}}, "model.image.train_last"),
    ],
)
def test_a_tower_without_layer_groups_is_named(options: dict, named: str) -> None:
    tower = NoGroups(**TINY_MODEL["image_tower"]["init_args"])
    with pytest.raises(TowerContractError, match=rf"has no layer_groups\(\), which {named} needs"):
        MultimodalModule(**tiny_kwargs(image_tower=tower, **options)).configure_optimizers()


@pytest.mark.timeout(120)
def test_the_learning_rate_monitor_shows_each_group_in_a_cli_run(tmp_path: Path) -> None:
    overlay = tmp_path / "decay.yaml"
    overlay.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "param_groups": {
                        "class_path": "mm_lightning.extras.LayerDecay",
                        "init_args": {"image": 0.5, "text": 0.7},
                    }
                }
            }
        )
    )
    assert main(["fit", *tiny_demo_args(tmp_path, "--config", str(overlay), max_steps=3)]) == 0
    events = EventAccumulator(str(tmp_path / "version_0")).Reload()
    last = {
        tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"] if tag.startswith("lr-AdamW/")
    }
    image = [last[f"lr-AdamW/image_encoder_layer{i}"] for i in range(5)]  # the demo's stem, 4 stages
    assert [rate / image[-1] for rate in image] == pytest.approx([0.5**4, 0.5**3, 0.5**2, 0.5, 1.0])
    text = [last[f"lr-AdamW/text_encoder_layer{i}"] for i in range(3)]  # embeddings, 2 layers
    assert [rate / text[-1] for rate in text] == pytest.approx([0.7**2, 0.7, 1.0])
    assert last["lr-AdamW/heads"] == pytest.approx(image[-1])
    # the rule is recorded as the config named it, and a checked load rebuilds it
    reloaded = MultimodalModule.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert isinstance(reloaded.param_group_rule, LayerDecay)
    assert reloaded.param_group_rule.decay == {"image": 0.5, "text": 0.7}
