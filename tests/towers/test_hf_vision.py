"""Hugging Face vision towers from local directories: weights, pooled vector, processor normalization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as hf

from mm_lightning.models.towers.hf_vision import HFVisionTower

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32)
CASES = {
    "vit": (hf.ViTConfig(**SMALL, patch_size=8), hf.ViTModel),
    "dinov2": (hf.Dinov2Config(**SMALL, patch_size=8), hf.Dinov2Model),
    "clip_vision": (hf.CLIPVisionConfig(**SMALL, patch_size=8), hf.CLIPVisionModel),
    "siglip_vision": (hf.SiglipVisionConfig(**SMALL, patch_size=8), hf.SiglipVisionModel),
}


def _save(tmp_path: Path, kind: str, mean: tuple[float, float, float]) -> tuple[Path, torch.nn.Module]:
    config, model_cls = CASES[kind]
    torch.manual_seed(0)
    model = model_cls(config).eval()
    path = tmp_path / kind
    model.save_pretrained(path)
    hf.ViTImageProcessor(
        image_mean=list(mean), image_std=[0.2, 0.3, 0.4], size={"height": 32, "width": 32}
    ).save_pretrained(path)
    return path, model


@pytest.mark.parametrize("kind", list(CASES))
def test_tower_matches_the_library_model_and_reads_the_processor(tmp_path: Path, kind: str) -> None:
    path, reference = _save(tmp_path, kind, (0.1, 0.2, 0.3))
    tower = HFVisionTower(str(path)).eval()
    images = torch.randn(2, 3, 32, 32)
    out = tower(images)
    with torch.no_grad():
        ref = reference(pixel_values=images)
    torch.testing.assert_close(out.tokens, ref.last_hidden_state)
    expected_pooled = ref.last_hidden_state[:, 0] if kind == "vit" else ref.pooler_output
    torch.testing.assert_close(out.pooled, expected_pooled)
    assert out.pooled.shape == (2, tower.pooled_dim) and out.mask.all()
    assert tower.data_config["mean"] == pytest.approx((0.1, 0.2, 0.3))
    assert tower.data_config["std"] == pytest.approx((0.2, 0.3, 0.4))
    assert tower.data_config["input_size"] == (3, 32, 32) and tower.data_config["interpolation"] == "bilinear"
    # control: the same architecture with random weights gives other features
    random_tower = HFVisionTower(str(path), pretrained=False).eval()
    assert not torch.allclose(random_tower(images).pooled, out.pooled)


def test_vision_half_of_a_clip_directory_and_other_resolution(tmp_path: Path) -> None:
    config = hf.CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
        vision_config=dict(SMALL, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(0)
    clip = hf.CLIPModel(config).eval()
    clip.save_pretrained(tmp_path / "clip")
    tower = HFVisionTower(str(tmp_path / "clip"), image_size=48).eval()
    images = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        ref = clip.vision_model(pixel_values=images, interpolate_pos_encoding=True).pooler_output
    torch.testing.assert_close(tower(images).pooled, ref)
    assert tower(images).tokens.shape == (2, 1 + 36, 32)
    # no preprocessor_config.json in the directory: ImageNet statistics (with a warning)
    assert tower.data_config["mean"] == pytest.approx((0.485, 0.456, 0.406))
