"""Image towers over torchvision: any classification backbone by name, or a small ResNet/ViT for CPU runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from urllib.error import URLError

import torch
import torchvision
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torchvision.models.vision_transformer import VisionTransformer

from mm_lightning.assets import LOCAL_IMAGE, PretrainedUnavailable
from mm_lightning.models.towers.contract import (
    EncoderOutput,
    Tower,
    TowerOptionsError,
    check_model_name,
    image_data_config,
    is_weights_file,
)
from mm_lightning.models.towers.small_resnet import SmallResNet
from mm_lightning.models.towers.weights import load_weights_file

CUSTOM_IMAGE_ENCODERS = ("resnet_custom", "vit_custom")


def _flatten_map(fmap: Tensor) -> Tensor:
    return fmap.flatten(2).transpose(1, 2)


class TorchvisionTower(Tower):
    """Image tower over a torchvision backbone.

    Args:
        name: torchvision model (``torchvision.models.list_models()``), ``resnet_custom`` or ``vit_custom``.
        weights: torchvision weights name (``IMAGENET1K_V2``), a local ``.pth``/``.pt``/``.bin``/``.safetensors`` file, or None.
        image_size: input resolution (ViTs are built for it).
        kwargs: extra backbone constructor arguments (``widths``, ``layers``, ``stem_stride`` of ``resnet_custom``;
            ``patch_size``, ``num_layers``, ``num_heads``, ``hidden_dim``, ``mlp_dim`` of ``vit_custom``).
        strict: with a weights file, fail on missing or unexpected keys (False loads what matches, warns)."""

    def __init__(
        self,
        name: str = "resnet50",
        weights: str | None = None,
        image_size: int = 224,
        kwargs: dict | None = None,
        strict: bool = True,
    ) -> None:
        super().__init__()
        kwargs = dict(kwargs or {})
        check_model_name(
            "TorchvisionTower",
            name,
            [*CUSTOM_IMAGE_ENCODERS, *torchvision.models.list_models()],
            "torchvision.models.list_models()",
        )
        from_file = is_weights_file(weights)
        if weights is not None and not from_file and name in CUSTOM_IMAGE_ENCODERS:
            raise ValueError(f"{name} has no pretrained weights by name; got weights={weights!r}")
        if name == "resnet_custom":
            self.backbone: nn.Module = SmallResNet(**kwargs)
        elif name == "vit_custom":
            vit_args = dict(patch_size=8, num_layers=2, num_heads=4, hidden_dim=128, mlp_dim=256) | kwargs
            self.backbone = VisionTransformer(image_size=image_size, **vit_args)
        else:
            if name.startswith("vit_"):
                kwargs.setdefault("image_size", image_size)
            try:
                self.backbone = torchvision.models.get_model(
                    name, weights=None if from_file else weights, **kwargs
                )
            except TypeError as error:  # e.g. resnet_custom's widths/layers left in kwargs
                raise TowerOptionsError("TorchvisionTower", name, kwargs, error) from None
            except (URLError, TimeoutError) as error:
                raise PretrainedUnavailable(
                    f"image tower {name!r}: weights {weights!r} are not in the torch hub cache and downloading"
                    f" them failed ({getattr(error, 'reason', error)}). Use {LOCAL_IMAGE}."
                ) from error
        full_keys = set(self.backbone.state_dict())
        self._forward_impl, self.pooled_dim, self.token_dim = self._adapt(name)
        if from_file:
            head_keys = full_keys - set(self.backbone.state_dict())
            load_weights_file(self.backbone, weights, strict=strict, ignored=head_keys)
        self.name, self.image_size = name, image_size
        self._data_config = _torchvision_data_config(name, None if from_file else weights, image_size)
        self._data_config["pretrained"] = weights is not None
        self.gradient_checkpointing = False

    @property
    def data_config(self) -> dict[str, Any]:
        """ImageNet statistics and the weights' interpolation (torchvision's own transforms when named)."""
        return dict(self._data_config)

    def _adapt(self, name: str) -> tuple[Callable[[Tensor], EncoderOutput], int, int]:
        """Drops the classification head and picks how tokens and pooled vector are read."""
        bb = self.backbone
        if isinstance(bb, SmallResNet):
            return self._forward_small_resnet, bb.out_channels, bb.out_channels
        if isinstance(bb, VisionTransformer):
            bb.heads = nn.Identity()
            return self._forward_vit, bb.hidden_dim, bb.hidden_dim
        if hasattr(bb, "layer4") and isinstance(getattr(bb, "fc", None), nn.Linear):
            dim = bb.fc.in_features
            bb.fc = nn.Identity()
            return self._forward_resnet, dim, dim
        if hasattr(bb, "features") and hasattr(bb, "avgpool") and isinstance(bb.classifier, nn.Sequential):
            # earlier classifier layers (ConvNeXt LayerNorm2d, MobileNetV3 1st Linear) shape the pooled vector
            pooled_dim = bb.classifier[-1].in_features
            bb.classifier[-1] = nn.Identity()
            token_dim = next(
                m.out_channels for m in reversed(list(bb.features.modules())) if hasattr(m, "out_channels")
            )
            return self._forward_features, pooled_dim, token_dim
        raise ValueError(
            f"image encoder {name!r} is not supported: expected a ResNet-like (layer4 + fc), a VisionTransformer, "
            "or a features/avgpool/classifier CNN (ConvNeXt, EfficientNet, MobileNet), or one of "
            f"{CUSTOM_IMAGE_ENCODERS}"
        )

    def layer_groups(self) -> list[list[str]]:
        """Parameter names from input to output: the stem, each stage (ResNet) or encoder layer (ViT), the norm."""
        from mm_lightning.models.towers.layers import numbered_layer_groups

        blocks = r"^backbone\.(?:layer|features\.)?(\d+)\.|\.encoder_layer_(\d+)\."
        return numbered_layer_groups(self, blocks)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        self.gradient_checkpointing = enabled

    def _run_stages(self, x: Tensor, stages: Sequence[nn.Module]) -> Tensor:
        for stage in stages:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(stage, x, use_reentrant=False)
            else:
                x = stage(x)
        return x

    def _cnn_output(self, fmap: Tensor) -> EncoderOutput:
        tokens = _flatten_map(fmap)
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        return EncoderOutput(pooled=tokens.mean(dim=1), tokens=tokens, mask=mask)

    def _forward_small_resnet(self, x: Tensor) -> EncoderOutput:
        return self._cnn_output(self._run_stages(x, list(self.backbone)))

    def _forward_resnet(self, x: Tensor) -> EncoderOutput:
        bb = self.backbone
        x = bb.maxpool(bb.relu(bb.bn1(bb.conv1(x))))
        return self._cnn_output(self._run_stages(x, [bb.layer1, bb.layer2, bb.layer3, bb.layer4]))

    def _forward_features(self, x: Tensor) -> EncoderOutput:
        bb = self.backbone
        fmap = self._run_stages(x, list(bb.features))
        pooled = bb.avgpool(fmap)
        for layer in bb.classifier:
            if isinstance(layer, nn.Linear) and pooled.dim() > 2:
                pooled = pooled.flatten(1)
            pooled = layer(pooled)
        tokens = _flatten_map(fmap)
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        return EncoderOutput(pooled=pooled.flatten(1), tokens=tokens, mask=mask)

    def _forward_vit(self, x: Tensor) -> EncoderOutput:
        bb = self.backbone
        x = bb._process_input(x)
        x = torch.cat([bb.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        enc = bb.encoder
        x = enc.dropout(x + enc.pos_embedding)
        x = enc.ln(self._run_stages(x, list(enc.layers)))
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        return EncoderOutput(pooled=x[:, 0], tokens=x, mask=mask)

    def forward(self, images: Tensor) -> EncoderOutput:
        """Encodes (B, 3, H, W) normalized images."""
        return self._forward_impl(images)


def _torchvision_data_config(name: str, weights: str | None, image_size: int) -> dict[str, Any]:
    if weights is None or name in CUSTOM_IMAGE_ENCODERS:
        return image_data_config(image_size)
    entry = torchvision.models.get_model_weights(name).verify(weights)
    preset = entry.transforms()
    return image_data_config(image_size, preset.mean, preset.std, preset.interpolation.value)
