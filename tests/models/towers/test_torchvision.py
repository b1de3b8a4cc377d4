"""torchvision image towers: backbones by name, custom CPU builds, weights files, data config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mm_lightning.models.towers import TorchvisionTower

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
    encoder = TorchvisionTower(name, weights=None, image_size=64)
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
    encoder = TorchvisionTower("resnet_custom", image_size=64, kwargs={"widths": [8, 16], "stem_stride": 4})
    stem = encoder.backbone[0][0]
    assert stem.kernel_size == (4, 4) and stem.stride == (4, 4)
    with torch.no_grad():
        out = encoder(torch.randn(1, 3, 64, 64))
    assert out.tokens.shape == (1, 8 * 8, 16)  # 64 / 4 = 16, then one stride-2 stage


def test_resnet_pooled_vector_is_torchvision_penultimate_feature() -> None:
    import torchvision

    torch.manual_seed(0)
    reference = torchvision.models.resnet18(weights=None).eval()
    encoder = TorchvisionTower("resnet18", image_size=64).eval()
    encoder.backbone.load_state_dict(
        {k: v for k, v in reference.state_dict().items() if not k.startswith("fc.")}
    )
    images = torch.randn(2, 3, 64, 64)
    reference.fc = torch.nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(encoder(images).pooled, reference(images))


def test_unknown_or_unsupported_backbones_raise() -> None:
    with pytest.raises(ValueError, match="no pretrained weights by name"):
        TorchvisionTower("resnet_custom", weights="DEFAULT")
    with pytest.raises(ValueError, match="not supported"):
        TorchvisionTower("squeezenet1_0")


@pytest.mark.parametrize("name", ["resnet_custom", "vit_custom"])
def test_image_gradient_checkpointing_same_gradients_and_recomputes(name: str) -> None:
    torch.manual_seed(0)
    encoder = TorchvisionTower(
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


def _small_resnet(seed: int) -> TorchvisionTower:
    torch.manual_seed(seed)
    return TorchvisionTower("resnet_custom", image_size=32, kwargs={"widths": [8, 16]}).eval()


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_weights_from_a_local_file_load_exactly(tmp_path: Path, suffix: str) -> None:
    source = _small_resnet(seed=0)
    path = tmp_path / f"weights{suffix}"
    state = {k: v.contiguous() for k, v in source.backbone.state_dict().items()}
    if suffix == ".pth":
        torch.save({"state_dict": state}, path)  # a wrapped state dict is unwrapped
    else:
        save_file(state, str(path))
    loaded = TorchvisionTower("resnet_custom", str(path), 32, {"widths": [8, 16]}).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images).pooled, source(images).pooled)
        # control: a differently initialised tower gives other features
        assert (_small_resnet(seed=1)(images).pooled - source(images).pooled).abs().max() > 1e-3


def test_torchvision_checkpoint_with_its_classifier_head_loads(tmp_path: Path) -> None:
    import torchvision

    torch.manual_seed(0)
    reference = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), path)  # includes fc.weight / fc.bias, which the tower drops
    tower = TorchvisionTower("resnet18", str(path), 64)
    torch.testing.assert_close(tower.backbone.conv1.weight, reference.conv1.weight)


def test_weights_file_errors_name_the_file_and_the_keys(tmp_path: Path) -> None:
    state = _small_resnet(seed=0).backbone.state_dict()
    partial = {k: v for k, v in state.items() if not k.startswith("1.")} | {"extra.weight": torch.zeros(1)}
    path = tmp_path / "partial.pth"
    torch.save(partial, path)
    with pytest.raises(
        ValueError, match=r"partial\.pth.*missing \(\d+\): 1\..*unexpected \(1\): extra\.weight"
    ):
        TorchvisionTower("resnet_custom", str(path), 32, {"widths": [8, 16]})
    with pytest.warns(UserWarning, match="loaded partially"):
        tower = TorchvisionTower("resnet_custom", str(path), 32, {"widths": [8, 16]}, strict=False)
    torch.testing.assert_close(tower.backbone[0][0].weight, state["0.0.weight"])
    wrong_shape = tmp_path / "wide.pth"
    torch.save(
        _small_resnet(seed=0).backbone.state_dict() | {"0.0.weight": torch.zeros(4, 3, 3, 3)}, wrong_shape
    )
    with pytest.raises(ValueError, match="shape mismatch"):
        TorchvisionTower("resnet_custom", str(wrong_shape), 32, {"widths": [8, 16]}, strict=False)
    with pytest.raises(FileNotFoundError, match="nowhere.pth"):
        TorchvisionTower("resnet_custom", str(tmp_path / "nowhere.pth"), 32)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_text("not a tensor file")
    with pytest.raises(ValueError, match="garbage.safetensors.*could not be read"):
        TorchvisionTower("resnet_custom", str(garbage), 32)


def test_data_config_follows_the_weights() -> None:
    plain = TorchvisionTower("resnet_custom", image_size=48, kwargs={"widths": [8]}).data_config
    assert plain == {
        "mean": (0.485, 0.456, 0.406),
        "std": (0.229, 0.224, 0.225),
        "input_size": (3, 48, 48),
        "interpolation": "bilinear",
        "pretrained": False,  # random init: the statistics are a default, not the weights' own
    }
    # a named torchvision weights entry brings its own preset (read without downloading the weights)
    from mm_lightning.models.towers.torchvision import _torchvision_data_config

    vit = _torchvision_data_config("vit_b_16", "IMAGENET1K_SWAG_E2E_V1", 384)
    assert vit["interpolation"] == "bicubic" and vit["input_size"] == (3, 384, 384)
