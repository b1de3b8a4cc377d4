"""Export Hugging Face image + text towers as a VisionTextDualEncoderModel and reload it with transformers as-is."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
import transformers as hf
from PIL import Image

from mm_lightning.assets import DEMO_BERT, resolve_pretrained
from mm_lightning.cli import main
from mm_lightning.commands.export import (
    ExportError,
    build_dual_encoder,
    check_same_embeddings,
    export_hf,
    save_processor,
)
from mm_lightning.data.transforms import Normalize
from mm_lightning.models import MultimodalModule
from mm_lightning.models.towers import CLIPTextTower, HFTextTower, HFVisionTower, TorchvisionTower
from tests.towers.dual_encoders import save_tiny

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
VISION = {
    "vit": (hf.ViTConfig, hf.ViTModel),
    "clip_vision": (hf.CLIPVisionConfig, hf.CLIPVisionModel),
    "siglip_vision": (hf.SiglipVisionConfig, hf.SiglipVisionModel),
    "dinov2": (hf.Dinov2Config, hf.Dinov2Model),
}
MEAN, STD = (0.3, 0.4, 0.5), (0.2, 0.25, 0.3)


def _vision_dir(tmp_path: Path, kind: str = "vit") -> Path:
    config_cls, model_cls = VISION[kind]
    torch.manual_seed(0)
    path = tmp_path / kind
    model_cls(config_cls(**SMALL, image_size=32, patch_size=8)).save_pretrained(path)
    hf.ViTImageProcessor(
        image_mean=[0.5] * 3, image_std=[0.5] * 3, size={"height": 32, "width": 32}
    ).save_pretrained(path)
    return path


def _bert_dir(tmp_path: Path) -> Path:
    """A tiny random BERT with the built-in demo tokenizer (36 tokens)."""
    torch.manual_seed(1)
    path = tmp_path / "bert"
    hf.BertModel(hf.BertConfig(**SMALL, vocab_size=36, max_position_embeddings=64)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(resolve_pretrained(DEMO_BERT)) / name, path / name)
    return path


def _config(tmp_path: Path, kind: str = "vit", pooling: str = "cls", embed_dim: int = 16) -> dict[str, Any]:
    """The module's arguments over local tiny towers, as LightningCLI records them: the towers by class_path +
    init_args."""
    return {
        "image_tower": {
            "class_path": "mm_lightning.models.towers.HFVisionTower",
            "init_args": {"name": str(_vision_dir(tmp_path, kind)), "image_size": 32},
        },
        "text_tower": {
            "class_path": "mm_lightning.models.towers.HFTextTower",
            "init_args": {"name": str(_bert_dir(tmp_path)), "pooling": pooling},
        },
        "embed_dim": embed_dim,
        "objective": {"itm_weight": 0.0},
    }


def _build(config: dict[str, Any]) -> MultimodalModule:
    """The module of ``config``, every weight perturbed (as training would), projection biases included."""
    module = MultimodalModule(
        image_tower=HFVisionTower(**config["image_tower"]["init_args"]),
        text_tower=HFTextTower(**config["text_tower"]["init_args"]),
        embed_dim=config["embed_dim"],
        objective=config["objective"],
    )
    torch.manual_seed(2)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        module.model.contrastive.logit_scale.fill_(3.25)
    return module.eval()


def _module(tmp_path: Path, kind: str = "vit", pooling: str = "cls", embed_dim: int = 16) -> MultimodalModule:
    return _build(_config(tmp_path, kind, pooling, embed_dim))


def _save_checkpoint(module: MultimodalModule, config: dict[str, Any], path: Path) -> Path:
    """A training checkpoint of ``module`` (built from ``config``) as a CLI run writes it."""
    data = {
        "images": {"mean": MEAN, "std": STD, "size": 32},
        "tokenizer": module.model.data_config["text"]["tokenizer"],
        "max_length": 24,
    }
    torch.save(
        {
            "state_dict": module.state_dict(),
            # the model's config as LightningCLI records it, with how to rebuild the parts from it
            "hyper_parameters": {**config, "_instantiator": "lightning.pytorch.cli.instantiate_module"},
            "datamodule_hyper_parameters": data,
            "pytorch-lightning_version": lightning.__version__,
        },
        path,
    )
    return path


def test_hf_towers_export_reloads_as_a_vision_text_dual_encoder(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    config = _config(tmp_path)
    module = _build(config)
    checkpoint = _save_checkpoint(module, config, tmp_path / "trained.ckpt")
    out = tmp_path / "exported"
    assert main(["export", "--ckpt_path", str(checkpoint), "--format", "hf", "--out", str(out)]) == 0

    exported = hf.VisionTextDualEncoderModel.from_pretrained(out).eval()
    processor = hf.AutoProcessor.from_pretrained(out)
    assert isinstance(processor, hf.VisionTextDualEncoderProcessor)
    pixels = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    images = [Image.fromarray(p.numpy()) for p in pixels]
    inputs = processor(
        text=["a red square", "two small blue circles on gray"],
        images=images,
        return_tensors="pt",
        padding=True,
    )
    # the processor normalizes as the training data did (32 px images: no resize, so exactly)
    ours = Normalize(MEAN, STD)(pixels.permute(0, 3, 1, 2))
    torch.testing.assert_close(inputs["pixel_values"], ours, atol=1e-5, rtol=0)
    assert processor.tokenizer.model_max_length == 24
    batch = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    with torch.no_grad():
        got_image = exported.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        got_text = exported.get_text_features(**batch).pooler_output
        want_image = module.model.encode_images(inputs["pixel_values"])[1]
        want_text = module.model.encode_text(batch)[1]
        logits = exported(**inputs).logits_per_image
    torch.testing.assert_close(got_image, want_image, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_text, want_text, atol=1e-5, rtol=0)
    assert float(exported.logit_scale.detach()) == pytest.approx(3.25)
    expected = (
        torch.exp(torch.tensor(3.25))
        * module.model.embed_images(inputs["pixel_values"])
        @ module.model.embed_text(**batch).T
    )
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    # control: without the projection biases (what a plain weight copy would give) the features differ
    with torch.no_grad():
        exported.text_model.pooler.dense.bias.zero_()
        exported.vision_model.pooler.dense.bias.zero_()
        assert (exported.get_text_features(**batch).pooler_output - want_text).abs().max() > 1e-3
        assert (
            exported.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output - want_image
        ).abs().max() > 1e-3


def test_a_checkpoint_with_ungrouped_data_options_exports_its_preprocessing(tmp_path: Path) -> None:
    module = _module(tmp_path).model
    flat = {"mean": MEAN, "std": STD, "image_size": 32, "tokenizer": module.data_config["text"]["tokenizer"]}
    for data, mean in [(flat, MEAN), ({"tokenizer": flat["tokenizer"]}, module.data_config["image"]["mean"])]:
        save_processor(module, tmp_path / "processor", data)  # control: without them, the tower's own
        saved = hf.CLIPImageProcessor.from_pretrained(tmp_path / "processor")
        assert saved.image_mean == pytest.approx(list(mean)) and saved.crop_size["height"] == 32


@pytest.mark.parametrize("kind", ["clip_vision", "siglip_vision"])
def test_pooled_vision_models_take_the_projection_bias_into_their_own(tmp_path: Path, kind: str) -> None:
    torch.set_num_threads(1)
    module = _module(tmp_path, kind)
    assert module.model.image_proj.bias.abs().max() > 0.01
    out = export_hf(module.model, tmp_path / "out")
    exported = hf.VisionTextDualEncoderModel.from_pretrained(out).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got = exported.get_image_features(pixel_values=images).pooler_output
        torch.testing.assert_close(got, module.model.encode_images(images)[1], atol=1e-5, rtol=0)


def test_a_clip_text_half_pairs_with_an_hf_image_tower(tmp_path: Path) -> None:
    save_tiny("clip", tmp_path / "clip")
    module = MultimodalModule(
        image_tower=HFVisionTower(str(_vision_dir(tmp_path)), image_size=32),
        text_tower=CLIPTextTower(str(tmp_path / "clip")),
        embed_dim=16,
        objective={"itm_weight": 0.0},
    ).eval()
    target = build_dual_encoder(module.model)
    assert isinstance(target.text_model, hf.CLIPTextModel)
    check_same_embeddings(module.model, target)
    # SigLIP's text half has no stand-alone AutoModel, so VisionTextDualEncoderModel cannot hold it
    save_tiny("siglip", tmp_path / "siglip")
    module = MultimodalModule(
        image_tower=HFVisionTower(str(_vision_dir(tmp_path)), image_size=32),
        text_tower=CLIPTextTower(str(tmp_path / "siglip")),
        embed_dim=32,
        objective={"itm_weight": 0.0},
    )
    with pytest.raises(ExportError, match="cannot build its halves from ViTConfig \\+ SiglipTextConfig"):
        build_dual_encoder(module.model)


def test_export_refuses_what_the_dual_encoder_cannot_express(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="text.pooling: mean cannot be expressed"):
        export_hf(_module(tmp_path / "mean", pooling="mean").model, tmp_path / "out")
    with pytest.raises(ExportError, match="image: the projection has a bias and Dinov2Model"):
        export_hf(_module(tmp_path / "dinov2", "dinov2").model, tmp_path / "out")
    with pytest.raises(ExportError, match="image: embed_dim 48 exceeds the tower width 32"):
        export_hf(_module(tmp_path / "wide", embed_dim=48).model, tmp_path / "out")
    module = MultimodalModule(
        image_tower=TorchvisionTower("resnet_custom", image_size=32, kwargs={"widths": [8]}),
        text_tower=HFTextTower(DEMO_BERT, pretrained=False),
        embed_dim=8,
        objective={"itm_weight": 0.0},
    )
    with pytest.raises(
        ExportError, match=r"supports image towers HFVisionTower .* image tower 'resnet_custom'"
    ):
        export_hf(module.model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_embedding_check_names_the_half_that_differs(tmp_path: Path) -> None:
    module = _module(tmp_path)
    target = build_dual_encoder(module.model)
    check_same_embeddings(module.model, target)
    with torch.no_grad():
        target.text_model.encoder.layer[0].output.dense.weight[0, 0] += 1e-2
    with pytest.raises(ExportError, match=r"text: the exported VisionTextDualEncoderModel's features differ"):
        check_same_embeddings(module.model, target)


def test_export_command_reports_a_refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, pooling="mean")
    checkpoint = _save_checkpoint(_build(config), config, tmp_path / "mean.ckpt")
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--ckpt_path", str(checkpoint), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    assert "text.pooling: mean cannot be expressed" in capsys.readouterr().err
