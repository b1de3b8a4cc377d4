"""``CLIPImageTower`` and ``CLIPTextTower``: the two halves of a Hugging Face ``CLIPModel`` or ``SiglipModel``
directory.

Name the same directory in both towers to fine-tune a pretrained dual encoder::

    image_tower: {class_path: mm_lightning.models.towers.CLIPImageTower, init_args: {name: /models/clip}}
    text_tower: {class_path: mm_lightning.models.towers.CLIPTextTower, init_args: {name: /models/clip}}

Each tower carries what the module needs to continue where the source left off:

- ``projection``: the source's projection into the shared space (CLIP's ``visual_projection`` /
  ``text_projection``; SigLIP has none: its pooling heads already end in the shared space, so ``Identity``);
- ``logit_scale`` / ``logit_bias``: the source's learned (log) temperature and, for SigLIP, bias.

So ``projection(tower(x).pooled)`` equals the library's ``get_image_features`` / ``get_text_features``. The
tokens (``last_hidden_state``) feed the optional fusion/ITM head. Normalization comes from the directory's image
processor config; the tokenizer is the directory's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel

from mm_lightning.assets import resolve_pretrained
from mm_lightning.models.towers.contract import ConfiguredTower, EncoderOutput
from mm_lightning.models.towers.hf_text import load_hf, set_hf_gradient_checkpointing
from mm_lightning.models.towers.hf_vision import image_processor_data_config

if TYPE_CHECKING:  # its module loads accelerate and more: only a run with this tower pays for it
    from transformers import PreTrainedModel


def load_dual_encoder(
    name: str, pretrained: bool = True, config_overrides: dict[str, Any] | None = None
) -> PreTrainedModel:
    """A ``CLIPModel`` or ``SiglipModel`` from a directory (or its config only, randomly initialised).

    Raises:
        ValueError: the directory holds another kind of model.
    """
    path = resolve_pretrained(name)
    overrides = dict(config_overrides or {})
    if pretrained:
        model = load_hf(AutoModel, name, path, **overrides)
    else:
        model = AutoModel.from_config(load_hf(AutoConfig, name, path, **overrides))
    from transformers import CLIPModel, SiglipModel

    if not isinstance(model, (CLIPModel, SiglipModel)):
        raise ValueError(
            f"{name} holds a {type(model).__name__}; CLIPImageTower and CLIPTextTower need a CLIPModel or "
            "SiglipModel directory (for a vision model alone use HFVisionTower)"
        )
    return model


def _logit_parameters(model: PreTrainedModel) -> tuple[float, float | None]:
    bias = getattr(model, "logit_bias", None)
    return float(model.logit_scale.detach()), None if bias is None else float(bias.detach())


class _DualEncoderHalf(ConfiguredTower):
    """What both halves share: the source's projection, logit scale/bias, checkpointing."""

    def __init__(self, source: PreTrainedModel, backbone: nn.Module, projection: nn.Module | None) -> None:
        super().__init__()
        self.model = backbone
        self.projection: nn.Module = projection if projection is not None else nn.Identity()
        self.logit_scale, self.logit_bias = _logit_parameters(source)
        self.source_type = source.config.model_type  # "clip" | "siglip"
        self.embed_dim = self.pooled_dim  # width after ``projection`` (set by subclasses before)
        if projection is not None:
            self.embed_dim = projection.out_features

    pooled_dim: int
    token_dim: int

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Hugging Face's per-layer activation checkpointing of this half."""
        set_hf_gradient_checkpointing(self.model, enabled)

    def layer_groups(self) -> list[list[str]]:
        """Parameter names from input to output: embeddings, each encoder layer, then the final norm (and
        SigLIP's pooling head)."""
        from mm_lightning.models.towers.layers import numbered_layer_groups

        return numbered_layer_groups(self, r"\.encoder\.layers\.(\d+)\.")


class CLIPImageTower(_DualEncoderHalf):
    """The vision half of a CLIP/SigLIP directory (``pooled`` = the vision model's ``pooler_output``).

    Args:
        name: the directory (or a hub name already in the local cache).
        pretrained: load the weights; False builds the architecture with random weights.
        image_size: input resolution; other than the checkpoint's, position embeddings are interpolated.
        config_overrides: config fields to override.
    """

    def __init__(
        self,
        name: str,
        pretrained: bool = True,
        image_size: int | None = None,
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        source = load_dual_encoder(name, pretrained, config_overrides)
        vision_config = source.config.vision_config
        self.pooled_dim = self.token_dim = vision_config.hidden_size
        super().__init__(source, source.vision_model, getattr(source, "visual_projection", None))
        self.name = name
        native = vision_config.image_size
        self._interpolate = image_size is not None and image_size != native
        self._data_config = image_processor_data_config(resolve_pretrained(name), native)
        self._data_config["pretrained"] = pretrained
        if image_size is not None:
            self._data_config["input_size"] = (3, image_size, image_size)

    def forward(self, images: Tensor) -> EncoderOutput:
        """Encodes (B, 3, H, W) normalized images."""
        out = self.model(pixel_values=images, interpolate_pos_encoding=self._interpolate)
        tokens = out.last_hidden_state
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        return EncoderOutput(pooled=out.pooler_output, tokens=tokens, mask=mask)


class CLIPTextTower(_DualEncoderHalf):
    """The text half of a CLIP/SigLIP directory (``pooled`` = the text model's ``pooler_output``).

    Args:
        name: the directory (also the tokenizer's).
        pretrained: load the weights; False builds the architecture with random weights.
        config_overrides: config fields to override.
    """

    def __init__(
        self, name: str, pretrained: bool = True, config_overrides: dict[str, Any] | None = None
    ) -> None:
        source = load_dual_encoder(name, pretrained, config_overrides)
        text_config = source.config.text_config
        self.token_dim = text_config.hidden_size
        self.pooled_dim = getattr(text_config, "projection_size", None) or text_config.hidden_size
        super().__init__(source, source.text_model, getattr(source, "text_projection", None))
        self.name = name
        self._data_config = {"tokenizer": self.tokenizer_for({"name": name})}
        self.max_length: int = text_config.max_position_embeddings

    @staticmethod
    def tokenizer_for(init_args: dict[str, Any]) -> str:
        """The directory's own tokenizer (the CLI links ``data.tokenizer`` to it)."""
        return str(init_args["name"])

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> EncoderOutput:
        """Encodes (B, L) token ids; padding positions have ``attention_mask == 0``."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return EncoderOutput(
            pooled=out.pooler_output, tokens=out.last_hidden_state, mask=attention_mask.bool()
        )
