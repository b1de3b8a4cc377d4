"""CLIP / SigLIP directories as towers: embeddings equal the library's get_image/text_features."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mm_lightning.models.towers.clip import CLIPImageTower, CLIPTextTower
from mm_lightning.models.towers.contract import projection_for
from tests.towers.dual_encoders import save_tiny


def _embed(
    image: CLIPImageTower, text: CLIPTextTower, images, ids, mask
) -> tuple[torch.Tensor, torch.Tensor]:
    image_proj, text_proj = projection_for(image, 0, image.embed_dim), projection_for(text, 0, text.embed_dim)
    assert not hasattr(image, "projection")  # moved out of the tower (a frozen tower leaves it trainable)
    with torch.no_grad():
        return image_proj(image.eval()(images).pooled), text_proj(text.eval()(ids, mask).pooled)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_towers_reproduce_the_library_features(tmp_path: Path, kind: str) -> None:
    reference = save_tiny(kind, tmp_path / kind)
    image, text = CLIPImageTower(str(tmp_path / kind)), CLIPTextTower(str(tmp_path / kind))
    torch.manual_seed(1)
    images = torch.randn(3, 3, 32, 32)
    ids = torch.randint(0, 99, (3, 7))
    mask = torch.ones_like(ids)
    got_image, got_text = _embed(image, text, images, ids, mask)
    with torch.no_grad():
        want_image = reference.get_image_features(pixel_values=images).pooler_output
        want_text = reference.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
    torch.testing.assert_close(got_image, want_image, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_text, want_text, atol=1e-5, rtol=0)
    assert image.logit_scale == pytest.approx(2.0) and text.logit_scale == pytest.approx(2.0)
    assert image.logit_bias == (None if kind == "clip" else pytest.approx(-3.0))
    assert image.embed_dim == text.embed_dim == got_image.shape[1]
    assert image.data_config["mean"] == pytest.approx((0.4, 0.5, 0.6))
    assert image.data_config["interpolation"] == "bicubic"
    assert text.data_config["tokenizer"] == str(tmp_path / kind)
    # control: another checkpoint of the same architecture gives other features
    save_tiny(kind, tmp_path / "other", seed=1)
    other_image, other_text = _embed(
        CLIPImageTower(str(tmp_path / "other")), CLIPTextTower(str(tmp_path / "other")), images, ids, mask
    )
    assert (other_image - want_image).abs().max() > 1e-3 and (other_text - want_text).abs().max() > 1e-3


def test_a_vision_only_directory_is_refused(tmp_path: Path) -> None:
    import transformers as hf

    hf.ViTModel(
        hf.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(tmp_path / "vit")
    with pytest.raises(ValueError, match="CLIPModel or SiglipModel"):
        CLIPImageTower(str(tmp_path / "vit"))
