"""open_clip towers from a local checkpoint: embeddings equal encode_image / encode_text; tokenizer equivalence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.towers.dual_encoders import save_tiny_open_clip

open_clip = pytest.importorskip("open_clip")
from mm_lightning.models.towers.open_clip import OpenCLIPImageTower, OpenCLIPTextTower  # noqa: E402


def test_towers_reproduce_encode_image_and_encode_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    name, checkpoint, reference = save_tiny_open_clip(tmp_path)
    image, text = (
        OpenCLIPImageTower(name, str(checkpoint)).eval(),
        OpenCLIPTextTower(name, str(checkpoint)).eval(),
    )
    captions = ["a photo of a cat.", "two dogs play in the snow"]
    ids = open_clip.get_tokenizer(name)(captions)  # (2, 16), padded with 0
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out_image, want_image = image(images), reference.encode_image(images)
        # the HF tokenizer written for the data side gives open_clip's ids (up to padding)
        from transformers import AutoTokenizer

        hf_batch = AutoTokenizer.from_pretrained(text.data_config["tokenizer"])(
            captions, padding=True, return_tensors="pt"
        )
        length = hf_batch["input_ids"].shape[1]
        real = hf_batch["attention_mask"].bool()
        assert torch.equal(hf_batch["input_ids"][real], ids[:, :length][real])
        out_text = text(hf_batch["input_ids"], hf_batch["attention_mask"])
        want_text = reference.encode_text(ids)
    torch.testing.assert_close(out_image.pooled, want_image, atol=1e-5, rtol=0)
    torch.testing.assert_close(out_text.pooled, want_text, atol=1e-5, rtol=0)
    assert out_image.tokens.shape == (2, 16, 32) and out_text.tokens.shape == (2, length, 32)
    assert image.logit_scale == pytest.approx(2.0) and image.embed_dim == text.embed_dim == 16
    assert image.data_config["interpolation"] == "bicubic"
    # control: a different checkpoint of the same architecture
    _, other, _ = save_tiny_open_clip(tmp_path, seed=1)
    with torch.no_grad():
        assert (OpenCLIPImageTower(name, str(other)).eval()(images).pooled - want_image).abs().max() > 1e-3


def test_missing_checkpoint_is_reported(tmp_path: Path) -> None:
    name, _, _ = save_tiny_open_clip(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        OpenCLIPImageTower(name, str(tmp_path / "nope.pt"))
