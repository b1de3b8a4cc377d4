"""The tower registry: bare names, registered family prefixes, clear errors for unknown families."""

from __future__ import annotations

import pytest
import torch

from mm_lightning.models.towers import (
    EncoderOutput,
    HFTextTower,
    TorchvisionTower,
    Tower,
    build_image_tower,
    build_text_tower,
    register_image_tower,
    register_text_tower,
)
from mm_lightning.models.towers.registry import IMAGE_TOWERS, TEXT_TOWERS, split_name


class _Constant(Tower):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.pooled_dim = self.token_dim = dim
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, images: torch.Tensor) -> EncoderOutput:
        pooled = self.scale * images.flatten(1)[:, : self.pooled_dim]
        return EncoderOutput(pooled, pooled[:, None], torch.ones(len(images), 1, dtype=torch.bool))


@pytest.fixture
def toy_family():
    calls = []

    @register_image_tower("toy")
    def build(name, weights, image_size, kwargs, strict):
        calls.append((name, weights, image_size, kwargs, strict))
        return _Constant(int(name))

    @register_text_tower("toy")
    def build_text(name, pretrained, config_overrides, pooling, trust_remote_code):
        calls.append((name, pretrained, config_overrides, pooling, trust_remote_code))
        return _Constant(int(name))

    yield calls
    del IMAGE_TOWERS["toy"], TEXT_TOWERS["toy"]


def test_bare_names_build_the_builtin_families() -> None:
    assert isinstance(
        build_image_tower("resnet_custom", image_size=32, kwargs={"widths": [8]}), TorchvisionTower
    )
    text = build_text_tower(
        "mm-lightning/demo-bert", pretrained=False, config_overrides={"num_hidden_layers": 1}
    )
    assert isinstance(text, HFTextTower)


def test_prefixed_names_dispatch_to_the_registered_builder(toy_family) -> None:
    tower = build_image_tower("toy:12", weights="w.safetensors", image_size=64, kwargs={"a": 1}, strict=False)
    assert isinstance(tower, _Constant) and tower.pooled_dim == 12
    build_text_tower("toy:5", pretrained=False, config_overrides=None, pooling="mean")
    assert toy_family == [("12", "w.safetensors", 64, {"a": 1}, False), ("5", False, {}, "mean", False)]


def test_unknown_family_and_double_registration_are_clear_errors(toy_family) -> None:
    with pytest.raises(ValueError, match=r"unknown image tower family 'nope'.*toy"):
        build_image_tower("nope:resnet50")
    with pytest.raises(ValueError, match="already registered"):
        register_image_tower("toy")(lambda *args: None)


def test_split_name_keeps_paths_whole() -> None:
    assert split_name("timm:vit_small_patch16_224") == ("timm", "vit_small_patch16_224")
    assert split_name("hf:/models/siglip") == ("hf", "/models/siglip")
    assert split_name("resnet50") == (None, "resnet50")
    assert split_name("/models/a:b") == (None, "/models/a:b")


def test_a_family_module_is_imported_on_first_use_of_its_prefix(tmp_path, monkeypatch) -> None:
    import sys

    import mm_lightning.models.towers as towers

    (tmp_path / "lazyfam.py").write_text(
        "from tests.models.towers.test_registry import _Constant\n"
        "from mm_lightning.models.towers import register_image_tower\n"
        "@register_image_tower('lazyfam')\n"
        "def build(name, weights, image_size, kwargs, strict):\n"
        "    return _Constant(int(name))\n"
    )
    monkeypatch.setattr(towers, "__path__", [*towers.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "mm_lightning.models.towers.lazyfam", raising=False)
    try:
        assert "lazyfam" not in IMAGE_TOWERS
        assert build_image_tower("lazyfam:7").pooled_dim == 7
    finally:
        IMAGE_TOWERS.pop("lazyfam", None)
        sys.modules.pop("mm_lightning.models.towers.lazyfam", None)
