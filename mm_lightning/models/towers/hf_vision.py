"""``HFVisionTower``: Hugging Face vision models as the image tower (ViT, DINOv2, CLIP and SigLIP vision).

The tower takes the model's token sequence (``last_hidden_state``) and its own pooled vector
(``pooler_output``: CLIP's post-LayerNorm class token, SigLIP's attention-pooling head, DINOv2's normed class
token; for ViT, whose optional tanh pooler is absent from classification checkpoints, the normed class token).
Normalization (mean, std, resize filter, input size) is read from the directory's image processor config
(``preprocessor_config.json``), so it matches the weights.

A full ``CLIPModel`` / ``SiglipModel`` directory works too: its vision half is loaded.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import transformers
from torch import Tensor
from transformers import AutoConfig, AutoModel

from mm_lightning.assets import resolve_pretrained
from mm_lightning.models.towers.contract import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ConfiguredTower,
    EncoderOutput,
    image_data_config,
)
from mm_lightning.models.towers.hf_text import load_hf, set_hf_gradient_checkpointing

log = logging.getLogger(__name__)

# dual-encoder configs whose vision half loads directly from the full checkpoint (by name: transformers loads a
# model's module on first use)
VISION_HALF = {"clip": "CLIPVisionModel", "siglip": "SiglipVisionModel"}


def _interpolation_name(resample: Any) -> str:
    """PIL resample code / enum or torchvision InterpolationMode -> ``bicubic``, ``bilinear``, ..."""
    if resample is None:
        return "bicubic"
    name = getattr(resample, "name", None) or getattr(resample, "value", None)
    if isinstance(name, str):
        return name.lower()
    from PIL import Image

    return Image.Resampling(int(resample)).name.lower()


def image_processor_data_config(
    path: str, default_size: int, trust_remote_code: bool = False
) -> dict[str, Any]:
    """mean, std, input_size and interpolation from a directory's image processor config.

    Falls back (with a warning) to ImageNet statistics when the directory has no processor config.
    """
    from transformers import AutoImageProcessor  # loads accelerate and more: only these towers pay for it

    try:
        processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        log.warning("%s has no image processor config (%s); using ImageNet mean/std", path, err)
        return image_data_config(default_size, IMAGENET_MEAN, IMAGENET_STD, "bicubic")
    size = getattr(processor, "crop_size", None) if getattr(processor, "do_center_crop", False) else None
    size = size or getattr(processor, "size", None) or {}
    size = dict(size.items()) if hasattr(size, "items") else dict(vars(size))
    side = size.get("height") or size.get("shortest_edge") or default_size
    return {
        "mean": tuple(float(m) for m in processor.image_mean),
        "std": tuple(float(s) for s in processor.image_std),
        "input_size": (3, int(side), int(size.get("width") or side)),
        "interpolation": _interpolation_name(getattr(processor, "resample", None)),
    }


class HFVisionTower(ConfiguredTower):
    """Image tower over a Hugging Face vision model.

    Args:
        name: local directory or hub name (``resolve_pretrained`` maps the project's built-in names).
        pretrained: load the weights; False builds the model from its config (random init).
        image_size: input resolution; when it differs from the config's, position embeddings are
            interpolated (ViT, CLIP, SigLIP; DINOv2 always interpolates). None keeps the config's.
        config_overrides: config fields to override (e.g. ``num_hidden_layers``).
        trust_remote_code: allow model code shipped with the directory; off by default for safety.
    """

    def __init__(
        self,
        name: str,
        pretrained: bool = True,
        image_size: int | None = None,
        config_overrides: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        path = resolve_pretrained(name)
        overrides = dict(config_overrides or {})
        config = load_hf(AutoConfig, name, path, trust_remote_code=trust_remote_code)
        half = VISION_HALF.get(config.model_type)
        model_cls = getattr(transformers, half) if half else AutoModel
        extra = {"add_pooling_layer": False} if config.model_type == "vit" else {}
        if pretrained:
            self.model = model_cls.from_pretrained(
                path, trust_remote_code=trust_remote_code, **overrides, **extra
            )
        else:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **overrides)
            config = getattr(config, "vision_config", config)
            self.model = model_cls.from_config(config, trust_remote_code=trust_remote_code, **extra)
        vision_config = self.model.config
        self.token_dim: int = vision_config.hidden_size
        self.pooled_dim: int = vision_config.hidden_size
        native = getattr(vision_config, "image_size", None)
        native = native if isinstance(native, int) else None
        takes_flag = "interpolate_pos_encoding" in inspect.signature(self.model.forward).parameters
        self._forward_kwargs = (
            {"interpolate_pos_encoding": True}
            if takes_flag and image_size is not None and native is not None and image_size != native
            else {}
        )
        self._data_config = image_processor_data_config(path, native or image_size or 224, trust_remote_code)
        self._data_config["pretrained"] = pretrained
        if image_size is not None:
            self._data_config["input_size"] = (3, image_size, image_size)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Hugging Face's per-layer activation checkpointing."""
        set_hf_gradient_checkpointing(self.model, enabled)

    def layer_groups(self) -> list[list[str]]:
        """Parameter names from input to output: embeddings (stem), each encoder layer or stage, then the final
        norm and pooler."""
        from mm_lightning.models.towers.layers import numbered_layer_groups

        return numbered_layer_groups(self, r"^model\.(?:\w+\.){0,2}(?:layer|layers|stages)\.(\d+)\.")

    def forward(self, images: Tensor) -> EncoderOutput:
        """Encodes (B, 3, H, W) normalized images."""
        out = self.model(pixel_values=images, **self._forward_kwargs)
        tokens = out.last_hidden_state
        pooled = getattr(out, "pooler_output", None)
        if pooled is None:
            pooled = tokens[:, 0]
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        return EncoderOutput(pooled=pooled, tokens=tokens, mask=mask)
