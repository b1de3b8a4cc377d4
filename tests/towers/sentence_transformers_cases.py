"""Export a LiT-like checkpoint (timm image tower, mean-pooled text tower) as a SentenceTransformer and reload it
offline with sentence-transformers as-is. Run by ``test_export_sentence_transformers.py`` in a pytest process of its
own: importing sentence-transformers adds classes (a ``ContrastiveLoss`` among them) that make the CLI's short class
names ambiguous for the tests that would run after these in the same process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from mm_lightning.assets import DEMO_BERT
from mm_lightning.cli import main
from mm_lightning.commands.export import (
    ExportError,
    build_sentence_transformer,
    check_sentence_transformer,
    export_sentence_transformers,
)
from mm_lightning.data.collate import load_tokenizer
from mm_lightning.data.transforms import Normalize
from mm_lightning.models import MultimodalModule
from mm_lightning.models.towers import HFTextTower, TimmTower, TorchvisionTower
from tests.towers.test_export_dual_encoder import MEAN, STD, _save_checkpoint

pytest.importorskip("timm")
sentence_transformers = pytest.importorskip("sentence_transformers")

HALF = [0.5, 0.5, 0.5]  # the tower's normalization; the data's (MEAN, STD) is what the export must use
CAPTIONS = ["a red square", "two small blue circles on a gray background"]


def _config(project_image: bool = False, pooling: str = "mean") -> dict[str, Any]:
    """configs/lit.yaml in small: efficientnet_lite0 at 32 px, no image head (or one), the demo BERT."""
    return {
        "image_tower": {
            "class_path": "mm_lightning.models.towers.TimmTower",
            "init_args": {"name": "efficientnet_lite0", "image_size": 32, "mean": HALF, "std": HALF},
        },
        "text_tower": {
            "class_path": "mm_lightning.models.towers.HFTextTower",
            "init_args": {"name": DEMO_BERT, "pretrained": False, "pooling": pooling},
        },
        "image": {"freeze": True, "project": project_image},
        "embed_dim": 16 if project_image else 1280,
        "objective": {"itm_weight": 0.0},
    }


def _build(config: dict[str, Any]) -> MultimodalModule:
    """The module of ``config``, every weight perturbed (as training would), the text projection's bias included."""
    torch.manual_seed(0)
    module = MultimodalModule(
        image_tower=TimmTower(**config["image_tower"]["init_args"]),
        text_tower=HFTextTower(**config["text_tower"]["init_args"]),
        image=config["image"],
        embed_dim=config["embed_dim"],
        objective=config["objective"],
    )
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        module.model.contrastive.logit_scale.fill_(3.25)
    return module.eval()


def test_a_lit_checkpoint_exports_as_a_sentence_transformer(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    config = _config()
    module = _build(config)
    assert isinstance(module.model.image_proj, torch.nn.Identity)
    checkpoint = _save_checkpoint(module, config, tmp_path / "lit.ckpt")
    out = tmp_path / "exported"
    assert (
        main(
            ["export", "--ckpt_path", str(checkpoint), "--format", "sentence-transformers", "--out", str(out)]
        )
        == 0
    )

    exported = sentence_transformers.SentenceTransformer(str(out), local_files_only=True, device="cpu")
    # the exported preprocessing is the training data's: its normalization (32 px images: no resize, so exactly),
    # its tokenizer truncating at its max_length
    pixels = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    images = [Image.fromarray(p.numpy()) for p in pixels]
    pixel_values = exported.preprocess(images)["pixel_values"]
    torch.testing.assert_close(
        pixel_values, Normalize(MEAN, STD)(pixels.permute(0, 3, 1, 2)), atol=1e-5, rtol=0
    )
    tokens = load_tokenizer(DEMO_BERT)(
        CAPTIONS, padding="longest", truncation=True, max_length=24, return_tensors="pt"
    )
    features = exported.preprocess(CAPTIONS)
    assert exported.max_seq_length == 24
    assert torch.equal(features["input_ids"], tokens["input_ids"])
    batch = {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}
    with torch.no_grad():
        want_image = module.model.encode_images(pixel_values)[1]
        want_text = module.model.encode_text(batch)[1]
    got_image = exported.encode(images, convert_to_tensor=True)
    got_text = exported.encode(CAPTIONS, convert_to_tensor=True)
    assert got_image.shape == got_text.shape == (2, 1280)
    torch.testing.assert_close(got_image, want_image, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_text, want_text, atol=1e-5, rtol=0)
    assert json.loads((out / "logit_scale.json").read_text()) == {"logit_scale": 3.25, "logit_bias": None}
    assert "checkpoint_sha256" in json.loads((out / "source_checkpoint.json").read_text())
    # control: without the text projection's bias the caption embeddings differ
    dense = exported[0].sub_modules["text"][-1]
    with torch.no_grad():
        dense.linear.bias.zero_()
    assert (exported.encode(CAPTIONS, convert_to_tensor=True) - want_text).abs().max() > 1e-3


def test_the_embedding_check_names_the_half_that_differs(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    module = _build(_config(project_image=True, pooling="cls")).model  # an image head, first-token pooling
    model = build_sentence_transformer(module, tmp_path, {})
    check_sentence_transformer(module, model)
    image_dense = model[0].sub_modules["image"][-1]
    with torch.no_grad():
        image_dense.linear.bias[0] += 1e-2
    with pytest.raises(ExportError, match=r"image: the exported SentenceTransformer's features differ"):
        check_sentence_transformer(module, model)
    with torch.no_grad():
        image_dense.linear.bias[0] -= 1e-2
        model[0].sub_modules["text"][0].auto_model.encoder.layer[0].output.dense.weight[0, 0] += 1e-2
    with pytest.raises(ExportError, match=r"text: the exported SentenceTransformer's features differ"):
        check_sentence_transformer(module, model)


def test_export_refuses_towers_it_cannot_express(tmp_path: Path) -> None:
    module = MultimodalModule(
        image_tower=TorchvisionTower("resnet_custom", image_size=32, kwargs={"widths": [8]}),
        text_tower=HFTextTower(DEMO_BERT, pretrained=False, pooling="mean"),
        embed_dim=8,
        objective={"itm_weight": 0.0},
    )
    with pytest.raises(
        ExportError, match=r"supports image tower TimmTower with text tower HFTextTower; .* 'resnet_custom'"
    ):
        export_sentence_transformers(module.model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
